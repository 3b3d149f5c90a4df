"""Run a whole training job as local processes: P pservers and T trainers on free loopback ports.

Each role is ``python -m elastic_control role`` with the standard Paddle
variables, exactly what a Kubernetes pod runs. The launcher streams their
progress lines, keeps full logs under ``MODEL_PATH/logs/``, fails fast when a
role fails, and makes sure no pserver outlives the job.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ctr_foundation.errors import ComponentError
from elastic_control.training.coordinator import COORDINATOR_PORT_OFFSET

# Once the trainers are done, how long pservers get to exit by themselves.
PSERVER_EXIT_TIMEOUT = 60.0
LOG_TAIL = 30


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_ports(count: int, *, spacing: int = 1) -> list[int]:
    """``count`` free loopback ports, each with its next ``spacing - 1`` ports free too."""
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if (
            p + spacing < 65536
            and all(_bindable(p + i) for i in range(1, spacing))
            and not any(abs(p - q) < spacing for q in ports)
        ):
            ports.append(p)
    return ports


@dataclass
class RoleProcess:
    name: str
    popen: subprocess.Popen
    log_path: Path
    tail: deque = field(default_factory=lambda: deque(maxlen=LOG_TAIL))
    reader: threading.Thread | None = None


@dataclass
class TrainResult:
    passes: list[str]
    pserver_exit_codes: list[int]
    pservers_exited_by_themselves: bool
    seconds: float


def role_environments(
    *, trainers: int, pservers: int, data_config: str, slot_conf: str, model_path: str, base_env: dict | None = None
) -> list[tuple[str, dict]]:
    """(name, environment) of every role, pservers first, on free loopback ports."""
    base = dict(os.environ if base_env is None else base_env)
    ps_ports = free_ports(pservers, spacing=COORDINATOR_PORT_OFFSET + 1)
    tr_ports = free_ports(trainers)
    common = {
        "PADDLE_PSERVERS_IP_PORT_LIST": ",".join(f"127.0.0.1:{p}" for p in ps_ports),
        "PADDLE_TRAINER_ENDPOINTS": ",".join(f"127.0.0.1:{p}" for p in tr_ports),
        "PADDLE_TRAINERS_NUM": str(trainers),
        "POD_IP": "127.0.0.1",
        "ELASTIC_CTR_DATA_CONFIG": str(Path(data_config).resolve()),
        "ELASTIC_CTR_SLOT_CONF": str(Path(slot_conf).resolve()),
        "MODEL_PATH": str(Path(model_path).resolve()),
        "PYTHONUNBUFFERED": "1",
        "GLOG_v": "0",
        "GLOG_minloglevel": "2",
    }
    roles = []
    for i, port in enumerate(ps_ports):
        roles.append(
            (
                f"pserver-{i}",
                dict(base, **common, TRAINING_ROLE="PSERVER", PADDLE_PORT=str(port), PADDLE_TRAINER_ID="0"),
            )
        )
    for i in range(trainers):
        roles.append(
            (
                f"trainer-{i}",
                dict(base, **common, TRAINING_ROLE="TRAINER", PADDLE_TRAINER_ID=str(i), PADDLE_PORT=str(tr_ports[i])),
            )
        )
    return roles


def _is_progress_line(line: str) -> bool:
    return line.startswith(("[trainer", "[pserver", "Traceback", "elastic-control: error")) or "Error" in line


def run_local_job(
    *,
    trainers: int,
    pservers: int,
    data_config: str,
    slot_conf: str,
    model_path: str,
    role_args: list[str],
    on_line: Callable[[str, str], None] | None = None,
    base_env: dict | None = None,
    timeout: float | None = None,
) -> TrainResult:
    """Start every role, stream progress, wait; ComponentError naming the role that failed."""
    from ctr_foundation.records import read_donefile

    log_dir = Path(model_path) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    procs: list[RoleProcess] = []
    on_line = on_line or (lambda name, line: None)
    try:
        for name, env in role_environments(
            trainers=trainers,
            pservers=pservers,
            data_config=data_config,
            slot_conf=slot_conf,
            model_path=model_path,
            base_env=base_env,
        ):
            log_path = log_dir / f"train-{name}.log"
            popen = subprocess.Popen(
                [sys.executable, "-m", "elastic_control", "role", *role_args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                bufsize=1,
                start_new_session=True,
            )
            rp = RoleProcess(name, popen, log_path)
            rp.reader = threading.Thread(target=_pump, args=(rp, on_line), daemon=True)
            rp.reader.start()
            procs.append(rp)
        trainer_procs = [p for p in procs if p.name.startswith("trainer")]
        ps_procs = [p for p in procs if p.name.startswith("pserver")]
        while True:
            for p in procs:
                code = p.popen.poll()
                # A pserver may end (code 0) as soon as trainer 0 stopped the servers,
                # slightly before the trainer processes themselves exit.
                if code not in (None, 0):
                    _fail(p, code)
            if all(t.popen.poll() == 0 for t in trainer_procs):
                break
            if timeout is not None and time.monotonic() - started > timeout:
                raise ComponentError(f"training did not finish within {timeout:.0f}s; logs in {log_dir}")
            time.sleep(0.2)
        deadline = time.monotonic() + PSERVER_EXIT_TIMEOUT
        while any(p.popen.poll() is None for p in ps_procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        by_themselves = all(p.popen.poll() is not None for p in ps_procs)
        codes = [p.popen.poll() for p in ps_procs]
        for p in procs:
            if p.reader:
                p.reader.join(5)
        return TrainResult(
            [e.pass_name for e in read_donefile(model_path)],
            [c if c is not None else -1 for c in codes],
            by_themselves,
            time.monotonic() - started,
        )
    finally:
        _stop_all(procs)


def _pump(rp: RoleProcess, on_line) -> None:
    with open(rp.log_path, "a", encoding="utf-8") as log:
        for line in rp.popen.stdout:
            log.write(line)
            line = line.rstrip("\n")
            rp.tail.append(line)
            if _is_progress_line(line):
                on_line(rp.name, line)


def _fail(p: RoleProcess, code) -> None:
    if p.reader:
        p.reader.join(2)
    last = [ln for ln in p.tail if ln.strip()][-6:]
    what = "exited before the trainers finished" if code == 0 else f"failed (exit code {code})"
    raise ComponentError(f"{p.name} {what}; log {p.log_path}; last lines: " + " | ".join(last))


def _stop_all(procs: list[RoleProcess]) -> None:
    """Terminate what still runs (by process group: Paddle may fork helpers), then kill after a pause."""
    import signal

    alive = [p for p in procs if p.popen.poll() is None]
    for p in alive:
        try:
            os.killpg(p.popen.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    for p in alive:
        try:
            p.popen.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.popen.wait(5)
