"""The one module that imports the kubernetes client.

It loads the in-cluster config or a kubeconfig once, hands out cached API
objects, and turns "cannot reach the API server" into ClusterUnavailableError.
Tests substitute the cluster at the HTTP level (KUBECONFIG pointing at a local
server), so everything above this module runs unmodified.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator
from pathlib import Path

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from ctr_foundation.errors import ClusterUnavailableError
from elastic_control.kube.target import in_cluster, kubeconfig_path

__all__ = [
    "ApiException",
    "api_client",
    "core",
    "apps",
    "policy",
    "rbac",
    "custom",
    "apiextensions",
    "detect_cluster",
    "served_resources",
    "reset",
    "use_context",
    "to_dict",
    "stream_pod_log",
    "reachable",
    "server_url",
    "api_error_message",
]

_context: str | None = None  # the kubeconfig context to load (None: the current one)


def use_context(context: str | None) -> None:
    """Load ``context`` of the kubeconfig from now on (the plan's, from --context at -r)."""
    global _context
    if context != _context:
        _context = context
        reset()


def _kubeconfig_path() -> Path | None:
    return kubeconfig_path()


def _in_cluster() -> bool:
    # An explicit context means the kubeconfig, even inside a pod.
    return in_cluster() and _context is None


@functools.lru_cache(maxsize=1)
def api_client() -> client.ApiClient:
    """The shared ApiClient: in-cluster config inside a pod, else the kubeconfig (its ``use_context`` context)."""
    cfg = client.Configuration()
    try:
        if _in_cluster():
            config.load_incluster_config(client_configuration=cfg)
        elif _kubeconfig_path() is not None:
            config.load_kube_config(config_file=str(_kubeconfig_path()), context=_context, client_configuration=cfg)
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
def policy() -> client.PolicyV1Api:
    return client.PolicyV1Api(api_client())


@functools.lru_cache(maxsize=1)
def networking() -> client.NetworkingV1Api:
    return client.NetworkingV1Api(api_client())


@functools.lru_cache(maxsize=1)
def rbac() -> client.RbacAuthorizationV1Api:
    return client.RbacAuthorizationV1Api(api_client())


def access_allowed(namespace: str, verb: str, group: str, resource: str) -> bool:
    """The API server's answer to "may I ``verb`` ``resource`` in ``namespace``" (a SelfSubjectAccessReview,
    which every authenticated user may create)."""
    attributes = client.V1ResourceAttributes(namespace=namespace, verb=verb, group=group, resource=resource)
    review = client.V1SelfSubjectAccessReview(spec=client.V1SelfSubjectAccessReviewSpec(resource_attributes=attributes))
    answer = client.AuthorizationV1Api(api_client()).create_self_subject_access_review(review)
    return bool(answer.status and answer.status.allowed)


@functools.lru_cache(maxsize=1)
def custom() -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api_client())


@functools.lru_cache(maxsize=1)
def apiextensions() -> client.ApiextensionsV1Api:
    return client.ApiextensionsV1Api(api_client())


def reset() -> None:
    """Forget the loaded configuration and API objects (after KUBECONFIG changes)."""
    for cached in (api_client, core, apps, policy, networking, rbac, custom, apiextensions):
        cached.cache_clear()


def to_dict(obj) -> dict:
    """A typed model (or a dict) as the plain JSON-shaped dict the API server sent."""
    return obj if isinstance(obj, dict) else api_client().sanitize_for_serialization(obj)


def api_error_message(e: ApiException) -> str:
    """The API server's own message of an error answer (its Status object), else the HTTP reason."""
    return status_message(e.body, e.reason)


def status_message(body: str | None, reason: str | None) -> str:
    """The ``message`` of an error answer's JSON body (a Status object), else ``reason``."""
    try:
        message = json.loads(body or "").get("message")
    except (TypeError, ValueError, AttributeError):
        message = None
    return str(message or reason or "no message").strip()


@contextlib.contextmanager
def reachable(what: str) -> Iterator[None]:
    """Turn failures while doing ``what`` into one clear line.

    Connection failures become ClusterUnavailableError; an API answer that the
    caller did not handle itself (401, 403, 5xx...) becomes a ClusterUnavailableError
    naming the status, the server's message and, for 401/403, what to check.
    """
    try:
        yield
    except (urllib3.exceptions.HTTPError, OSError) as e:
        raise ClusterUnavailableError(
            f"cannot reach the Kubernetes API server at {server_url()} while {what}: {type(e).__name__}: {e}"
        ) from e
    except ApiException as e:
        hint = ""
        if e.status == 401:
            hint = "; the credentials of the kubeconfig were refused (expired token? run your cloud's login again)"
        elif e.status == 403:
            hint = "; your user lacks the RBAC rights for it (`kubectl auth can-i --list -n NAMESPACE` shows them)"
        raise ClusterUnavailableError(
            f"the Kubernetes API server at {server_url()} answered HTTP {e.status} {e.reason or ''} while {what}: "
            f"{api_error_message(e)}{hint}".replace("  ", " ")
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


def served_resources(group: str, version: str, timeout: float = 3.0) -> set[str] | None:
    """The resource plurals the API server serves under ``group/version`` (its discovery document), or None
    when it does not serve that group version; raises ClusterUnavailableError when it cannot be asked."""
    with reachable(f"discovering {group}/{version}"):
        try:
            found = custom().get_api_resources(group, version, _request_timeout=timeout)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
    return {r.name for r in found.resources or [] if "/" not in r.name}  # subresources (x/status) left out


def stream_pod_log(
    name: str,
    namespace: str,
    *,
    follow: bool = False,
    container: str | None = None,
    tail_lines: int | None = None,
    timestamps: bool = False,
    since_seconds: int | None = None,
    previous: bool = False,
) -> Iterator[str]:
    """Lines of a pod's log as they arrive (``follow``) or as they are; ends when the server closes the stream.

    With ``timestamps`` each line starts with the RFC 3339 time the kubelet recorded, then a space.
    """
    kwargs = {"follow": follow, "_preload_content": False}
    if container:
        kwargs["container"] = container
    if tail_lines is not None:
        kwargs["tail_lines"] = tail_lines
    if timestamps:
        kwargs["timestamps"] = True
    if since_seconds is not None:
        kwargs["since_seconds"] = since_seconds
    if previous:  # the container's previous instance (before its last restart), as the kubelet keeps it
        kwargs["previous"] = True
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
