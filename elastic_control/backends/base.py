"""The backend interface both implementations (Kubernetes, local) provide.

``Backend.apply`` starts what ``-r`` rendered and returns a ``Deployment``: a
handle on the pipeline of one plan that can ``wait``, report ``status`` (as
data: the CLI prints it, ``status --json`` dumps it), ``stream_logs`` and
``delete`` (MLflow's submitted-run idea). ``Backend.attach`` gives the same
handle on what an earlier ``-a`` started, so ``-l``, ``status`` and ``delete``
work from a new process.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from ctr_foundation.errors import ComponentError
from elastic_control.backends.status import PipelineStatus
from elastic_control.plan import Plan


class Deployment(abc.ABC):
    """A handle on the running pipeline of one plan."""

    def __init__(self, plan: Plan):
        self.plan = plan

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> None:
        """Block until every long-running component is up (what ``-a`` waits for); raise saying what is stuck."""

    @abc.abstractmethod
    def status(self, *, probe: bool = True) -> PipelineStatus:
        """Components, training progress, cube and serving versions, rollouts and alerts.

        ``probe`` asks every component now (readiness, versions); without it
        only what the backend recorded is read, which is cheap enough to poll.
        """

    @abc.abstractmethod
    def stream_logs(
        self,
        *,
        components: list[str] | None = None,
        follow: bool = False,
        out: TextIO | None = None,
        tail: int | None = None,
        raw: bool = False,
    ) -> None:
        """Print the components' logs (default: trainer 0, the file server, cube-transfer), each line prefixed.

        Paddle's internal glog lines are left out unless ``raw`` (the log files keep everything).
        """

    @abc.abstractmethod
    def delete(self) -> list[str]:
        """Stop and remove everything the plan started (data, models and MLflow runs stay); idempotent.

        Returns what was stopped or removed.
        """

    def wait_for(
        self,
        condition: Callable[[PipelineStatus], bool],
        *,
        timeout: float,
        what: str,
        poll: float = 0.5,
        probe: bool = False,
        on_status: Callable[[PipelineStatus], None] | None = None,
        give_up: Callable[[PipelineStatus], str | None] | None = None,
    ) -> PipelineStatus:
        """Poll ``status`` until ``condition`` holds; the status that satisfied it.

        ``give_up(status)`` returns a reason to stop waiting (raised as
        ComponentError); so does the deadline.
        """
        deadline = time.monotonic() + timeout
        while True:
            status = self.status(probe=probe)
            if on_status is not None:
                on_status(status)
            if condition(status):
                return status
            reason = give_up(status) if give_up is not None else None
            if reason:
                raise ComponentError(reason)
            if time.monotonic() > deadline:
                raise ComponentError(f"{what} did not happen within {timeout:.0f}s")
            time.sleep(poll)


class Backend(abc.ABC):
    name: str

    @abc.abstractmethod
    def render(self, plan: Plan, staging: Path) -> list[Path]:
        """Write the backend's rendered files into ``staging`` (the state folder being built).

        Called by ``-r``; the staging folder replaces the state folder only if
        this returns without raising. Returns the files written.
        """

    @abc.abstractmethod
    def apply(self, plan: Plan, *, dry_run: str | None = None) -> Deployment | None:
        """Start (or converge) every component of the plan; ``-a``. None for a dry run.

        Returns without waiting: ``Deployment.wait`` waits for the components.
        """

    @abc.abstractmethod
    def attach(self, plan: Plan) -> Deployment:
        """The handle on what an earlier ``apply`` of this plan started (or on nothing yet)."""

    @abc.abstractmethod
    def configure_client(self, plan: Plan) -> Path:
        """Find serving and the file server, fetch slot.conf, write the client config; ``-c``."""

    @abc.abstractmethod
    def submit_evaluation(self, plan: Plan, request, *, timeout: float, poll: float = 2.0) -> dict:
        """Run an offline evaluation (``eval submit``) where the plan runs; return its metrics document."""
