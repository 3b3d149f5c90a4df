"""The one module that imports the kubernetes client (being built; issue 2)."""
from __future__ import annotations


def detect_cluster(timeout: float = 3.0) -> tuple[bool, str]:
    """(reachable, reason)."""
    import os
    from pathlib import Path

    if not (os.environ.get("KUBERNETES_SERVICE_HOST") or Path(os.environ.get("KUBECONFIG", "~/.kube/config")).expanduser().exists()):
        return False, "no kubeconfig or in-cluster config found"
    return False, "cluster detection not implemented yet"
