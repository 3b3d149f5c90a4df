"""What the supervisor runs: one ComponentSpec per process, saved as local/components.json.

A spec is plain data (argv, environment, port, readiness check, which
components must be ready first, and the group deciding the failure policy),
so the supervisor can run anything: the pipeline's real entry points, or the
small child processes its unit tests use.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ctr_foundation.atomic import atomic_write_json
from ctr_foundation.errors import UsageError

COMPONENTS_FORMAT = 2  # 2: per-component secrets, the training window, pserver 0's barrier port

# Failure policies, as on the cluster:
#  - JOB: the training job (pservers + trainers). Any member failing restarts
#    every member (Volcano's RestartJob), up to ``max_job_restarts``; the job
#    completes when every trainer exited 0, and then its pservers are stopped.
#  - SERVICE: long-running; restarted with backoff whenever it exits.
JOB = "job"
SERVICE = "service"
GROUPS = (JOB, SERVICE)


@dataclass(frozen=True)
class ComponentSpec:
    name: str  # unique, also the log file name: logs/NAME.log
    kind: str  # pserver, trainer, fileserver, cube-server, ... (for people and for -l)
    argv: list[str]
    group: str = SERVICE
    env: dict[str, str] = field(default_factory=dict)  # added to the supervisor's environment
    port: int | None = None  # the port it listens on (None: no port)
    extra_ports: list[int] = field(default_factory=list)
    ready: str = "tcp"  # "tcp" (port accepts), "http:/path" (GET answers 2xx), "none" (ready once started)
    after: list[str] = field(default_factory=list)  # components that must be ready before this one starts
    cwd: str | None = None
    ready_timeout: float = 120.0
    make_dirs: list[str] = field(default_factory=list)  # created before each start (a pod's emptyDir volumes)
    # Names of the secret variables (e.g. ELASTIC_CTR_TOKEN) the supervisor hands this one, as its pod's Secret refs;
    # their values are never written here.
    secrets: list[str] = field(default_factory=list)

    def __post_init__(self):
        if self.group not in GROUPS:
            raise ValueError(f"component {self.name}: group {self.group!r} is not one of {GROUPS}")
        if self.ready != "none" and not (self.ready == "tcp" or self.ready.startswith("http:")):
            raise ValueError(f"component {self.name}: ready {self.ready!r} must be tcp, http:/PATH or none")
        if self.ready != "none" and self.port is None:
            raise ValueError(f"component {self.name}: a {self.ready} readiness check needs a port")

    @property
    def all_ports(self) -> list[int]:
        return ([self.port] if self.port is not None else []) + list(self.extra_ports)


@dataclass(frozen=True)
class LocalPlan:
    """The local backend's rendered plan: components plus a few policy settings."""

    components: list[ComponentSpec]
    max_job_restarts: int = 3
    stop_grace: float = 10.0
    pserver_exit_grace: float = 10.0  # after the trainers finish, pservers get this long to exit by themselves
    model_path: str | None = None  # where the rollout watcher reads the models donefile
    serving_url: str | None = None  # where it asks which version is served
    transfer_url: str | None = None  # cube-transfer, for each rollout's build/prepare/activate timings
    # Offline data window {"start", "end": "YYYYMMDD/HH", "dataset"}: a job that wrote no pass of it failed.
    training_window: dict | None = None
    format: int = COMPONENTS_FORMAT

    def __post_init__(self):
        names = [c.name for c in self.components]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"duplicate component names: {sorted(dup)}")
        known = set(names)
        for c in self.components:
            missing = [a for a in c.after if a not in known]
            if missing:
                raise ValueError(f"component {c.name} waits for unknown components {missing}")

    def by_name(self, name: str) -> ComponentSpec:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(name)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> LocalPlan:
        d = dict(d)
        d["components"] = [ComponentSpec(**c) for c in d["components"]]
        return cls(**d)


def save_local_plan(plan: LocalPlan, path: Path) -> None:
    atomic_write_json(path, plan.to_json())


def load_local_plan(path: Path) -> LocalPlan:
    """Read local/components.json; a missing or older file is a clear usage error."""
    if not path.exists():
        raise UsageError(
            f"{path} is missing: the state folder was not rendered for the local backend; "
            "run `elastic-control -r --backend local ...` first"
        )
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"{path} is unreadable ({e}); run -r again") from e
    if d.get("format") != COMPONENTS_FORMAT:
        raise UsageError(
            f"{path} comes from an older or newer version of elastic-control (format "
            f"{d.get('format')!r}, this version reads {COMPONENTS_FORMAT}); run -r again"
        )
    try:
        return LocalPlan.from_json(d)
    except (TypeError, ValueError) as e:
        raise UsageError(f"{path} is invalid ({e}); run -r again") from e
