"""Which cluster a plan targets: the kubeconfig context, its API server and its namespace.

`-r` records the context and server in the plan; `-a`, `-l`, `-c`, `status`
and `delete` use that context and refuse to act when it now points at another
server (a kubeconfig switched to production since `-r` must not receive a
test plan's deletes). Read from the kubeconfig file alone: no network.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from ctr_foundation import env_vars
from ctr_foundation.errors import ClusterUnavailableError, UsageError

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


@dataclass(frozen=True)
class Target:
    context: str | None  # None: in-cluster, or no kubeconfig
    server: str | None
    namespace: str | None  # the context's namespace, when it sets one

    def describe(self) -> str:
        if self.context is None and self.server is None:
            return "no cluster configured"
        where = f"context {self.context}" if self.context else "in-cluster config"
        return f"{where} ({self.server or 'unknown server'})"


def kubeconfig_path() -> Path | None:
    """The kubeconfig the adaptor loads: the first existing file of KUBECONFIG, else ~/.kube/config."""
    raw = env_vars.KUBECONFIG.get() or ""
    for entry in filter(None, raw.split(os.pathsep)):
        if Path(entry).expanduser().exists():
            return Path(entry).expanduser()
    default = Path("~/.kube/config").expanduser()
    return default if not raw and default.exists() else None


def in_cluster() -> bool:
    return bool(env_vars.KUBERNETES_SERVICE_HOST.get())


def _load(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ClusterUnavailableError(f"cannot read the kubeconfig {path}: {type(e).__name__}: {e}") from e
    if not isinstance(data, dict):
        raise ClusterUnavailableError(f"the kubeconfig {path} is not a kubeconfig (not a mapping)")
    return data


def _named(items, name: str) -> dict | None:
    for item in items or []:
        if isinstance(item, dict) and item.get("name") == name:
            return item
    return None


def resolve_target(context: str | None = None) -> Target:
    """The context (given, else current), its server and namespace; raises if ``context`` is unknown."""
    path = kubeconfig_path()
    if path is None:
        if context is not None:
            raise UsageError(f"--context {context!r}: no kubeconfig found (set KUBECONFIG or create ~/.kube/config)")
        if in_cluster():
            host, port = env_vars.KUBERNETES_SERVICE_HOST.get(), env_vars.KUBERNETES_SERVICE_PORT.get()
            namespace = None
            if SERVICE_ACCOUNT_NAMESPACE.exists():
                namespace = SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or None
            return Target(None, f"https://{host}:{port}", namespace)
        return Target(None, None, None)
    config = _load(path)
    name = context or config.get("current-context")
    if not name:
        raise UsageError(f"the kubeconfig {path} has no current-context: pass --context NAME")
    entry = _named(config.get("contexts"), name)
    if entry is None:
        known = ", ".join(c.get("name", "?") for c in config.get("contexts") or [] if isinstance(c, dict))
        raise UsageError(f"--context {name!r} is not in the kubeconfig {path} (contexts: {known or 'none'})")
    ctx = entry.get("context") or {}
    cluster = _named(config.get("clusters"), ctx.get("cluster", "")) or {}
    server = (cluster.get("cluster") or {}).get("server")
    return Target(name, server, ctx.get("namespace") or None)


def check_target(context: str | None, recorded_server: str | None) -> Target:
    """The plan's target now; raises when its context points at another API server than at -r."""
    now = resolve_target(context)
    if recorded_server and now.server and now.server.rstrip("/") != recorded_server.rstrip("/"):
        raise UsageError(
            f"the plan was rendered for the cluster at {recorded_server} "
            f"({'context ' + context if context else 'the current context'}), but the kubeconfig now points at "
            f"{now.server}: fix the kubeconfig, or run -r again to target this cluster"
        )
    return now
