"""The backend interface both implementations (Kubernetes, local) provide."""

from __future__ import annotations

import abc
from pathlib import Path

from elastic_control.plan import Plan


class Backend(abc.ABC):
    name: str

    @abc.abstractmethod
    def render(self, plan: Plan, staging: Path) -> list[Path]:
        """Write the backend's rendered files into ``staging`` (the state folder being built).

        Called by ``-r``; the staging folder replaces the state folder only if
        this returns without raising. Returns the files written.
        """

    @abc.abstractmethod
    def apply(self, plan: Plan, *, dry_run: str | None = None) -> None:
        """Start (or replace) every component of the plan; ``-a``."""

    @abc.abstractmethod
    def logs(self, plan: Plan, *, follow: bool = False, components: list[str] | None = None) -> None:
        """Print trainer 0's, the file server's and cube-transfer's logs; ``-l``."""

    @abc.abstractmethod
    def configure_client(self, plan: Plan) -> Path:
        """Find serving and the file server, fetch slot.conf, write the client config; ``-c``."""

    @abc.abstractmethod
    def status(self, plan: Plan) -> None:
        """Print a table of components and the training/rollout state."""

    @abc.abstractmethod
    def delete(self, plan: Plan) -> None:
        """Stop and remove everything the plan started (data and models stay)."""
