"""The one module that imports the kubernetes client.

It loads the in-cluster config or a kubeconfig once, hands out cached API
objects, and turns "cannot reach the API server" into ClusterUnavailableError.
Tests substitute the cluster at the HTTP level (KUBECONFIG pointing at a local
server), so everything above this module runs unmodified.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from pathlib import Path

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from ctr_foundation import env_vars
from ctr_foundation.errors import ClusterUnavailableError

__all__ = [
    "ApiException",
    "api_client",
    "core",
    "apps",
    "custom",
    "apiextensions",
    "detect_cluster",
    "reset",
    "to_dict",
    "stream_pod_log",
    "reachable",
    "server_url",
]


def _kubeconfig_path() -> Path | None:
    raw = env_vars.KUBECONFIG.get() or ""
    # KUBECONFIG may be a list of files; the first existing one is enough to say "configured".
    for entry in filter(None, raw.split(os.pathsep)):
        if Path(entry).expanduser().exists():
            return Path(entry).expanduser()
    default = Path("~/.kube/config").expanduser()
    return default if not raw and default.exists() else None


def _in_cluster() -> bool:
    return bool(env_vars.KUBERNETES_SERVICE_HOST.get())


@functools.lru_cache(maxsize=1)
def api_client() -> client.ApiClient:
    """The shared ApiClient: in-cluster config inside a pod, else the kubeconfig."""
    cfg = client.Configuration()
    try:
        if _in_cluster():
            config.load_incluster_config(client_configuration=cfg)
        elif _kubeconfig_path() is not None:
            config.load_kube_config(config_file=str(_kubeconfig_path()), client_configuration=cfg)
        else:
            raise ClusterUnavailableError(
                "no Kubernetes configuration found: set KUBECONFIG or create ~/.kube/config (or use --backend local)"
            )
    except (ConfigException, OSError, ValueError) as e:
        raise ClusterUnavailableError(f"cannot load the Kubernetes configuration: {e}") from e
    # Fail fast instead of urllib3's silent retries: callers have their own deadlines.
    cfg.retries = 1
    return client.ApiClient(cfg)


def server_url() -> str:
    return api_client().configuration.host


@functools.lru_cache(maxsize=1)
def core() -> client.CoreV1Api:
    return client.CoreV1Api(api_client())


@functools.lru_cache(maxsize=1)
def apps() -> client.AppsV1Api:
    return client.AppsV1Api(api_client())


@functools.lru_cache(maxsize=1)
def custom() -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api_client())


@functools.lru_cache(maxsize=1)
def apiextensions() -> client.ApiextensionsV1Api:
    return client.ApiextensionsV1Api(api_client())


def reset() -> None:
    """Forget the loaded configuration and API objects (after KUBECONFIG changes)."""
    for cached in (api_client, core, apps, custom, apiextensions):
        cached.cache_clear()


def to_dict(obj) -> dict:
    """A typed model (or a dict) as the plain JSON-shaped dict the API server sent."""
    return obj if isinstance(obj, dict) else api_client().sanitize_for_serialization(obj)


@contextlib.contextmanager
def reachable(what: str) -> Iterator[None]:
    """Turn connection failures while doing ``what`` into one clear ClusterUnavailableError."""
    try:
        yield
    except (urllib3.exceptions.HTTPError, OSError) as e:
        raise ClusterUnavailableError(
            f"cannot reach the Kubernetes API server at {server_url()} while {what}: {type(e).__name__}: {e}"
        ) from e


def detect_cluster(timeout: float = 3.0) -> tuple[bool, str]:
    """(reachable, reason): really asks the API server for its version, within ``timeout`` seconds."""
    if not _in_cluster() and _kubeconfig_path() is None:
        return False, "no kubeconfig or in-cluster config found"
    try:
        api = api_client()
        info = client.VersionApi(api).get_code(_request_timeout=timeout)
    except ClusterUnavailableError as e:
        return False, str(e)
    except ApiException as e:
        # 401/403 still prove a cluster answers; the calls that need rights will say so.
        if e.status in (401, 403):
            return True, f"the Kubernetes API server at {server_url()} answered (HTTP {e.status} for /version)"
        return False, f"the Kubernetes API server at {server_url()} answered HTTP {e.status} for /version"
    except (urllib3.exceptions.HTTPError, OSError) as e:
        return (
            False,
            f"the Kubernetes API server at {server_url()} did not answer within {timeout:g}s ({type(e).__name__})",
        )
    except Exception as e:  # noqa: BLE001 - an answer that is not Kubernetes' (a proxy's HTML page, say)
        return False, f"{server_url()} did not answer like a Kubernetes API server ({type(e).__name__})"
    return True, f"the Kubernetes API server at {server_url()} answered (Kubernetes {info.git_version})"


def stream_pod_log(
    name: str, namespace: str, *, follow: bool = False, container: str | None = None, tail_lines: int | None = None
) -> Iterator[str]:
    """Lines of a pod's log as they arrive (``follow``) or as they are; ends when the server closes the stream."""
    kwargs = {"follow": follow, "_preload_content": False}
    if container:
        kwargs["container"] = container
    if tail_lines is not None:
        kwargs["tail_lines"] = tail_lines
    resp = core().read_namespaced_pod_log(name, namespace, **kwargs)
    pending = b""
    try:
        for chunk in resp.stream(amt=None, decode_content=False):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line.decode("utf-8", "replace")
        if pending:
            yield pending.decode("utf-8", "replace")
    finally:
        resp.release_conn()
