"""Following a running local pipeline: training passes, rollouts, and what serving answers with.

Used by the demo and the end-to-end tests: each wait shows progress on
stderr and fails with the relevant log's last lines instead of hanging.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ctr_foundation.errors import ComponentError
from ctr_foundation.names import StateFolder
from ctr_foundation.records import read_donefile
from elastic_control.console import console, done
from elastic_control.local import runtime as rt
from elastic_control.local.daemon import tail_lines
from elastic_control.local.rollouts import read_rollouts, served_version
from elastic_control.local.spec import load_local_plan
from elastic_control.local.status_view import pass_auc


def _last_line(layout: StateFolder, component: str) -> str:
    lines = [ln for ln in tail_lines(layout.log_path(component), 5) if ln.strip() and not ln.startswith("[supervisor")]
    return lines[-1][-110:] if lines else ""


def _failure(layout: StateFolder, what: str, component: str = "trainer-0") -> ComponentError:
    tail = "\n  ".join(tail_lines(layout.log_path(component), 12))
    return ComponentError(f"{what}; last lines of {layout.log_path(component)}:\n  {tail}")


@dataclass
class PassEvent:
    name: str
    done_at: float | None
    auc: float | None
    metrics: dict = field(default_factory=dict)


def wait_for_training(
    layout: StateFolder, *, expected_passes: int, timeout: float, show: bool = True, on_pass=None
) -> list[PassEvent]:
    """Until the training job completed with ``expected_passes`` passes in the donefile; the passes, in order."""
    plan = load_local_plan(layout.components_file)
    deadline = time.monotonic() + timeout
    seen: set[str] = set()
    status = console.status("training: starting") if show else None
    if status:
        status.start()
    try:
        while True:
            record = rt.read_runtime(layout) or {}
            job = record.get("job") or {}
            entries = read_donefile(plan.model_path)
            for e in entries:
                if e.pass_name not in seen:
                    seen.add(e.pass_name)
                    event = PassEvent(e.pass_name, e.epoch, pass_auc(e), e.metrics)
                    if show:
                        auc = f" (AUC {event.auc:.4f})" if event.auc is not None else ""
                        done(f"pass {event.name} complete{auc}: {len(seen)}/{expected_passes}")
                    if on_pass:
                        on_pass(event)
            if job.get("state") == rt.J_COMPLETED and len(entries) >= expected_passes:
                return [PassEvent(e.pass_name, e.epoch, pass_auc(e), e.metrics) for e in entries]
            if job.get("state") == rt.J_COMPLETED:
                raise _failure(layout, f"training finished with {len(entries)} of {expected_passes} passes")
            if job.get("state") == rt.J_FAILED:
                raise _failure(layout, f"training failed after {job.get('restarts')} restarts: {job.get('reason')}")
            if record and not rt.supervisor_info(layout).alive:
                raise _failure(layout, "the supervisor stopped during training", "supervisor")
            if time.monotonic() > deadline:
                raise _failure(layout, f"training did not finish within {timeout:.0f}s")
            if status:
                restarts = f", restarted {job.get('restarts')}x" if job.get("restarts") else ""
                status.update(
                    f"training: {len(entries)}/{expected_passes} passes{restarts} · trainer-0: "
                    f"{_last_line(layout, 'trainer-0')}"
                )
            time.sleep(0.5)
    finally:
        if status:
            status.stop()


def wait_until_served(layout: StateFolder, version: str, *, timeout: float, show: bool = True) -> dict:
    """Until serving answers with ``version``; the rollout record (with its freshness) when there is one."""
    plan = load_local_plan(layout.components_file)
    deadline = time.monotonic() + timeout
    status = console.status(f"rolling out {version}") if show else None
    if status:
        status.start()
    try:
        while True:
            current = served_version(plan.serving_url, timeout=2.0)
            if current == version:
                # The supervisor's watcher records the first time it saw the version; give it a moment.
                for _ in range(30):
                    for r in read_rollouts(layout):
                        if r["version"] == version:
                            return r
                    time.sleep(0.1)
                return {"version": version, "served_at": time.time(), "freshness_s": None}
            if not rt.supervisor_info(layout).alive:
                raise _failure(layout, "the supervisor stopped during the rollout", "supervisor")
            if time.monotonic() > deadline:
                raise _failure(
                    layout,
                    f"serving did not answer with {version} within {timeout:.0f}s "
                    f"(it answers with {current or 'nothing'})",
                    "cube-transfer",
                )
            if status:
                status.update(
                    f"rolling out {version}: serving answers with {current or 'nothing yet'} · "
                    f"cube-transfer: {_last_line(layout, 'cube-transfer')}"
                )
            time.sleep(0.25)
    finally:
        if status:
            status.stop()
