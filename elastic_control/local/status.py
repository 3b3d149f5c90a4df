"""``status`` of the local backend as the common status document, every component probed for real.

The supervisor's record says what it started; the probes say what answers:
a SIGSTOPped cube-server is hung, not running; serving that has a model but
whose cube shards do not hold it cannot answer; shards on different versions
while cube-transfer switches them are a rollout in flight. Nothing here
prints: the CLI renders the document (``elastic_control/cli/status_view.py``).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from ctr_foundation.errors import DataError
from ctr_foundation.names import StateFolder
from ctr_foundation.progress import FIELDS as PROGRESS_FIELDS
from ctr_foundation.progress import read_progress
from ctr_foundation.records import DonefileEntry, read_current, read_donefile
from elastic_control.backends import status as st
from elastic_control.config import load_data_config
from elastic_control.local import runtime as rt
from elastic_control.local.daemon import tail_lines
from elastic_control.local.health import Probe, probe_component
from elastic_control.local.ports import LOOPBACK
from elastic_control.local.process import is_same_process
from elastic_control.local.rollouts import read_rollouts
from elastic_control.local.spec import ComponentSpec, LocalPlan, load_local_plan

AUC_KEYS = ("auc", "holdout_auc", "test_auc", "eval_auc", "train_auc")
PASSES_LISTED = 100  # the status document lists the newest passes only (ONLINE jobs run for months)

# The supervisor's component states in the status document's words (before any probe).
_RECORDED = {
    rt.C_WAITING: st.STARTING,
    rt.C_STARTING: st.STARTING,
    rt.C_RUNNING: st.RUNNING,
    rt.C_BACKOFF: st.RESTARTING,
    rt.C_COMPLETED: st.COMPLETED,
    rt.C_FAILED: st.FAILED,
    rt.C_STOPPED: st.STOPPED,
}


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


# The incremental export's per-pass counts (training/delta_export.py), as status shows them.
KEY_COUNTS = ("keys_live", "keys_admitted", "keys_pending", "keys_new", "keys_newly_admitted", "keys_evicted", "rows")


def pass_keys(entry: DonefileEntry) -> dict:
    """{live, admitted, pending, new, newly_admitted, evicted, rows} of a pass; {} without incremental export."""
    return {k.removeprefix("keys_"): entry.metrics[k] for k in KEY_COUNTS if k in entry.metrics}


def expected_passes(layout: StateFolder) -> int | None:
    """Passes in the data window (hours, PASS_MINUTES slots or PASS_HOURS groups): what an offline job writes."""
    try:
        cfg = load_data_config(layout.local_data_config, env={})
    except Exception:  # noqa: BLE001 - status must not fail on a broken config; -r reports that
        return None
    return None if cfg.online else sum(1 for _ in cfg.pass_windows())


def _last_line(layout: StateFolder, name: str) -> str:
    lines = [ln for ln in tail_lines(layout.log_path(name), 5) if ln.strip()]
    return lines[-1] if lines else ""


def _supervisor_words(info: rt.SupervisorInfo) -> str:
    record = info.record or {}
    if info.alive:
        return "running"
    if record.get("state") in (rt.STOPPED, rt.FAILED):
        return record["state"]
    return "not running" if record else "never started"


def _recorded_component(spec: ComponentSpec, comp: dict, supervised: bool) -> st.ComponentStatus:
    """What the supervisor's record says, before anything is probed."""
    recorded = comp.get("state")
    alive = is_same_process(comp.get("pid"), comp.get("started"))
    state = _RECORDED.get(recorded, st.MISSING)
    detail = ""
    if recorded is None:
        detail = "not started"
    elif recorded == rt.C_WAITING:
        detail = "waiting for " + ", ".join(spec.after) if spec.after else "waiting"
    elif recorded == rt.C_BACKOFF:
        detail = f"exited ({comp.get('last_exit')}); restart scheduled"
    elif recorded in (rt.C_FAILED, rt.C_STOPPED, rt.C_COMPLETED) and comp.get("last_exit") is not None:
        detail = f"exit code {comp['last_exit']}"
    if not supervised and state in (st.RUNNING, st.STARTING):
        state, detail = (st.RUNNING, "unsupervised: the supervisor is gone") if alive else (st.MISSING, "gone")
    elif state in (st.RUNNING, st.STARTING) and not alive:
        state, detail = st.MISSING, "its process is gone"
    return st.ComponentStatus(
        name=spec.name,
        kind=spec.kind,
        state=state,
        detail=detail,
        address=f"{LOOPBACK}:{spec.port}" if spec.port else None,
        pid=comp.get("pid") if alive else None,
        restarts=int(comp.get("restarts") or 0),
    )


def collect_status(layout: StateFolder, *, probe: bool = True, timeout: float | None = None) -> st.PipelineStatus:
    """The whole pipeline's status; with ``probe``, every live component is asked (in parallel) now."""
    plan = load_local_plan(layout.components_file)
    info = rt.supervisor_info(layout)
    record = info.record or {}
    recorded = record.get("components") or {}
    rows = [_recorded_component(spec, recorded.get(spec.name, {}), info.alive) for spec in plan.components]
    for row in rows:
        row.last_line = _last_line(layout, row.name)[-300:]

    probes: dict[str, Probe] = {}
    if probe:
        live = [(spec, row) for spec, row in zip(plan.components, rows, strict=True) if row.pid]
        kwargs = {} if timeout is None else {"timeout": timeout}
        with ThreadPoolExecutor(max_workers=max(1, min(8, len(live)))) as pool:
            futures = {spec.name: pool.submit(probe_component, spec, row.pid, **kwargs) for spec, row in live}
        probes = {name: f.result() for name, f in futures.items()}
        for row in rows:
            seen = probes.get(row.name)
            if seen is not None and row.state in (st.RUNNING, st.STARTING):
                # What answers decides: a running process that does not answer is hung or degraded.
                row.state = seen.state
                row.detail = seen.detail or row.detail

    entries = read_donefile(plan.model_path) if plan.model_path else []
    status = st.PipelineStatus(
        backend="local",
        state_dir=str(layout.state),
        target="local processes",
        state=_supervisor_words(info),
        reason=record.get("reason", "") if record.get("state") == rt.FAILED else "",
        controller={
            "kind": "supervisor",
            "pid": info.pid if info.alive else None,
            "pipeline_state": record.get("state"),
            "stale": bool(record) and not info.alive and record.get("state") not in (rt.STOPPED, rt.FAILED),
            "foreign_format": bool(record.get("foreign_format")),
        },
        components=rows,
        training=_training(plan, layout, record, entries),
        rollouts=read_rollouts(layout),
        probed_at=time.time() if probe else None,
    )
    status.cube = _cube(plan, layout, rows, probes)
    status.serving = _serving(plan, rows, probes, status.cube)
    status.alerts = _alerts(status)
    return status


def progress_of(doc: dict | None) -> dict | None:
    """The status's ``training.progress``: the progress document's fields (and when it was written)."""
    if not doc:
        return None
    return {key: doc.get(key) for key in (*PROGRESS_FIELDS, "updated_at")}


def _training(plan: LocalPlan, layout: StateFolder, record: dict, entries: list[DonefileEntry]) -> dict:
    job = record.get("job") or {}
    last = entries[-1] if entries else None
    return {
        "state": job.get("state", "not started"),
        "attempt": job.get("attempt", 0),
        "restarts": job.get("restarts", 0),
        "max_restarts": job.get("max_restarts", plan.max_job_restarts),
        "reason": job.get("reason", ""),
        "started_at": job.get("started_at"),
        "finished_at": job.get("finished_at"),
        "window": plan.training_window,
        "passes_done": len(entries),
        "passes_expected": expected_passes(layout),
        "last_pass": last.pass_name if last else None,
        "last_auc": pass_auc(last) if last else None,
        "last_kind": last.kind if last else None,  # base | delta (delta passes)
        "last_parent": last.parent if last else None,
        "keys": pass_keys(last) if last else {},
        "passes": [
            {
                "pass": e.pass_name,
                "auc": pass_auc(e),
                "done_at": e.epoch,
                "window": e.window,
                "metrics": e.metrics,
                "kind": e.kind,
                "parent": e.parent,
            }
            for e in entries[-PASSES_LISTED:]
        ],
        "model_path": plan.model_path,
        # The pass in flight, as trainer 0 last wrote it (ctr_foundation/progress.py); None before any.
        "progress": progress_of(read_progress(plan.model_path)),
    }


def _cube(plan: LocalPlan, layout: StateFolder, rows: list[st.ComponentStatus], probes: dict[str, Probe]) -> dict:
    try:
        current = read_current(layout.cube_root)
    except DataError:
        current = None
    active = current.version if current else None
    transfer = probes.get("cube-transfer")
    transfer_status = (transfer.answers.get("/v1/status") if transfer else None) or {}
    rollout = transfer_status.get("in_flight") or None
    shards = []
    for row in rows:
        if row.kind != "cube-server":
            continue
        seen = probes.get(row.name)
        shard_status = (seen.answers.get("/v1/status") if seen else None) or {}
        versions = {k: shard_status.get(k) for k in ("active", "prepared", "previous")}
        row.version = versions["active"]
        shards.append(
            {
                "shard": int(row.name.rsplit("-", 1)[1]),
                "name": row.name,
                "state": row.state,
                **versions,
                "error": shard_status.get("error"),
                "probed": bool(shard_status),
            }
        )
        if row.state == st.RUNNING and shard_status:
            if versions["active"] is None:
                if active:
                    row.state = st.DEGRADED
                    row.detail = f"holds no version while {active} is active: its lookups answer 503"
                else:
                    row.state = st.STARTING
                    row.detail = "nothing loaded yet (waiting for the first rollout)"
            elif active and versions["active"] != active and not rollout:
                row.state = st.DEGRADED
                row.detail = f"serves {versions['active']} while {active} is active"
            else:
                row.detail = f"serving {versions['active']}"
    probed = [s for s in shards if s["probed"]]
    actives = {s["active"] for s in probed}
    return {
        "active": active,
        "activated_at": current.to_json()["activated_at"] if current else None,
        "shards": shards,
        "consistent": len(actives) <= 1 and len(probed) == len(shards),
        "rollout": rollout,
        # what cube-transfer failed at last, else what it found missing on the file server (its problems)
        "transfer_error": transfer_status.get("last_error")
        or "; ".join(str(p.get("error")) for p in transfer_status.get("problems") or [])
        or None,
        "transfer_problems": transfer_status.get("problems") or [],
    }


def _serving(plan: LocalPlan, rows: list[st.ComponentStatus], probes: dict[str, Probe], cube: dict) -> dict:
    row = next((r for r in rows if r.kind == "serving"), None)
    if row is None:
        return {}
    seen = probes.get(row.name)
    if seen is None:
        return {"version": None, "answers": False, "reason": row.detail or row.state, "url": plan.serving_url}
    body = seen.answers.get("/v1/status") or {}
    monitor = seen.answers.get("/v1/monitor")
    version = body.get("model_version")
    row.version = version
    ready = seen.codes.get("/readyz") == 200
    answers, reason = False, row.detail
    if row.state == st.HUNG or seen.codes.get("/readyz") is None:
        reason = row.detail or "no answer"
    elif not version:
        reason = row.detail or "no model loaded yet"
    else:
        # It can answer only if every shard answers and holds its version (lookups are pinned to it).
        missing = []
        for shard in cube.get("shards", []):
            held = {shard.get("active"), shard.get("prepared"), shard.get("previous")}
            if shard["state"] in (st.HUNG, st.MISSING, st.FAILED, st.STOPPED, st.RESTARTING):
                missing.append(f"{shard['name']} is {shard['state']}")
            elif shard["probed"] and version not in held:
                missing.append(f"{shard['name']} does not hold {version}")
        # A shard that cannot answer is the cause to name first: serving's own readiness only reports its
        # effect (a lookup that timed out).
        if missing:
            reason = f"has {version} loaded but cannot answer: {'; '.join(missing)}"
            if not ready and row.detail:
                reason += f" (serving: {row.detail})"
        elif not ready:
            reason = f"has {version} loaded but is not ready: {row.detail}"
        else:
            answers, reason = True, ""
        if not answers:
            row.state, row.detail = st.DEGRADED, reason
        else:
            row.detail = f"answering with {version}"
    arms = body.get("arms") or (monitor or {}).get("arms")
    return {
        "url": plan.serving_url,
        "version": version,
        "cube_version": body.get("cube_version"),
        "ready": ready,
        "answers": answers,
        "reason": reason,
        "arms": arms,
        "live": monitor,
        "metrics": body.get("metrics"),
        "last_reload_error": body.get("last_reload_error"),
    }


def _alerts(status: st.PipelineStatus) -> list[str]:
    alerts = []
    ctl = status.controller
    if ctl.get("stale"):
        alerts.append(
            "the last run ended without stopping cleanly (supervisor gone); `elastic-control -a` starts again, "
            "`elastic-control delete` cleans up"
        )
    if status.reason:
        alerts.append(f"start failed: {status.reason}")
    training = status.training
    if training.get("state") == rt.J_FAILED and training.get("reason"):
        alerts.append(f"training failed: {training['reason']}")
    for c in status.components:
        if c.state in (st.HUNG, st.DEGRADED) or (c.state == st.FAILED and c.kind not in ("pserver", "trainer")):
            alerts.append(f"{c.name} is {c.state}: {c.detail}")
    alerts += st.service_alerts(status)
    return list(dict.fromkeys(alerts))
