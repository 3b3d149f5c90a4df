"""Backends: where the pipeline's components run (Kubernetes or local processes)."""

from __future__ import annotations

from elastic_control.backends.base import Backend


def get_backend(name: str) -> Backend:
    """The backend implementation for a plan's backend name."""
    if name == "k8s":
        from elastic_control.backends.kube_backend import KubeBackend

        return KubeBackend()
    if name == "local":
        from elastic_control.backends.local_backend import LocalBackend

        return LocalBackend()
    raise ValueError(f"unknown backend {name!r}")
