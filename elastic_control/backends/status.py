"""The status document both backends produce: what ``status`` prints and ``status --json`` dumps.

Plain data only (every field is JSON), so the CLI, the demo and scripts read
the same thing. Component states are the same words on both backends.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

STATUS_FORMAT = 1

# Component states.
RUNNING = "running"  # up and answering its readiness check
STARTING = "starting"  # started (or waiting for what it depends on), not ready yet
DEGRADED = "degraded"  # up and answering, but cannot do its job (e.g. serving answers 503)
HUNG = "hung"  # alive but not answering (SIGSTOPped, deadlocked)
RESTARTING = "restarting"  # exited; a restart is scheduled
COMPLETED = "completed"  # a job member that finished its work
FAILED = "failed"
STOPPED = "stopped"
MISSING = "missing"  # planned, but nothing runs (never started, deleted, pod not created, process gone)
COMPONENT_STATES = (RUNNING, STARTING, DEGRADED, HUNG, RESTARTING, COMPLETED, FAILED, STOPPED, MISSING)
UNHEALTHY = (DEGRADED, HUNG, FAILED, MISSING)

# The pipeline's health as a whole (``pipeline_health``), worst first; `status` exits with a code per word.
HEALTH_NOT_RUNNING = "not running"  # nothing runs: never started, stopped, deleted, the supervisor gone
HEALTH_FAILED = "failed"  # the pipeline or its training job failed, or a component failed for good
HEALTH_DEGRADED = "degraded"  # runs, but a component is degraded, hung, missing or restarting
HEALTH_STARTING = "starting"  # runs, nothing is wrong, but a component is not ready yet (e.g. no model yet)
HEALTH_HEALTHY = "healthy"  # every component is running (or completed its work)
HEALTH_WORDS = (HEALTH_NOT_RUNNING, HEALTH_FAILED, HEALTH_DEGRADED, HEALTH_STARTING, HEALTH_HEALTHY)
# Pipeline states (``PipelineStatus.state``) in which nothing runs, on either backend.
_NOT_RUNNING_STATES = ("never started", "not running", "stopped", "not deployed")


@dataclass
class ComponentStatus:
    name: str  # e.g. trainer-0, cube-server-1, serving (a pod or object name on Kubernetes)
    kind: str  # pserver | trainer | fileserver | mlflow | cube-server | cube-agent | cube-transfer | serving | ...
    state: str  # one of COMPONENT_STATES
    detail: str = ""  # why: exit code, what the probe answered, the last log line
    address: str | None = None  # host:port it answers on, when it listens
    ready: str | None = None  # Kubernetes: "ready/desired" replicas
    pid: int | None = None  # local backend: the live process
    restarts: int = 0
    version: str | None = None  # the version it serves (cube shards, serving)
    last_line: str = ""  # the last line of its log (local backend)


@dataclass
class PipelineStatus:
    """Everything ``status`` shows, probed when it was built."""

    backend: str
    state_dir: str
    target: str  # where it runs: "local processes" or the cluster and namespace
    state: str  # the pipeline as a whole: running | starting | stopped | failed | never started | not running | ...
    reason: str = ""
    controller: dict = field(default_factory=dict)  # the supervisor (local) or the cluster (Kubernetes)
    components: list[ComponentStatus] = field(default_factory=list)
    # state, attempt, restarts, max_restarts, reason, passes_done, passes_expected, last_pass, last_auc,
    # last_kind (base|delta), last_parent, keys ({live, admitted, pending, new, newly_admitted, evicted, rows}
    # of the last pass, with incremental export), passes, progress (the pass in flight: {pass, epoch, epochs,
    # steps, steps_planned, examples_per_sec, eta_seconds, updated_at} from trainer 0, ctr_foundation/progress.py;
    # None before any)
    training: dict = field(default_factory=dict)
    # active, activated_at, shards: [{shard, active, prepared, previous, error}], consistent, rollout (in flight)
    cube: dict = field(default_factory=dict)
    # version, cube_version, answers (bool), reason, arms, live (metrics), alerts
    serving: dict = field(default_factory=dict)
    rollouts: list[dict] = field(default_factory=list)  # versions served and their freshness
    alerts: list[str] = field(default_factory=list)  # anything a person should look at
    probed_at: float | None = None
    format: int = STATUS_FORMAT

    def component(self, name: str) -> ComponentStatus | None:
        return next((c for c in self.components if c.name == name), None)

    def to_json(self) -> dict:
        """The document as JSON data, with its ``health`` and the reason for it (``pipeline_health``)."""
        doc = asdict(self)
        doc["health"], doc["health_reason"] = pipeline_health(self)
        return doc


def pipeline_health(status: PipelineStatus) -> tuple[str, str]:
    """(one of HEALTH_WORDS, why): the pipeline's health, from its state and its components' states."""
    if status.state == FAILED:
        return HEALTH_FAILED, status.reason or "the pipeline failed"
    if status.state in _NOT_RUNNING_STATES:
        return HEALTH_NOT_RUNNING, f"the pipeline is {status.state}"

    def named(states: tuple[str, ...]) -> list[str]:
        return [f"{c.name} {c.state}" for c in status.components if c.state in states]

    failed = named((FAILED,))
    if status.training.get("state") == FAILED and not failed:
        why = status.training.get("reason") or status.training.get("detail")
        failed = ["training failed" + (f": {why}" if why else "")]
    if failed:
        return HEALTH_FAILED, ", ".join(failed)
    degraded = named((DEGRADED, HUNG, MISSING, RESTARTING))
    if degraded:
        return HEALTH_DEGRADED, ", ".join(degraded)
    starting = named((STARTING,))
    if starting or status.state == STARTING:
        return HEALTH_STARTING, ", ".join(starting) or f"the pipeline is {status.state}"
    return HEALTH_HEALTHY, ""


def service_alerts(status: PipelineStatus) -> list[str]:
    """Alerts from what the services answered (cube shards, cube-transfer, serving and its monitor), for
    either backend: shards that disagree with no rollout in flight, a transfer error, a loaded serving
    that cannot answer, the serving monitor's own alerts (calibration band, coverage floor)."""
    alerts = []
    cube = status.cube
    probed = [s for s in cube.get("shards", []) if s["probed"]]
    if not cube.get("rollout") and len({s["active"] for s in probed}) > 1:
        versions = ", ".join(f"{s['name']} {s['active'] or '-'}" for s in cube.get("shards", []) if s["probed"])
        alerts.append(f"cube shards disagree with no rollout in flight: {versions}")
    if cube.get("transfer_error"):
        alerts.append(f"cube-transfer: {cube['transfer_error']}")
    serving = status.serving
    row = next((c for c in status.components if c.kind == "serving"), None)
    if serving.get("version") and not serving.get("answers") and not (row and row.state in (HUNG, DEGRADED)):
        alerts.append(f"serving {serving.get('reason')}")
    live = serving.get("live") or {}
    for alert in live.get("alerts") or []:
        alerts.append(f"serving monitor: {alert if isinstance(alert, str) else alert}")
    return alerts
