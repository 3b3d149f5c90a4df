"""The handle on a local pipeline: wait for it, read its status, stream its logs, delete it.

``LocalBackend.apply`` returns one for the supervisor it just started;
``LocalBackend.attach`` makes one from the state folder alone, so any later
process (``-l``, ``status``, ``delete``, the demo) acts on the same pipeline.
"""

from __future__ import annotations

from typing import TextIO

from ctr_foundation.errors import UsageError
from ctr_foundation.names import StateFolder
from elastic_control.backends.base import Deployment
from elastic_control.backends.status import PipelineStatus
from elastic_control.console import done
from elastic_control.local import lifecycle
from elastic_control.local import runtime as rt
from elastic_control.local.logs_view import TAIL, show_logs
from elastic_control.local.status import collect_status
from elastic_control.plan import Plan


class LocalDeployment(Deployment):
    def __init__(self, plan: Plan, *, supervisor: tuple[int, float | None] | None = None, ready: bool = False):
        super().__init__(plan)
        self.layout = StateFolder.of(plan.state_dir)
        self._supervisor = supervisor  # (pid, start time) of the supervisor apply started, if it did
        self._ready = ready  # apply converged a running pipeline and waited for it already

    def wait(self, timeout: float | None = None, *, show_progress: bool = True) -> None:
        """Until the supervisor reports every component started; ComponentError with the failing log's tail."""
        if self._ready:
            return
        if self._supervisor is not None:
            pid, started = self._supervisor
        else:
            info = rt.supervisor_info(self.layout)
            if not info.alive:
                raise UsageError(f"the pipeline in {self.layout.state}/ is not running: run `elastic-control -a`")
            sup = (info.record or {}).get("supervisor") or {}
            pid, started = sup["pid"], sup.get("started")
        lifecycle.wait_started(
            self.layout,
            pid,
            started,
            timeout=lifecycle.STARTUP_TIMEOUT if timeout is None else timeout,
            show_progress=show_progress,
        )

    def status(self, *, probe: bool = True) -> PipelineStatus:
        return collect_status(self.layout, probe=probe)

    def stream_logs(
        self,
        *,
        components: list[str] | None = None,
        follow: bool = False,
        out: TextIO | None = None,
        tail: int | None = None,
        raw: bool = False,
    ) -> None:
        show_logs(
            self.layout, follow=follow, components=components, out=out, tail=TAIL if tail is None else tail, raw=raw
        )

    def delete(self) -> list[str]:
        stopped = lifecycle.delete(self.layout)
        if stopped:
            done(f"stopped {', '.join(stopped)}; data, models and logs are kept in {self.layout.state}/")
        else:
            done(f"nothing was running in {self.layout.state}/; data, models and logs are kept")
        return stopped
