"""`status` for the local backend: components, training progress, active version, rollout freshness.

``collect_status`` gathers everything as plain data (tests and the demo use
it); ``print_status`` renders it with rich.
"""

from __future__ import annotations

from rich.table import Table

from ctr_foundation.errors import DataError
from ctr_foundation.names import StateFolder
from ctr_foundation.records import DonefileEntry, parse_time, read_current, read_donefile
from elastic_control.console import console
from elastic_control.local import runtime as rt
from elastic_control.local.daemon import tail_lines
from elastic_control.local.process import is_same_process
from elastic_control.local.rollouts import read_rollouts, served_version
from elastic_control.local.spec import load_local_plan

AUC_KEYS = ("auc", "holdout_auc", "test_auc", "eval_auc", "train_auc")


def pass_auc(entry: DonefileEntry) -> float | None:
    """The AUC recorded in a donefile line's metrics (the held-out one when there are several)."""
    metrics = entry.metrics
    for key in AUC_KEYS:
        if isinstance(metrics.get(key), (int, float)):
            return float(metrics[key])
    for key, value in metrics.items():
        if "auc" in key.lower() and isinstance(value, (int, float)):
            return float(value)
    return None


def expected_passes(layout: StateFolder) -> int | None:
    """Hours in the data window: the passes a finished (offline) job writes."""
    from elastic_control.config import load_data_config

    try:
        cfg = load_data_config(layout.local_data_config, env={})
    except Exception:  # noqa: BLE001 - status must not fail on a broken config; -r reports that
        return None
    return sum(1 for _ in cfg.hours())


def collect_status(layout: StateFolder, *, ask_serving: bool = True) -> dict:
    plan = load_local_plan(layout.components_file)
    info = rt.supervisor_info(layout)
    record = info.record or {}
    comps = record.get("components") or {}
    rows = []
    for spec in plan.components:
        c = comps.get(spec.name, {})
        state = c.get("state", "not started")
        alive = is_same_process(c.get("pid"), c.get("started"))
        if not info.alive and state in (rt.C_RUNNING, rt.C_STARTING):
            state = "running (unsupervised)" if alive else "gone"
        last = [ln for ln in tail_lines(layout.log_path(spec.name), 5) if ln.strip()]
        rows.append(
            {
                "name": spec.name,
                "kind": spec.kind,
                "state": state,
                "pid": c.get("pid") if alive else None,
                "port": spec.port,
                "restarts": c.get("restarts", 0),
                "last_exit": c.get("last_exit"),
                "last_line": last[-1] if last else "",
            }
        )
    entries = read_donefile(plan.model_path) if plan.model_path else []
    last_entry = entries[-1] if entries else None
    active = None
    try:
        current = read_current(layout.cube_root)
        active = current.to_json() if current else None
    except DataError:
        active = None
    serving = served_version(plan.serving_url, timeout=1.0) if ask_serving and plan.serving_url and info.alive else None
    if info.alive:
        supervisor = "running"
    elif record:
        supervisor = record.get("state", "unknown") if record.get("state") in (rt.STOPPED, rt.FAILED) else "not running"
    else:
        supervisor = "never started"
    return {
        "state_dir": str(layout.state),
        "supervisor": supervisor,
        "supervisor_pid": info.pid if info.alive else None,
        "pipeline_state": record.get("state"),
        "reason": record.get("reason", ""),
        "components": rows,
        "job": record.get("job"),
        "passes_done": len(entries),
        "passes_expected": expected_passes(layout),
        "last_pass": last_entry.pass_name if last_entry else None,
        "last_auc": pass_auc(last_entry) if last_entry else None,
        "active": active,
        "served_version": serving,
        "rollouts": read_rollouts(layout),
        "model_path": plan.model_path,
        "serving_url": plan.serving_url,
        "stale": bool(record) and not info.alive and record.get("state") not in (rt.STOPPED, rt.FAILED),
    }


def _when(value) -> str:
    """Local clock time of an epoch number or an ISO-8601 record time."""
    when = parse_time(value)
    return when.astimezone().strftime("%H:%M:%S") if when else "-"


_STATE_STYLE = {
    rt.C_RUNNING: "green",
    rt.C_COMPLETED: "cyan",
    rt.C_STARTING: "yellow",
    rt.C_WAITING: "yellow",
    rt.C_BACKOFF: "yellow",
    rt.C_FAILED: "red",
    "gone": "red",
}


def print_status(status: dict) -> None:
    head = f"[bold]{status['state_dir']}[/bold]: supervisor {status['supervisor']}"
    if status["supervisor_pid"]:
        head += f" (pid {status['supervisor_pid']})"
    if status["pipeline_state"] == rt.FAILED and status["reason"]:
        head += f" — start failed: {status['reason']}"
    if status["stale"]:
        head += (
            " — the last run ended without stopping cleanly (supervisor gone); "
            "`elastic-control -a` starts again, `elastic-control delete` cleans up"
        )
    console.print(head)
    table = Table(show_edge=False, pad_edge=False, header_style="bold")
    for col in ("component", "state", "pid", "port", "restarts", "last log line"):
        table.add_column(
            col, overflow="ellipsis", no_wrap=col != "last log line", max_width=70 if col == "last log line" else None
        )
    for r in status["components"]:
        style = _STATE_STYLE.get(r["state"], "")
        state = f"[{style}]{r['state']}[/{style}]" if style else r["state"]
        table.add_row(
            r["name"], state, str(r["pid"] or "-"), str(r["port"] or "-"), str(r["restarts"]), r["last_line"][-200:]
        )
    console.print(table)

    job = status["job"]
    line = f"training: {status['passes_done']}"
    line += f"/{status['passes_expected']}" if status["passes_expected"] else ""
    line += " passes done"
    if status["last_pass"]:
        auc = status["last_auc"]
        line += f", latest {status['last_pass']}" + (f" (AUC {auc:.4f})" if auc is not None else "")
    if job:
        line += f"; job {job['state']}, attempt {job['attempt']}, restarts {job['restarts']}/{job['max_restarts']}"
        if job.get("reason") and job["restarts"]:
            line += f" (last: {job['reason']})"
    console.print(line)

    active = status["active"]
    if active:
        console.print(
            f"active cube/model version: {active.get('version')} (activated {_when(active.get('activated_at'))})"
            + (f"; serving answers with {status['served_version']}" if status["served_version"] else "")
        )
    elif status["served_version"]:
        console.print(f"serving answers with {status['served_version']}")
    else:
        console.print("active cube/model version: none yet")
    if status["rollouts"]:
        t = Table(title="rollouts", show_edge=False, pad_edge=False, header_style="bold")
        for col in ("version", "donefile line", "activated", "served from", "cube build", "rollout", "freshness"):
            t.add_column(col)

        def secs(value) -> str:
            return "-" if not isinstance(value, (int, float)) else f"{value:.1f}s"

        for r in status["rollouts"]:
            t.add_row(
                r["version"],
                _when(r.get("donefile_time")),
                _when(r.get("activated_at")),
                _when(r.get("served_at")),
                secs(r.get("build_s")),
                secs(r.get("total_s")),
                secs(r.get("freshness_s")),
            )
        console.print(t)
