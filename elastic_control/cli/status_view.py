"""``status``: the status document of either backend, printed for people (stdout) or as JSON.

The document comes from ``Deployment.status()`` (elastic_control/backends/status.py);
this module only renders it. Everything printed here is data, so it goes to
stdout (``status > file`` keeps it); progress goes to stderr elsewhere.
"""

from __future__ import annotations

import json
import shutil
import sys

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ctr_foundation.records import parse_time
from elastic_control.backends import status as st

_STYLE = {
    st.RUNNING: "green",
    st.COMPLETED: "cyan",
    st.STARTING: "yellow",
    st.RESTARTING: "yellow",
    st.DEGRADED: "red",
    st.HUNG: "red",
    st.FAILED: "red",
    st.MISSING: "red",
}


def _console() -> Console:
    # Redirected (`status > file`): as wide as COLUMNS says, else 160 columns rather than 80.
    width = None if sys.stdout.isatty() else shutil.get_terminal_size((160, 24)).columns
    return Console(file=sys.stdout, highlight=False, soft_wrap=False, width=width)


def _when(value) -> str:
    """Local clock time of an epoch number or an ISO-8601 record time."""
    when = parse_time(value)
    return when.astimezone().strftime("%H:%M:%S") if when else "-"


def _secs(value) -> str:
    return "-" if not isinstance(value, (int, float)) else f"{value:.1f}s"


def print_status_json(status: st.PipelineStatus) -> None:
    sys.stdout.write(json.dumps(status.to_json(), indent=2, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()


def print_status(status: st.PipelineStatus) -> None:
    con = _console()
    ctl = status.controller
    if status.backend == "local":
        head = f"[bold]{status.state_dir}[/bold]: supervisor {status.state}"
        if ctl.get("pid"):
            head += f" (pid {ctl['pid']})"
    else:
        head = f"[bold]{status.target}[/bold]: {status.state}"
    con.print(head)

    table = Table(show_edge=False, pad_edge=False, header_style="bold")
    local = status.backend == "local"
    columns = ["component", "kind", "state", "detail"]
    columns += ["pid", "address", "restarts", "version", "last log line"] if local else ["ready"]
    for col in columns:
        wrap = col in ("detail", "last log line")
        table.add_column(col, overflow="fold" if wrap else "ellipsis", no_wrap=not wrap, max_width=60 if wrap else None)
    for c in status.components:
        style = _STYLE.get(c.state, "")
        row = [c.name, c.kind, Text(c.state, style=style), c.detail]
        if local:
            row += [str(c.pid or "-"), c.address or "-", str(c.restarts), c.version or "-", c.last_line[-160:]]
        else:
            row += [c.ready or "-"]
        table.add_row(*row)
    con.print(table)

    _print_training(con, status.training)
    _print_cube(con, status.cube)
    _print_serving(con, status.serving)
    if status.rollouts:
        t = Table(title="rollouts", show_edge=False, pad_edge=False, header_style="bold")
        for col in ("version", "donefile line", "activated", "served from", "cube build", "rollout", "freshness"):
            t.add_column(col)
        for r in status.rollouts:
            t.add_row(
                r["version"],
                _when(r.get("donefile_time")),
                _when(r.get("activated_at")),
                _when(r.get("served_at")),
                _secs(r.get("build_s")),
                _secs(r.get("total_s")),
                _secs(r.get("freshness_s")),
            )
        con.print(t)
    for alert in status.alerts:
        con.print(Text("! " + alert, style="yellow"))


def _print_training(con: Console, training: dict) -> None:
    if not training:
        return
    if "passes_done" not in training:  # a cluster: the job's phase only (passes are in the pods' MODEL_PATH)
        con.print(f"training: job {training.get('detail') or training.get('state')}")
        return
    line = f"training: {training['passes_done']}"
    line += f"/{training['passes_expected']}" if training.get("passes_expected") else ""
    line += " passes done"
    if training.get("last_pass"):
        auc = training.get("last_auc")
        about = [f"delta on {training['last_parent']}"] if training.get("last_kind") == "delta" else []
        about += [f"AUC {auc:.4f}"] if auc is not None else []
        line += f", latest {training['last_pass']}" + (f" ({', '.join(about)})" if about else "")
    keys = training.get("keys") or {}
    if keys:
        line += "; keys " + ", ".join(
            f"{name} {keys[name]}" for name in ("live", "admitted", "pending") if name in keys
        )
        line += f" ({keys.get('evicted', 0)} evicted by it)"
    if training.get("attempt"):
        line += (
            f"; job {training['state']}, attempt {training['attempt']}, "
            f"restarts {training['restarts']}/{training['max_restarts']}"
        )
        if training.get("reason") and (training["restarts"] or training["state"] == "failed"):
            line += f" (last: {training['reason']})"
    else:
        line += f"; job {training.get('state')}"
    con.print(line)


def _print_cube(con: Console, cube: dict) -> None:
    if not cube:
        return
    active = cube.get("active")
    line = f"active cube/model version: {active or 'none yet'}"
    if active:
        line += f" (activated {_when(cube.get('activated_at'))})"
    shards = cube.get("shards") or []
    if shards:
        line += "; shards: " + ", ".join(
            f"{s['shard']} {s.get('active') or '-'}" + ("" if s.get("probed") else " (not answering)") for s in shards
        )
    con.print(line)
    rollout = cube.get("rollout")
    if rollout:
        con.print(
            f"rollout in flight: {rollout.get('version')} ({rollout.get('phase')}, replacing "
            f"{rollout.get('previous') or 'nothing'}, since {_when(rollout.get('started_at'))})"
        )


def _print_serving(con: Console, serving: dict) -> None:
    if not serving:
        return
    version = serving.get("version")
    if serving.get("answers"):
        con.print(f"serving answers with {version}")
    elif version:
        con.print(Text(f"serving {serving.get('reason')}", style="red"))
    else:
        con.print(f"serving: no model yet ({serving.get('reason') or 'not answering'})")
    arms = serving.get("arms")
    if isinstance(arms, dict):
        arms = [dict(v, arm=k) if isinstance(v, dict) else {"arm": k, "value": v} for k, v in arms.items()]
    if isinstance(arms, list) and arms and all(isinstance(a, dict) for a in arms):
        keys = list(dict.fromkeys(k for a in arms for k, v in a.items() if not isinstance(v, (dict, list))))
        t = Table(title="serving arms", show_edge=False, pad_edge=False, header_style="bold")
        for k in keys:
            t.add_column(k)
        for a in arms:
            t.add_row(*[_cell(a.get(k)) for k in keys])
        con.print(t)
    _print_live(con, serving.get("live"))


def _print_live(con: Console, live) -> None:
    """Serving's /v1/monitor window per arm and version: predictions, joined clicks, observed CTR, calibration."""
    series = (live or {}).get("series") if isinstance(live, dict) else None
    if not isinstance(series, list) or not series:
        return
    window = live.get("window_seconds")
    title = "serving live metrics" + (f" (last {window:g} s, joined click feedback)" if window else "")
    t = Table(title=title, show_edge=False, pad_edge=False, header_style="bold")
    for col in ("arm", "version", "predictions", "mean prediction", "feedback", "clicks", "observed CTR"):
        t.add_column(col)
    for col in ("calibration", "log loss", "AUC", "unknown keys"):
        t.add_column(col)
    for s in series:
        if not isinstance(s, dict):
            continue
        pred, fb, cov = s.get("predictions") or {}, s.get("feedback") or {}, s.get("coverage") or {}
        t.add_row(
            *[
                _cell(v)
                for v in (
                    s.get("arm"),
                    s.get("version"),
                    pred.get("count"),
                    pred.get("mean"),
                    fb.get("count"),
                    fb.get("clicks"),
                    fb.get("observed_ctr"),
                    fb.get("calibration"),
                    fb.get("logloss"),
                    fb.get("auc"),
                    cov.get("unknown_share"),
                )
            ]
        )
    con.print(t)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)
