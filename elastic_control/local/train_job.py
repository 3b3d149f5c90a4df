"""``elastic-control train``: the training job alone, run in the foreground by the local supervisor.

The same machine as ``-a``: the job's components come from
the catalogue's ``training_job`` (P pservers, T trainers, each
``elastic-control role`` with the standard Paddle variables, ports drawn
below the ephemeral range with pserver 0's barrier port kept free), and the
``Supervisor`` starts, watches and stops them. The job is not restarted
here (a failing role fails ``train`` at once, naming it); full logs are in
``MODEL_PATH/logs/train-<role>.log``; the supervisor's record and lock live
in ``MODEL_PATH/logs/.train-job/``, so two jobs never write one MODEL_PATH.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ctr_foundation.env_vars import MLFLOW_TRACKING_URI, MODEL_PATH
from ctr_foundation.errors import ComponentError, UsageError
from ctr_foundation.names import StateFolder
from ctr_foundation.records import read_donefile
from elastic_control.catalogue import Env, Loopback, Paths, training_job
from elastic_control.local import runtime as rt
from elastic_control.local.components import draw_ports, job_ports, process_spec
from elastic_control.local.daemon import tail_lines
from elastic_control.local.logs_view import LogFollower
from elastic_control.local.spec import LocalPlan
from elastic_control.local.supervisor import Supervisor
from elastic_control.training.log_filter import is_paddle_noise

# Once the trainers are done, how long pservers get to exit by themselves (trainer 0 stops them).
PSERVER_EXIT_TIMEOUT = 60.0
STOP_GRACE = 10.0


@dataclass
class TrainResult:
    passes: list[str]  # every complete pass in MODEL_PATH's donefile, in order
    pserver_exit_codes: list[int]
    pservers_exited_by_themselves: bool
    seconds: float


def is_progress_line(line: str) -> bool:
    """The lines `train` shows while the job runs (the log files keep the rest)."""
    if is_paddle_noise(line):
        return False
    return line.startswith(("[trainer", "[pserver", "Traceback", "elastic-control: error")) or "Error" in line


def run_training_job(
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
    window: dict | None = None,
) -> TrainResult:
    """Run the job until every trainer finished; ComponentError naming the role that failed.

    ``window`` ({"start", "end", "dataset"}) makes an offline job that wrote no
    pass of it a failure, as in the pipeline.
    """
    model = Path(model_path).resolve()
    # The roles get only what the plan says (the supervisor drops the registry's variables from base_env), so a
    # tracking server named by the caller's environment is passed on explicitly.
    tracking = MLFLOW_TRACKING_URI.get(os.environ if base_env is None else base_env)
    log_dir = model / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    _, pserver_ports, trainer_ports = draw_ports(0, pservers, trainers)
    paths = Paths(
        slot_conf=str(Path(slot_conf).resolve()), data_config=str(Path(data_config).resolve()), model_path=str(model)
    )
    addressing = Loopback(job_ports(pservers, trainers, pserver_ports, trainer_ports), paths)
    env = [Env(MODEL_PATH.name, str(model))] + ([Env(MLFLOW_TRACKING_URI.name, tracking)] if tracking else [])
    components = [
        process_spec(c)
        for c in training_job(addressing, pservers=pservers, trainers=trainers, env=env, role_args=role_args)
    ]
    plan = LocalPlan(
        components=components,
        max_job_restarts=0,  # a failing role fails `train` (the pipeline's job restarts instead)
        stop_grace=STOP_GRACE,
        pserver_exit_grace=PSERVER_EXIT_TIMEOUT,
        model_path=str(model),
        training_window=window,
    )
    layout = StateFolder.of(log_dir / ".train-job")
    layout.local_dir.mkdir(parents=True, exist_ok=True)

    def log_path(name: str) -> Path:
        return log_dir / f"train-{name}.log"

    sup = Supervisor(layout, plan, base_env=base_env, log_path=log_path, foreground=True)
    show = on_line or (lambda name, line: None)
    follower = LogFollower(
        {c.name: log_path(c.name) for c in components},
        lambda name, line: show(name, line) if not line.startswith("[supervisor ") and is_progress_line(line) else None,
    )
    started = time.monotonic()
    timed_out = False

    def finished() -> bool:
        nonlocal timed_out
        members = [r for r in sup.runs.values()]
        if sup.job.state in (rt.J_COMPLETED, rt.J_FAILED) and all(r.proc is None for r in members):
            return True
        if timeout is not None and time.monotonic() - started > timeout:
            timed_out = True
            return True
        return False

    handler = logging.FileHandler(log_path("supervisor"), encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    sup_log = logging.getLogger("elastic_control.supervisor")
    sup_log.addHandler(handler)
    saved = (sup_log.level, sup_log.propagate)
    sup_log.setLevel(logging.INFO)
    sup_log.propagate = False  # the supervisor's lines go to its log file, not the terminal
    try:
        code = sup.run(until=finished, on_step=follower.poll)
        follower.poll()
    finally:
        sup_log.removeHandler(handler)
        handler.close()
        sup_log.setLevel(saved[0])
        sup_log.propagate = saved[1]
    seconds = time.monotonic() - started
    if code == 2:
        raise UsageError(f"another `elastic-control train` runs on MODEL_PATH {model} (lock {layout.lock_file})")
    if sup.stop_requested and not timed_out and sup.job.state not in (rt.J_COMPLETED, rt.J_FAILED):
        raise KeyboardInterrupt
    if timed_out:
        raise ComponentError(f"training did not finish within {timeout:.0f}s; logs in {log_dir}")
    if sup.state == rt.FAILED:
        raise ComponentError(f"training could not start: {sup.reason}")
    if sup.job.state == rt.J_FAILED:
        raise ComponentError(_failure(sup, log_path))
    ps_runs = [r for r in sup.runs.values() if r.spec.kind == "pserver"]
    return TrainResult(
        passes=[e.pass_name for e in read_donefile(model)],
        pserver_exit_codes=[r.last_exit if r.last_exit is not None else -1 for r in ps_runs],
        pservers_exited_by_themselves=all(not r.stopped for r in ps_runs),
        seconds=seconds,
    )


def _failure(sup: Supervisor, log_path: Callable[[str], Path]) -> str:
    """The role that failed first, its exit code and its last lines; or why a finished job counts as failed."""
    culprits = [r for r in sup.runs.values() if r.last_exit not in (None, 0) and not r.stopped]
    if not culprits:
        return sup.job.reason
    run = min(culprits, key=lambda r: r.last_exit_at or 0)
    path = log_path(run.spec.name)
    last = [ln for ln in tail_lines(path, 40) if ln.strip() and not ln.startswith("[supervisor ")][-6:]
    return f"{run.spec.name} failed (exit code {run.last_exit}); log {path}; last lines: " + " | ".join(last)
