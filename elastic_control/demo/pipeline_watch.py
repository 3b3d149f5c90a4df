"""Following a running pipeline through its Deployment handle: training passes, then serving a version.

Used by the demo and the end-to-end tests: each wait shows progress on
stderr and fails with the relevant log's last lines instead of hanging. Only
the handle's status document and logs are read, so it works on any backend
whose status carries training passes and serving's version.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass, field

from ctr_foundation.errors import ComponentError
from ctr_foundation.progress import describe as describe_progress
from elastic_control.backends.base import Deployment
from elastic_control.backends.status import PipelineStatus
from elastic_control.console import console, done, info

PROGRESS_EVERY = 5.0  # seconds between the demo's progress lines of a pass in flight


@dataclass
class PassEvent:
    name: str
    done_at: float | None
    auc: float | None
    metrics: dict = field(default_factory=dict)
    kind: str = "base"  # base | delta


def log_tail(deployment: Deployment, component: str, lines: int = 12) -> str:
    """The last lines of a component's log, as -l shows them."""
    buffer = io.StringIO()
    try:
        deployment.stream_logs(components=[component], tail=lines, out=buffer)
    except Exception as e:  # noqa: BLE001 - a failure report must not fail on its own log
        return f"(no log: {e})"
    return buffer.getvalue().rstrip()


def _failure(deployment: Deployment, what: str, component: str = "trainer-0") -> str:
    return f"{what}; last lines of {component}'s log:\n{log_tail(deployment, component)}"


def _last_line(status: PipelineStatus, component: str) -> str:
    c = status.component(component)
    line = c.last_line if c else ""
    return "" if line.startswith("[supervisor") else line[-110:]


def _events(status: PipelineStatus) -> list[PassEvent]:
    return [
        PassEvent(p["pass"], p.get("done_at"), p.get("auc"), p.get("metrics") or {}, p.get("kind") or "base")
        for p in status.training["passes"]
    ]


def wait_for_training(
    deployment: Deployment, *, expected_passes: int, timeout: float, show: bool = True, on_pass=None
) -> list[PassEvent]:
    """Until the training job completed with ``expected_passes`` passes; the passes, in order.

    ``on_pass(event)`` is called once per new pass as it appears. With ``show``, the pass in flight's
    progress (trainer 0's: steps, examples/s, ETA) is printed every ``PROGRESS_EVERY`` seconds while it moves.
    """
    seen: set[str] = set()
    spinner = console.status("training: starting") if show else None
    shown = {"at": 0.0, "updated_at": None}

    def show_progress(training: dict) -> str | None:
        progress = training.get("progress")
        if not progress or training.get("state") not in ("running", "restarting"):
            return None
        text = describe_progress(progress)
        moved = progress.get("updated_at") != shown["updated_at"]
        if show and moved and time.monotonic() - shown["at"] >= PROGRESS_EVERY:
            shown.update(at=time.monotonic(), updated_at=progress.get("updated_at"))
            info(f"  {text}")
        return text

    def follow(status: PipelineStatus) -> None:
        training = status.training
        for event in _events(status):
            if event.name in seen:
                continue
            seen.add(event.name)
            if show:
                auc = f" (AUC {event.auc:.4f})" if event.auc is not None else ""
                done(f"pass {event.name} complete{auc}: {len(seen)}/{expected_passes}")
            if on_pass:
                on_pass(event)
        progress = show_progress(training)
        if spinner:
            restarts = f", restarted {training['restarts']}x" if training.get("restarts") else ""
            spinner.update(
                f"training: {training['passes_done']}/{expected_passes} passes{restarts} · "
                + (progress or f"trainer-0: {_last_line(status, 'trainer-0')}")
            )

    def finished(status: PipelineStatus) -> bool:
        t = status.training
        return t["state"] == "completed" and t["passes_done"] >= expected_passes

    def give_up(status: PipelineStatus) -> str | None:
        t = status.training
        if t["state"] == "completed":
            return _failure(deployment, f"training finished with {t['passes_done']} of {expected_passes} passes")
        if t["state"] == "failed":
            return _failure(deployment, f"training failed after {t['restarts']} restarts: {t['reason']}")
        if status.state != "running":
            return _failure(deployment, f"the supervisor stopped during training ({status.state})", "supervisor")
        return None

    if spinner:
        spinner.start()
    try:
        final = deployment.wait_for(
            finished, timeout=timeout, what="training", poll=0.5, on_status=follow, give_up=give_up
        )
    except ComponentError as e:
        if "did not happen within" in str(e):
            raise ComponentError(_failure(deployment, f"training did not finish within {timeout:.0f}s")) from e
        raise
    finally:
        if spinner:
            spinner.stop()
    return _events(final)


def wait_until_served(deployment: Deployment, version: str, *, timeout: float, show: bool = True) -> dict:
    """Until serving answers with ``version`` (probed); the rollout record (with its freshness) when there is one."""
    spinner = console.status(f"rolling out {version}") if show else None

    def follow(status: PipelineStatus) -> None:
        if spinner:
            current = status.serving.get("version")
            spinner.update(
                f"rolling out {version}: serving answers with {current or 'nothing yet'} · "
                f"cube-transfer: {_last_line(status, 'cube-transfer')}"
            )

    def give_up(status: PipelineStatus) -> str | None:
        if status.state != "running":
            return _failure(deployment, "the supervisor stopped during the rollout", "supervisor")
        return None

    if spinner:
        spinner.start()
    try:
        deployment.wait_for(
            lambda s: s.serving.get("answers") and s.serving.get("version") == version,
            timeout=timeout,
            what=f"serving {version}",
            poll=0.5,
            probe=True,
            on_status=follow,
            give_up=give_up,
        )
    except ComponentError as e:
        if "did not happen within" in str(e):
            current = deployment.status().serving
            raise ComponentError(
                _failure(
                    deployment,
                    f"serving did not answer with {version} within {timeout:.0f}s "
                    f"(it has {current.get('version') or 'nothing'}: {current.get('reason') or 'answering'})",
                    "cube-transfer",
                )
            ) from e
        raise
    finally:
        if spinner:
            spinner.stop()
    # The supervisor's watcher records the first time it saw the version; give it a moment.
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        for record in deployment.status(probe=False).rollouts:
            if record["version"] == version:
                return record
        time.sleep(0.1)
    return {"version": version, "served_at": time.time(), "freshness_s": None}
