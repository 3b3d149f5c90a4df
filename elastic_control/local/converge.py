"""`-a` on a running local pipeline converges it on the plan, as on Kubernetes (kube/converge.py).

Every component has a spec hash: its ComponentSpec (argv, environment, ports,
readiness, dependencies) and the content of the configuration files it names
(the plan's data.config and slot.conf, as a pod's checksum annotation covers
its ConfigMap). The supervisor records the hash of what it runs in
runtime.json. ``-a`` compares the rendered plan with it:

- nothing differs: nothing is written, nothing restarts (-a says so);
- otherwise it asks the supervisor (an apply request file, read by its loop)
  to load the plan: components no longer planned are stopped (pruned), new
  ones started, services whose hash changed restarted; the training job is
  restarted only if one of its members changed, was added or was removed
  (its trainers resume after the last complete pass). Everything else keeps
  running: MLflow's runs, the cube versions and the donefile stay.

``-r`` under a running pipeline keeps every planned component's ports (new
components get free ones), so an unchanged component renders the same spec.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass

from ctr_foundation.atomic import atomic_write_json
from ctr_foundation.errors import ComponentError
from ctr_foundation.names import StateFolder
from elastic_control.local import runtime as rt
from elastic_control.local.spec import JOB, ComponentSpec, LocalPlan

CONVERGE_TIMEOUT = 300.0


def apply_request_file(layout: StateFolder):
    return layout.local_dir / "apply-request.json"


def config_files(layout: StateFolder) -> list:
    """The configuration files a component may name in its argv or environment."""
    return [layout.local_data_config, layout.slot_conf]


def spec_hash(spec: ComponentSpec, layout: StateFolder) -> str:
    h = hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode())
    named = " ".join([*spec.argv, *spec.env.values()])
    for path in config_files(layout):
        if str(path) in named:
            try:
                h.update(path.read_bytes())
            except FileNotFoundError:
                h.update(b"(missing)")
    return h.hexdigest()[:16]


def spec_hashes(plan: LocalPlan, layout: StateFolder) -> dict[str, str]:
    return {c.name: spec_hash(c, layout) for c in plan.components}


@dataclass(frozen=True)
class Change:
    name: str
    action: str  # created | updated | pruned | unchanged

    def describe(self) -> str:
        return f"{self.name} {self.action}"


def plan_changes(plan: LocalPlan, layout: StateFolder, running: dict[str, str | None]) -> list[Change]:
    """What loading ``plan`` changes, given the hash of each running component (name -> hash)."""
    want = spec_hashes(plan, layout)
    changes = []
    for name, digest in want.items():
        if name not in running:
            changes.append(Change(name, "created"))
        else:
            changes.append(Change(name, "unchanged" if running[name] == digest else "updated"))
    changes += [Change(name, "pruned (no longer planned)") for name in running if name not in want]
    return changes


def job_changed(plan: LocalPlan, changes: list[Change], running_groups: dict[str, str]) -> bool:
    """Whether a member of the training job was added, changed or removed."""
    groups = {c.name: c.group for c in plan.components} | {
        n: g for n, g in running_groups.items() if n not in {c.name for c in plan.components}
    }
    return any(groups.get(c.name) == JOB and c.action != "unchanged" for c in changes)


def request_apply(layout: StateFolder, generation: int) -> None:
    atomic_write_json(apply_request_file(layout), {"generation": generation, "at": time.time()})


def read_apply_request(layout: StateFolder) -> dict | None:
    """The pending apply request (consumed: the file is removed), or None."""
    path = apply_request_file(layout)
    try:
        request = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    path.unlink(missing_ok=True)
    return request


def wait_converged(layout: StateFolder, generation: int, *, timeout: float = CONVERGE_TIMEOUT) -> dict:
    """Until the supervisor loaded the plan of ``generation`` and every component of it is up."""
    deadline = time.monotonic() + timeout
    while True:
        info = rt.supervisor_info(layout)
        record = info.record or {}
        if not info.alive:
            raise ComponentError(f"the supervisor stopped while applying the new plan; see {layout.supervisor_log}")
        if record.get("generation", 0) >= generation:
            comps = record.get("components") or {}
            pending = [
                n
                for n, c in comps.items()
                if c.get("group") != JOB and c.get("state") not in (rt.C_RUNNING, rt.C_COMPLETED)
            ]
            job = record.get("job") or {}
            if not pending and job.get("state") != rt.J_PENDING:
                return record
        else:
            pending = ["the supervisor (loading the plan)"]
        if time.monotonic() > deadline:
            raise ComponentError(
                f"the new plan was not up within {timeout:.0f}s (waiting for {', '.join(pending)}); "
                f"see `elastic-control status` and {layout.logs_dir}/"
            )
        time.sleep(0.2)
