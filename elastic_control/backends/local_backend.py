"""Local backend (being built; issue 6)."""
from __future__ import annotations

from pathlib import Path

from elastic_control.backends.base import Backend
from elastic_control.errors import ElasticControlError


class LocalBackend(Backend):
    name = "local"

    def render(self, plan, staging: Path) -> list[Path]:
        return []

    def apply(self, plan, *, dry_run=None):
        raise ElasticControlError("the local backend is not implemented yet")

    logs = configure_client = status = delete = apply
