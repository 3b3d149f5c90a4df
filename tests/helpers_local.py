"""Helpers for the local-backend tests: small real child processes under the real supervisor.

``simple_plan`` builds a LocalPlan whose services are tiny HTTP servers and
whose training job is a few Python processes that sleep and exit, so the
supervisor's policies can be exercised in seconds.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from pathlib import Path

import psutil
from helpers_common import wait_until

from ctr_foundation.names import StateFolder
from elastic_control.local.ports import free_ports
from elastic_control.local.spec import JOB, SERVICE, ComponentSpec, LocalPlan, save_local_plan

__all__ = [
    "MEMBER_SCRIPT",
    "SERVICE_SCRIPT",
    "alive",
    "component",
    "example_data_config_with_data",
    "kill_everything_under",
    "processes_under",
    "simple_plan",
    "wait_until",
    "write_complete_hours",
]  # local tests import it from here; its one definition is in helpers_common

# A service: answers GET /healthz with 200 and exits with code EXIT_CODE if the file STOP_FILE appears.
SERVICE_SCRIPT = r"""
import http.server, os, sys, threading, time
port = int(sys.argv[1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
if os.environ.get("FAIL_AT_START"):
    print("refusing to start: FAIL_AT_START is set", flush=True); sys.exit(3)
srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), H)
print(f"listening on {port}", flush=True)
srv.serve_forever()
"""

# A job member: a trainer counts to STEPS (one step per 0.1 s), appending each step to a
# progress file so that a restarted trainer resumes; a pserver just waits to be stopped.
MEMBER_SCRIPT = r"""
import os, sys, time
role = os.environ["TRAINING_ROLE"]
print(f"{role} {os.environ.get('PADDLE_TRAINER_ID')} up, pid {os.getpid()}", flush=True)
if role == "PSERVER":
    while True:
        time.sleep(0.2)
progress = os.environ["PROGRESS_FILE"] + "." + os.environ["PADDLE_TRAINER_ID"]
done = len(open(progress).read().split()) if os.path.exists(progress) else 0
if os.environ.get("ALWAYS_FAIL"):
    print("failing on purpose", flush=True); sys.exit(7)
for step in range(done, int(os.environ["STEPS"])):
    time.sleep(0.1)
    with open(progress, "a") as f:
        f.write(f"{step}\n")
    print(f"step {step}", flush=True)
print("trainer finished", flush=True)
"""


def simple_plan(
    layout: StateFolder,
    *,
    services: int = 2,
    trainers: int = 2,
    pservers: int = 1,
    steps: int = 20,
    max_job_restarts: int = 2,
    service_env: dict | None = None,
    member_env: dict | None = None,
    ready_timeout: float = 20.0,
    model_path: str | None = None,
    training_window: dict | None = None,
) -> LocalPlan:
    scripts = layout.state / "scripts"
    scripts.mkdir(parents=True, exist_ok=True)
    (scripts / "service.py").write_text(SERVICE_SCRIPT)
    (scripts / "member.py").write_text(MEMBER_SCRIPT)
    ports = free_ports(services + trainers + pservers)
    comps = []
    for i in range(services):
        comps.append(
            ComponentSpec(
                name=f"svc-{i}",
                kind="service",
                group=SERVICE,
                port=ports[i],
                argv=[sys.executable, str(scripts / "service.py"), str(ports[i])],
                ready="http:/healthz",
                after=[f"svc-{i - 1}"] if i else [],
                env=dict(service_env or {}) if i == services - 1 else {},
                ready_timeout=ready_timeout,
            )
        )
    env = {"PROGRESS_FILE": str(layout.state / "progress"), "STEPS": str(steps), **(member_env or {})}
    for role, count in (("PSERVER", pservers), ("TRAINER", trainers)):
        for i in range(count):
            comps.append(
                ComponentSpec(
                    name=f"{role.lower()}-{i}",
                    kind=role.lower(),
                    group=JOB,
                    ready="none",
                    argv=[sys.executable, str(scripts / "member.py")],
                    after=[f"svc-{services - 1}"] if services else [],
                    env={**env, "TRAINING_ROLE": role, "PADDLE_TRAINER_ID": str(i)},
                )
            )
    plan = LocalPlan(
        components=comps,
        max_job_restarts=max_job_restarts,
        stop_grace=3.0,
        pserver_exit_grace=0.5,
        model_path=model_path,
        training_window=training_window,
    )
    save_local_plan(plan, layout.components_file)
    (layout.state / "token").write_text("test-token\n")
    (layout.slot_conf).write_text("1\n")
    (layout.state / "local" / "data.config").write_text('export START_DATE_HR="20200101/00"\n')
    return plan


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def processes_under(state: Path) -> list[psutil.Process]:
    """Live processes whose command line or working folder mentions ``state`` (for orphan checks)."""
    state = str(state)
    out = []
    for p in psutil.process_iter(["cmdline", "cwd"]):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(p.info["cmdline"] or [])
            if state in cmd or (p.info["cwd"] or "") == state:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def kill_everything_under(state: Path) -> None:
    """Test cleanup: SIGKILL whatever is still running for ``state`` (only our own test processes)."""
    for p in processes_under(state):
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


def component(record: dict, name: str) -> dict:
    return record["components"][name]


def write_complete_hours(dataset: Path, *, start: str = "20191221/00", hours: int = 2) -> Path:
    """Hour folders with one slot-format line and a donefile each: what `-r` needs to find (no training)."""
    import datetime as dt

    first = dt.datetime.strptime(start, "%Y%m%d/%H")
    for i in range(hours):
        hour = first + dt.timedelta(hours=i)
        folder = dataset / f"{hour:%Y%m%d}" / f"{hour:%H}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "part-00000").write_text("1 0 17241709254077376921:1 132683728328325035:2\n")
        (folder / "donefile").write_text("")
    return dataset


def example_data_config_with_data(root: Path) -> Path:
    """examples/data.config with its DATASET_PATH pointed at complete hours under ``root`` (for local -r)."""
    repo = Path(__file__).resolve().parents[1]
    root.mkdir(parents=True, exist_ok=True)
    dataset = write_complete_hours(root / "data")
    lines = [
        f'export DATASET_PATH="{dataset}"' if line.startswith("export DATASET_PATH=") else line
        for line in (repo / "examples" / "data.config").read_text().splitlines()
    ]
    path = root / "data.config"
    path.write_text("\n".join(lines) + "\n")
    return path


@contextlib.contextmanager
def supervised_layout(tmp_path: Path):
    """A state folder for a supervised local pipeline; afterwards its pipeline is deleted and anything still
    running under it killed."""
    from elastic_control.local import lifecycle
    from elastic_control.local import runtime as rt

    lay = StateFolder.of(tmp_path / "state")
    lay.local_dir.mkdir(parents=True)
    try:
        yield lay
    finally:
        try:
            if rt.read_runtime(lay):
                lifecycle.delete(lay)
        finally:
            kill_everything_under(lay.state)
