"""``status``: the status document of either backend, printed for people (stdout) or as JSON or YAML.

The document comes from ``Deployment.status()`` (elastic_control/backends/status.py);
this module only renders it. Everything printed here is data, so it goes to
stdout (``status > file`` keeps it); progress goes to stderr elsewhere.

Outputs (``-o``): ``text`` fits the components table to the terminal (the last
log line is cut with an ellipsis), ``wide`` shows every cell whole, ``json``
and ``yaml`` dump the whole document. Under ``json`` and ``yaml`` an error is a
document too (``{"error": ..., "kind": ...}``), so a script always reads one.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ctr_foundation.progress import describe as describe_progress
from ctr_foundation.records import parse_time
from elastic_control.backends import status as st

OUTPUTS = ("text", "wide", "json", "yaml")
DOCUMENT_OUTPUTS = ("json", "yaml")
YAML_WIDTH = 4096  # long strings (log lines, errors) stay on one line
WIDE_WIDTH = 10_000  # `-o wide`: no cell is cut; the terminal wraps what does not fit

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
_HEALTH_STYLE = {
    st.HEALTH_HEALTHY: "green",
    st.HEALTH_STARTING: "yellow",
    st.HEALTH_DEGRADED: "red",
    st.HEALTH_FAILED: "red",
    st.HEALTH_NOT_RUNNING: "yellow",
}


def _console(*, wide: bool = False) -> Console:
    # Redirected (`status > file`): as wide as COLUMNS says, else 160 columns rather than 80.
    if wide:
        width = WIDE_WIDTH
    else:
        width = None if sys.stdout.isatty() else shutil.get_terminal_size((160, 24)).columns
    return Console(file=sys.stdout, highlight=False, soft_wrap=False, width=width)


def _when(value) -> str:
    """Local clock time of an epoch number or an ISO-8601 record time."""
    when = parse_time(value)
    return when.astimezone().strftime("%H:%M:%S") if when else "-"


def _secs(value) -> str:
    return "-" if not isinstance(value, (int, float)) else f"{value:.1f}s"


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def print_status_json(status: st.PipelineStatus) -> None:
    _write(json.dumps(status.to_json(), indent=2, sort_keys=True, default=str) + "\n")


def print_status_yaml(status: st.PipelineStatus) -> None:
    import yaml

    # Through JSON first: the document's values become plain str, int, float, bool, None, list, dict.
    doc = json.loads(json.dumps(status.to_json(), default=str))
    _write(yaml.safe_dump(doc, sort_keys=True, default_flow_style=False, allow_unicode=True, width=YAML_WIDTH))


def print_error_document(message: str, kind: str, output: str) -> None:
    """An error as a document on stdout, for ``-o json`` and ``-o yaml``: ``{"error": ..., "kind": ...}``."""
    doc = {"error": message, "kind": kind}
    if output == "yaml":
        import yaml

        _write(yaml.safe_dump(doc, sort_keys=True, default_flow_style=False, allow_unicode=True, width=YAML_WIDTH))
    else:
        _write(json.dumps(doc, sort_keys=True) + "\n")


def render_status(status: st.PipelineStatus, output: str = "text") -> None:
    """Print ``status`` as ``output`` (one of OUTPUTS) on stdout."""
    if output == "json":
        print_status_json(status)
    elif output == "yaml":
        print_status_yaml(status)
    else:
        print_status(status, wide=output == "wide")


def watch_status(
    read: Callable[[], st.PipelineStatus],
    *,
    output: str = "text",
    interval: float = 2.0,
    updates: int | None = None,
    on_status: Callable[[st.PipelineStatus], None] | None = None,
) -> st.PipelineStatus | None:
    """Read and print the status every ``interval`` seconds until Ctrl-C (or ``updates`` times); the last one
    shown (Ctrl-C before the first one is raised).

    On a terminal the text outputs redraw the screen; redirected, each update follows the last one
    (JSON documents one after another, YAML documents separated by ``---``).
    """
    last = None
    shown = 0
    redraw = output not in DOCUMENT_OUTPUTS and sys.stdout.isatty()
    try:
        while updates is None or shown < updates:
            started = time.monotonic()
            status = read()
            if redraw:
                _write("\x1b[H\x1b[2J")
            elif shown and output == "yaml":
                _write("---\n")
            elif shown and output not in DOCUMENT_OUTPUTS:
                _write("\n")
            render_status(status, output)
            last, shown = status, shown + 1
            if on_status is not None:
                on_status(status)
            if updates is not None and shown >= updates:
                break
            time.sleep(max(0.0, interval - (time.monotonic() - started)))
    except KeyboardInterrupt:
        if last is None:
            raise
    return last


def print_status(status: st.PipelineStatus, *, wide: bool = False) -> None:
    """The status for people: a headline with the health, one row per component, then training, cube,
    serving, rollouts and alerts. ``wide`` shows every cell whole; else the table fits the terminal."""
    con = _console(wide=wide)
    ctl = status.controller
    if status.backend == "local":
        head = f"[bold]{status.state_dir}[/bold]: supervisor {status.state}"
        if ctl.get("pid"):
            head += f" (pid {ctl['pid']})"
    else:
        head = f"[bold]{status.target}[/bold]: {status.state}"
    con.print(head)
    health, why = st.pipeline_health(status)
    line = Text("health: ")
    line.append(health, style=_HEALTH_STYLE.get(health, ""))
    if why and health != st.HEALTH_NOT_RUNNING:
        line.append(f" ({why})")
    con.print(line, overflow="ellipsis", no_wrap=not wide, crop=not wide)

    con.print(_components_table(status, width=None if wide else con.width))

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


DETAIL_WIDTH = 48  # `text`: the detail column's widest (it gives way first to the last log line's minimum)
MIN_LOG_WIDTH = 12


def _components_table(status: st.PipelineStatus, *, width: int | None) -> Table:
    """One line per component. Cells never wrap: with a ``width`` (``text``) the detail and the last log
    line are cut with an ellipsis so that the table fits it; without one (``wide``) nothing is cut."""
    local = status.backend == "local"
    columns = ["component", "kind", "state", "detail"]
    columns += ["pid", "address", "restarts", "version", "last log line"] if local else ["ready"]
    rows = []
    for c in status.components:
        row = [c.name, c.kind, c.state, c.detail]
        if local:
            row += [str(c.pid or "-"), c.address or "-", str(c.restarts), c.version or "-", c.last_line]
        else:
            row += [c.ready or "-"]
        rows.append(row)
    fits = [max([len(col), *(len(r[i]) for r in rows)]) for i, col in enumerate(columns)]
    if width is not None:
        # Every other column keeps its width; detail, then the last log line, take what is left.
        free = width - 3 * (len(columns) - 1) - (sum(fits) - fits[3])
        if local:
            free += fits[-1]
            log = max(MIN_LOG_WIDTH, free - min(fits[3], DETAIL_WIDTH))
            fits[-1] = min(fits[-1], log)
            free -= fits[-1]
        fits[3] = max(len("detail"), min(fits[3], DETAIL_WIDTH, free))
    table = Table(show_edge=False, pad_edge=False, header_style="bold")
    for col, w in zip(columns, fits, strict=True):
        table.add_column(col, no_wrap=True, overflow="ellipsis", width=None if width is None else w)
    for row in rows:
        row[2] = Text(row[2], style=_STYLE.get(row[2], ""))
        table.add_row(*row)
    return table


def _print_training(con: Console, training: dict) -> None:
    if not training:
        return
    if "passes_done" not in training:  # a cluster: the job's phase (passes are in the pods' MODEL_PATH)
        con.print(f"training: job {training.get('detail') or training.get('state')}")
        _print_progress(con, training)  # trainer 0's, from the job's annotation
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
    _print_progress(con, training)


def _print_progress(con: Console, training: dict) -> None:
    progress = training.get("progress")
    if progress and training.get("state") in ("running", "restarting"):
        con.print(f"progress: {describe_progress(progress)}")


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
