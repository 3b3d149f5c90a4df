"""The plan: what ``-r`` decided, stored as ``plan.json`` in the state folder.

``-a``, ``-l``, ``-c``, ``status`` and ``delete`` read it back, so they act on
exactly what was rendered.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ctr_foundation.errors import UsageError
from ctr_foundation.names import DATA_CONFIG_FILE, PLAN_FILE, SLOT_CONF_FILE, TOKEN_FILE
from elastic_control.config import DataConfig, Resources, SlotConf, load_data_config, parse_slot_conf

PLAN_FORMAT = 1
DEFAULT_IMAGE = "elastic-ctr:0.1.0"
DEFAULT_NAMESPACE = "default"
DEFAULT_JOB_NAME = "elastic-ctr"
TRAINING_ARGS_KEY = "training_args"  # plan.extra: the training roles' extra flags (tune --apply)


@dataclass(frozen=True)
class Plan:
    backend: str
    backend_reason: str
    resources: Resources
    slot_conf_text: str
    data_config_path: str
    hdfs_address: str = ""
    namespace: str = DEFAULT_NAMESPACE
    image: str = DEFAULT_IMAGE
    job_name: str = DEFAULT_JOB_NAME
    queue: str = "default"
    service_type: str = "ClusterIP"
    verbose: bool = False
    state_dir: str = ".elastic-ctr"
    extra: dict = field(default_factory=dict)
    kube: dict = field(default_factory=dict)  # elastic_control.kube.options.KubeOptions, as JSON
    format: int = PLAN_FORMAT

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir)

    @property
    def slot_conf(self) -> SlotConf:
        return parse_slot_conf(self.slot_conf_text, str(self.state_path / SLOT_CONF_FILE))

    def data_config(self) -> DataConfig:
        return load_data_config(self.state_path / DATA_CONFIG_FILE)

    def token(self) -> str:
        return (self.state_path / TOKEN_FILE).read_text().strip()

    @property
    def training_args(self) -> list[str]:
        """Flags every training role appends to ``elastic-control role`` (``extra["training_args"]``, which
        ``tune --apply`` writes: the winner's searched settings); empty for a plan that was never tuned."""
        return [str(a) for a in self.extra.get(TRAINING_ARGS_KEY, [])]

    def to_json(self) -> dict:
        d = asdict(self)
        d["resources"] = asdict(self.resources)
        return d

    @classmethod
    def from_json(cls, d: dict) -> Plan:
        d = dict(d)
        if d.get("format") != PLAN_FORMAT:
            raise UsageError(
                f"the state folder was written by an incompatible version (plan format "
                f"{d.get('format')!r}, this version reads {PLAN_FORMAT}); run -r again"
            )
        d["resources"] = Resources(**d["resources"])
        return cls(**d)


def load_plan(state_dir: str | Path) -> Plan:
    path = Path(state_dir) / PLAN_FILE
    if not path.exists():
        raise UsageError(f"no plan in {state_dir}/: run `elastic-control -r ...` first to configure resources")
    try:
        plan = Plan.from_json(json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError, KeyError) as e:
        raise UsageError(f"{path} is unreadable ({e}); run -r again") from e
    # The folder may have been moved since -r: trust where we found it.
    if Path(plan.state_dir).resolve() != Path(state_dir).resolve():
        from dataclasses import replace

        plan = replace(plan, state_dir=str(state_dir))
    return plan


def new_token() -> str:
    return secrets.token_urlsafe(32)
