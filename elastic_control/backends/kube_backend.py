"""Kubernetes backend (being built; issue 2)."""
from __future__ import annotations

from pathlib import Path

from elastic_control.backends.base import Backend
from elastic_control.errors import ElasticControlError


class KubeBackend(Backend):
    name = "k8s"

    def render(self, plan, staging: Path) -> list[Path]:
        return []

    def apply(self, plan, *, dry_run=None):
        raise ElasticControlError("the Kubernetes backend is not implemented yet")

    logs = configure_client = status = delete = apply
