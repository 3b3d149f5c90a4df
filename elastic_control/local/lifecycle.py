"""-a and delete for the local backend: start the supervisor and wait for it, stop everything.

Both leave no orphan: start refuses to start over a live supervisor and first
stops anything an earlier, dead supervisor left behind (-a on a running
pipeline converges it instead: ``converge``, local/converge.py); delete asks
the supervisor to stop its children, and kills whatever is left if it cannot.
"""

from __future__ import annotations

import os
import signal
import time

from ctr_foundation.errors import ComponentError, UsageError
from ctr_foundation.names import StateFolder
from elastic_control.console import console, done, info, warn
from elastic_control.local import converge as cv
from elastic_control.local import runtime as rt
from elastic_control.local.components import publish_config
from elastic_control.local.daemon import rotate_logs, spawn_supervisor, tail_lines
from elastic_control.local.ports import port_is_free, port_owner
from elastic_control.local.process import is_same_process, process_identity, stop_components
from elastic_control.local.spec import LocalPlan, load_local_plan

STARTUP_TIMEOUT = 300.0
DELETE_TIMEOUT = 60.0


def ensure_not_running(layout: StateFolder) -> None:
    info = rt.supervisor_info(layout)
    if info.alive:
        raise UsageError(
            f"the pipeline in {layout.state}/ is already running (supervisor pid {info.pid}); "
            "see `elastic-control status`, or stop it with `elastic-control delete` before -a"
        )


def stop_leftovers(layout: StateFolder, record: dict | None, grace: float = 5.0) -> list[str]:
    """Stop processes an earlier supervisor recorded that are still alive (it died without stopping them)."""
    if not record:
        return []
    pids, names = [], []
    for name, comp in (record.get("components") or {}).items():
        if is_same_process(comp.get("pid"), comp.get("started")):
            pids.append(comp["pid"])
            names.append(name)
    if pids:
        stop_components(pids, grace)
    return names


def check_ports(plan: LocalPlan) -> None:
    """Every planned port must be free before anything starts."""
    problems = []
    for comp in plan.components:
        for port in comp.all_ports:
            if not port_is_free(port):
                owner = port_owner(port)
                problems.append(f"{comp.name} port {port}" + (f" (held by {owner})" if owner else ""))
    if problems:
        raise UsageError(
            "planned ports are in use: "
            + "; ".join(problems)
            + ". Run `elastic-control -r ...` again to choose free ports"
        )


def start(layout: StateFolder) -> tuple[int, float | None]:
    """Start the detached supervisor (after the checks); (its pid, its start time). Does not wait."""
    plan = load_local_plan(layout.components_file)
    ensure_not_running(layout)
    previous = rt.read_runtime(layout)
    left = stop_leftovers(layout, previous)
    if left:
        warn(f"stopped processes an earlier run left behind: {', '.join(left)}")
    check_ports(plan)
    publish_config(layout)
    rotate_logs(layout)
    layout.runtime_file.unlink(missing_ok=True)
    layout.rollouts_file.unlink(missing_ok=True)
    pid = spawn_supervisor(layout)
    return pid, process_identity(pid)


def apply(layout: StateFolder, *, timeout: float = STARTUP_TIMEOUT, show_progress: bool = True) -> dict:
    """Start the supervisor and wait until every component started (or the start failed)."""
    pid, started = start(layout)
    return wait_started(layout, pid, started, timeout=timeout, show_progress=show_progress)


def converge(layout: StateFolder, *, timeout: float = cv.CONVERGE_TIMEOUT, dry_run: bool = False) -> list[cv.Change]:
    """-a on a running pipeline: apply only what the rendered plan changes (local/converge.py)."""
    record = rt.supervisor_info(layout).record or {}
    if "generation" not in record:
        raise UsageError(
            f"the pipeline in {layout.state}/ runs under a supervisor of an older elastic-control, which cannot "
            "load a new plan; stop it with `elastic-control delete`, then -a"
        )
    plan = load_local_plan(layout.components_file)
    comps = record.get("components") or {}
    changes = cv.plan_changes(plan, layout, {n: c.get("spec_hash") for n, c in comps.items()})
    changed = [c for c in changes if c.action != "unchanged"]
    if not changed:
        done(f"unchanged: the {len(changes)} components in {layout.state}/ already run this plan; nothing to do")
        return changes
    restart_job = cv.job_changed(plan, changes, {n: c.get("group") for n, c in comps.items()})
    prefix = "would be " if dry_run else ""
    for change in changed:
        info(f"  {change.name} {prefix}{change.action}")
    if restart_job:
        info(f"  the training job {prefix}restarted (its plan changed): the trainers resume after the last pass")
    if dry_run:
        info(f"  {len(changes) - len(changed)} unchanged (nothing applied: --dry-run)")
        return changes
    publish_config(layout)
    generation = int(record["generation"]) + 1
    cv.request_apply(layout, generation)
    cv.wait_converged(layout, generation, timeout=timeout)
    counts = {a: sum(c.action.split()[0] == a for c in changes) for a in ("created", "updated", "pruned", "unchanged")}
    done("applied the plan: " + ", ".join(f"{n} {a}" for a, n in counts.items()))
    return changes


def _progress_text(record: dict | None) -> str:
    if not record:
        return "starting the supervisor"
    comps = record.get("components", {})
    up = [n for n, c in comps.items() if c["state"] in (rt.C_RUNNING, rt.C_COMPLETED)]
    waiting = [n for n, c in comps.items() if c["state"] in (rt.C_STARTING, rt.C_WAITING)]
    text = f"starting components: {len(up)}/{len(comps)} up"
    if waiting:
        text += f" (waiting for {', '.join(waiting[:4])}{'…' if len(waiting) > 4 else ''})"
    return text


def wait_started(
    layout: StateFolder, pid: int, started: float | None, *, timeout: float, show_progress: bool = True
) -> dict:
    deadline = time.monotonic() + timeout
    status = console.status(_progress_text(None)) if show_progress else None
    if status:
        status.start()
    try:
        while True:
            record = rt.read_runtime(layout)
            mine = record and (record.get("supervisor") or {}).get("pid") == pid
            if mine and record["state"] == rt.RUNNING:
                done(
                    f"started {len(record.get('components') or {})} components under supervisor pid {pid}; "
                    f"logs in {layout.logs_dir}/ (`elastic-control -l`, `elastic-control status`)"
                )
                return record
            if mine and record["state"] == rt.FAILED:
                raise ComponentError(
                    f"local start failed: {record.get('reason')}" + _log_hint(layout, record.get("reason", ""))
                )
            if not is_same_process(pid, started):
                tail = "\n".join(tail_lines(layout.supervisor_log, 8))
                raise ComponentError(
                    f"the supervisor (pid {pid}) exited during start; last lines of {layout.supervisor_log}:\n{tail}"
                )
            if time.monotonic() > deadline:
                _kill_supervisor(layout, pid, started)
                raise ComponentError(
                    f"components did not all start within {timeout:.0f}s "
                    f"({_progress_text(record)}); everything was stopped. See {layout.logs_dir}/"
                )
            if status:
                status.update(_progress_text(record if mine else None))
            time.sleep(0.2)
    finally:
        if status:
            status.stop()


def _log_hint(layout: StateFolder, reason: str) -> str:
    """The last lines of the failing component's log, when the reason names one."""
    for log in sorted(layout.logs_dir.glob("*.log")):
        if str(log) in reason:
            lines = [ln for ln in tail_lines(log, 6) if ln.strip()]
            if lines:
                return "\n  " + "\n  ".join(lines)
    return ""


def _kill_supervisor(layout: StateFolder, pid: int, started: float | None, timeout: float = DELETE_TIMEOUT) -> bool:
    """Ask the supervisor to stop (it stops its children); True if it exited within ``timeout``."""
    if not is_same_process(pid, started):
        return True
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not is_same_process(pid, started):
            return True
        time.sleep(0.1)
    return False


def delete(layout: StateFolder) -> list[str]:
    """Stop the supervisor and every component; data, models and logs stay. Returns what was stopped."""
    info = rt.supervisor_info(layout)
    record = info.record
    if record is None:
        return []  # never started: nothing to stop (delete is idempotent)
    stopped: list[str] = []
    sup = record.get("supervisor") or {}
    if info.alive:
        if not _kill_supervisor(layout, sup["pid"], sup.get("started")):
            warn(f"the supervisor (pid {sup['pid']}) did not stop in {DELETE_TIMEOUT:.0f}s; killing it")
            try:
                os.kill(sup["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
        stopped.append(f"supervisor (pid {sup['pid']})")
    # Whatever is still alive (the supervisor was killed, or died earlier) is stopped here.
    latest = rt.read_runtime(layout) or record
    stopped += stop_leftovers(layout, latest)
    return stopped
