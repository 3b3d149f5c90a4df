"""The local supervisor: starts every component, watches them, applies the cluster's failure policy.

One process, one loop (like uvicorn's multiprocess supervisor): signal
handlers only set a flag; the loop polls children, starts what is due,
checks readiness, and records everything in local/runtime.json.

Failure policy (spec.JOB / spec.SERVICE):
- training job (pservers + trainers): a member that fails stops every member
  and the whole job starts again (Volcano's RestartJob; the trainers resume
  after the last complete pass), at most ``max_job_restarts`` times; when
  every trainer exited 0 the job is complete and its pservers are stopped;
- services: restarted with exponential backoff whenever they exit;
- whenever a component's main process exits, what is left of its process
  group (helpers it forked, e.g. MLflow's uvicorn server, which parent-death
  signals do not reach) is stopped before anything else: a restart must find
  its port free, and nothing outlives the component it belongs to;
- while starting up, a service that exits or never becomes ready fails the
  whole start: everything started is stopped and the reason recorded;
- an offline job (``LocalPlan.training_window``) whose trainers all finished
  without a pass of that window in the donefile has failed, not completed.
Every exit is logged with its code, in the supervisor's log and the component's.

``elastic-control -a`` runs it detached over the whole pipeline;
``elastic-control train`` runs it in the foreground over the training job
alone (``run(until=...)``), so both use the same machine.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import requests

from ctr_foundation.env_vars import planned_environment
from ctr_foundation.errors import UsageError
from ctr_foundation.names import StateFolder
from ctr_foundation.records import read_donefile
from elastic_control.local import runtime as rt
from elastic_control.local.converge import (
    Change,
    apply_request_file,
    job_changed,
    plan_changes,
    read_apply_request,
    spec_hashes,
)
from elastic_control.local.ports import LOOPBACK, wait_tcp
from elastic_control.local.process import (
    describe_exit,
    group_members,
    process_identity,
    start_process,
    stop_components,
)
from elastic_control.local.rollouts import RolloutWatcher
from elastic_control.local.spec import JOB, ComponentSpec, LocalPlan, load_local_plan

log = logging.getLogger("elastic_control.supervisor")

TICK = 0.1
HEARTBEAT = 2.0
JOB_RESTART_DELAY = 1.0
JOB_STOP_GRACE = 5.0
BACKOFF_MAX = 30.0
LEFTOVER_GRACE = 2.0  # seconds a component's leftover helpers get to exit on SIGTERM before SIGKILL
STABLE_AFTER = 30.0  # a service that ran this long has its backoff reset


@dataclass
class ComponentRun:
    spec: ComponentSpec
    state: str = rt.C_WAITING
    proc: subprocess.Popen | None = None
    pid: int | None = None
    started: float | None = None  # process start time (psutil), to recognise the PID later
    started_mono: float = 0.0
    restarts: int = 0
    consecutive_failures: int = 0
    last_exit: int | None = None
    last_exit_at: float | None = None
    next_start: float = 0.0
    attempt: int = 0
    stopped: bool = False  # its last exit was the supervisor stopping it
    spec_hash: str = ""  # of the spec it runs (local/converge.py): -a restarts it only when that changes

    def to_json(self) -> dict:
        s = self.spec
        return {
            "kind": s.kind,
            "group": s.group,
            "state": self.state,
            "pid": self.pid,
            "started": self.started,
            "port": s.port,
            "ports": s.all_ports,
            "restarts": self.restarts,
            "last_exit": self.last_exit,
            "last_exit_at": self.last_exit_at,
            "attempt": self.attempt,
            "stopped_by_supervisor": self.stopped,
            "spec_hash": self.spec_hash,
        }


@dataclass
class JobState:
    state: str = rt.J_PENDING
    attempt: int = 0
    restarts: int = 0
    max_restarts: int = 3
    reason: str = ""
    started_at: float | None = None
    finished_at: float | None = None
    completed_mono: float | None = None
    history: list = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "state": self.state,
            "attempt": self.attempt,
            "restarts": self.restarts,
            "max_restarts": self.max_restarts,
            "reason": self.reason,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "history": self.history[-20:],
        }


class Supervisor:
    def __init__(
        self,
        layout: StateFolder,
        plan: LocalPlan,
        *,
        base_env: dict[str, str] | None = None,
        secret_env: dict[str, str] | None = None,
        log_path: Callable[[str], Path] | None = None,
        foreground: bool = False,
    ):
        self.layout = layout
        self.foreground = foreground  # run from a terminal (`train`): closing it stops the job
        self.log_path = log_path or layout.log_path  # component name -> its log file
        self.plan = plan
        # Registry variables come from the plan only (planned_environment), as a pod's come from its manifest.
        self.base_env = planned_environment(dict(os.environ if base_env is None else base_env))
        self.secret_env = dict(secret_env or {})  # e.g. the token: given to children, never written to disk
        hashes = spec_hashes(plan, layout)
        self.runs = {c.name: ComponentRun(c, spec_hash=hashes[c.name]) for c in plan.components}
        self.generation = 0  # of the plan loaded: each -a that changes something asks for the next one
        self.job = JobState(max_restarts=plan.max_job_restarts)
        self.state = rt.STARTING
        self.reason = ""
        self.stop_requested = False
        self.started_at = time.time()
        self._last_write = 0.0
        self._dirty = True
        self.hooks: list = []  # objects with tick() -> None, called about once a second
        self._last_hook = 0.0

    # ---- public -------------------------------------------------------------------------
    def run(self, *, until: Callable[[], bool] | None = None, on_step: Callable[[], None] | None = None) -> int:
        """Supervise until asked to stop (SIGTERM/SIGINT), startup fails or ``until()``. Returns an exit code.

        ``on_step()`` runs after every pass of the loop (a foreground caller's progress).
        """
        lock = rt.SupervisorLock(self.layout)
        if not lock.acquire():
            log.error("another supervisor already runs on %s", self.layout.state)
            return 2
        previous_handlers = self._install_signals()
        try:
            self.layout.stop_request_file.unlink(missing_ok=True)
            apply_request_file(self.layout).unlink(missing_ok=True)
            log.info("supervisor %d starting %d components", os.getpid(), len(self.runs))
            self._write(force=True)
            while not self.stop_requested:
                self.step()
                if on_step is not None:
                    on_step()
                if self.state == rt.FAILED or (until is not None and until()):
                    break
                time.sleep(TICK)
            if self.state != rt.FAILED:
                self.state = rt.STOPPING
                self._write(force=True)
                log.info("stop requested: stopping every component")
            self.stop_all()
            if self.state != rt.FAILED:
                self.state = rt.STOPPED
            self._write(force=True)
            log.info("supervisor exiting (%s)", self.state)
            return 1 if self.state == rt.FAILED else 0
        except BaseException:
            # Never leave children behind (a foreground caller's on_step may raise, e.g. a closed stdout).
            self.stop_all()
            self.state = rt.STOPPED
            self._write(force=True)
            raise
        finally:
            for sig, handler in previous_handlers.items():
                signal.signal(sig, handler)
            lock.release()

    def step(self) -> None:
        """One pass of the loop: reap, apply policy, start what is due, check readiness, record."""
        now = time.monotonic()
        if self.layout.stop_request_file.exists():
            self.stop_requested = True
        request = read_apply_request(self.layout)
        if request is not None:
            try:
                plan = load_local_plan(self.layout.components_file)
            except UsageError as e:  # the plan -a asked for is unreadable: keep running the current one
                log.error("cannot load the plan -a asked for: %s", e)
            else:
                self.load_plan(plan, int(request.get("generation", 0)))
        for run in self.runs.values():
            if run.proc is not None:
                code = run.proc.poll()
                if code is not None:
                    self._on_exit(run, code)
                    if self.state == rt.FAILED:
                        return
        self._job_policy(now)
        self._start_due(now)
        self._check_ready(now)
        if self.state == rt.FAILED:
            return
        if self.state == rt.STARTING and self._everything_started():
            self.state = rt.RUNNING
            self._dirty = True
            log.info("every component started")
        if self.hooks and now - self._last_hook >= 1.0:
            self._last_hook = now
            for hook in self.hooks:
                try:
                    hook.tick()
                except Exception as e:  # noqa: BLE001 - a watcher must never take the supervisor down
                    log.warning("%s failed: %s", type(hook).__name__, e)
        self._write()

    def load_plan(self, plan: LocalPlan, generation: int) -> list[Change]:
        """Converge on ``plan``: stop what is no longer planned, start what is new, restart what changed.

        The training job restarts (every member) only if one of its members was added, changed or
        removed; an unchanged job is left as it is, running or finished.
        """
        changes = plan_changes(plan, self.layout, {n: r.spec_hash for n, r in self.runs.items()})
        restart_job = job_changed(plan, changes, {n: r.spec.group for n, r in self.runs.items()})
        hashes = spec_hashes(plan, self.layout)
        differs = {c.name for c in changes if c.action != "unchanged"}
        stop = [
            r
            for n, r in self.runs.items()
            if r.proc is not None and (n in differs or (restart_job and r.spec.group == JOB))
        ]
        if stop:
            self._stop(stop, self.plan.stop_grace, final_state=rt.C_STOPPED, why="the plan changed (-a)")
        runs = {}
        for spec in plan.components:
            old = self.runs.get(spec.name)
            if old is not None and spec.name not in differs and not (restart_job and spec.group == JOB):
                old.spec = spec
                runs[spec.name] = old
            else:
                runs[spec.name] = ComponentRun(spec, spec_hash=hashes[spec.name])
        for change in changes:
            if change.action != "unchanged":
                self._note(change.name, f"{change.name} {change.action} (-a, plan {generation})")
        self.runs = runs
        self.plan = plan
        self.job.max_restarts = plan.max_job_restarts
        if restart_job:
            history = [*self.job.history, {"attempt": self.job.attempt, "at": time.time(), "event": "plan changed"}]
            self.job = JobState(attempt=self.job.attempt, max_restarts=plan.max_job_restarts, history=history)
            log.info("the training job's plan changed: it starts again")
        self.generation = generation
        self._dirty = True
        self._write(force=True)
        return changes

    def request_stop(self, *_args) -> None:
        self.stop_requested = True

    def stop_all(self) -> None:
        live = [r for r in self.runs.values() if r.proc is not None]
        if live:
            self._stop(live, self.plan.stop_grace, final_state=rt.C_STOPPED, why="supervisor stopping")
        for r in self.runs.values():
            if r.state not in (rt.C_COMPLETED, rt.C_FAILED):
                r.state = rt.C_STOPPED

    # ---- policy -------------------------------------------------------------------------
    def _on_exit(self, run: ComponentRun, code: int) -> None:
        spec = run.spec
        run.proc = None
        run.last_exit, run.last_exit_at = code, time.time()
        self._dirty = True
        what = f"{spec.name} (pid {run.pid}) {describe_exit(code)}"
        self._note(spec.name, what)
        self._stop_leftovers(run)
        if spec.group == JOB:
            self._on_job_member_exit(run, code, what)
            return
        # A service.
        if self.state == rt.STARTING:
            self._fail(f"{what} while starting; see {self.log_path(spec.name)}")
            return
        ran_for = time.monotonic() - run.started_mono
        run.consecutive_failures = 1 if ran_for >= STABLE_AFTER else run.consecutive_failures + 1
        delay = min(BACKOFF_MAX, 0.5 * 2 ** (run.consecutive_failures - 1))
        run.state = rt.C_BACKOFF
        run.next_start = time.monotonic() + delay
        log.warning("%s; restarting in %.1fs", what, delay)

    def _stop_leftovers(self, run: ComponentRun) -> None:
        """Stop what is left of the process group of ``run``'s exited main process (its PID is the group id:
        each component starts in its own session). The group still has members, so its id is not reused."""
        leftovers = group_members(run.pid) if run.pid else []
        if not leftovers:
            return
        pids = ", ".join(str(p.pid) for p in leftovers)
        self._note(run.spec.name, f"stopping what {run.spec.name} (pid {run.pid}) left running: pid {pids}")
        stop_components([run.pid], LEFTOVER_GRACE)

    def _on_job_member_exit(self, run: ComponentRun, code: int, what: str) -> None:
        if code == 0:
            run.state = rt.C_COMPLETED
            trainers = [r for r in self._job_members() if r.spec.kind == "trainer"]
            if self.job.state == rt.J_RUNNING and trainers and all(r.state == rt.C_COMPLETED for r in trainers):
                self.job.finished_at = time.time()
                self.job.completed_mono = time.monotonic()
                empty = self._no_pass_reason()
                if empty:
                    # Not worth a restart: the same data gives the same nothing.
                    self.job.state = rt.J_FAILED
                    self.job.reason = empty
                    self.job.history.append(
                        {"attempt": self.job.attempt, "at": time.time(), "event": "failed", "reason": empty}
                    )
                    log.error("training job failed: %s", empty)
                    for r in trainers:
                        self._note(r.spec.name, f"training job failed: {empty}")
                    return
                self.job.state = rt.J_COMPLETED
                self.job.history.append({"attempt": self.job.attempt, "at": time.time(), "event": "completed"})
                log.info("training job completed (attempt %d)", self.job.attempt)
            return
        if self.job.state in (rt.J_COMPLETED, rt.J_FAILED):
            run.state = rt.C_COMPLETED if self.job.state == rt.J_COMPLETED else rt.C_FAILED
            return
        self._restart_job(what)

    def _restart_job(self, reason: str) -> None:
        live = [r for r in self._job_members() if r.proc is not None]
        if live:
            self._stop(live, JOB_STOP_GRACE, final_state=rt.C_STOPPED, why=f"job restart: {reason}")
        self.job.history.append({"attempt": self.job.attempt, "at": time.time(), "event": "failed", "reason": reason})
        self.job.reason = reason
        if self.job.restarts >= self.job.max_restarts:
            self.job.state = rt.J_FAILED
            self.job.finished_at = time.time()
            for r in self._job_members():
                r.state = rt.C_FAILED
            log.error("training job failed for good after %d restarts: %s", self.job.restarts, reason)
            for r in self._job_members():
                self._note(r.spec.name, f"training job failed after {self.job.restarts} restarts: {reason}")
            return
        self.job.restarts += 1
        self.job.state = rt.J_RESTARTING
        for r in self._job_members():
            r.state = rt.C_BACKOFF
            r.next_start = time.monotonic() + JOB_RESTART_DELAY
        log.warning(
            "restarting the training job (restart %d of %d): %s", self.job.restarts, self.job.max_restarts, reason
        )

    def _no_pass_reason(self) -> str:
        """Why a finished offline job counts as failed: no pass of its window in the donefile ('' if fine)."""
        window, model_path = self.plan.training_window, self.plan.model_path
        if not window or not model_path:
            return ""
        start, end = window["start"], window["end"]
        passes = [e for e in read_donefile(model_path) if start <= str((e.window or {}).get("end", "")) <= end]
        if passes:
            return ""
        return (
            f"the trainers finished without writing a pass: no complete hour of {start}..{end} was read "
            f"in {window.get('dataset') or 'DATASET_PATH'} (an hour is complete once its donefile exists); see "
            f"{self.log_path('trainer-0')} for the hours skipped. Make data with `elastic-control data synth "
            f"--output {window.get('dataset') or 'DATASET_PATH'} --start {start} --hours N`"
        )

    def _job_policy(self, now: float) -> None:
        if self.job.state in (rt.J_COMPLETED, rt.J_FAILED) and self.job.completed_mono is not None:
            left = [r for r in self._job_members() if r.proc is not None]
            if left and now - self.job.completed_mono > self.plan.pserver_exit_grace:
                self._stop(
                    left,
                    JOB_STOP_GRACE,
                    final_state=rt.C_COMPLETED,
                    why="training complete; stopping what is left of the job",
                )
                self._dirty = True

    def _start_due(self, now: float) -> None:
        members = self._job_members()
        if members and self.job.state in (rt.J_PENDING, rt.J_RESTARTING):
            deps = {d for r in members for d in r.spec.after}
            if all(self._is_ready(d) for d in deps) and all(now >= r.next_start for r in members):
                self.job.attempt += 1
                self.job.state = rt.J_RUNNING
                self.job.started_at = self.job.started_at or time.time()
                self.job.history.append({"attempt": self.job.attempt, "at": time.time(), "event": "started"})
                log.info("starting the training job (attempt %d)", self.job.attempt)
                for r in members:
                    self._launch(r)
        for run in self.runs.values():
            if run.spec.group == JOB or run.state not in (rt.C_WAITING, rt.C_BACKOFF):
                continue
            if now >= run.next_start and all(self._is_ready(d) for d in run.spec.after):
                if run.state == rt.C_BACKOFF:
                    run.restarts += 1
                self._launch(run)

    def _check_ready(self, now: float) -> None:
        for run in self.runs.values():
            if run.state != rt.C_STARTING or run.proc is None:
                continue
            if self._probe(run.spec):
                run.state = rt.C_RUNNING
                self._dirty = True
                log.info(
                    "%s is ready (pid %d%s)", run.spec.name, run.pid, f", port {run.spec.port}" if run.spec.port else ""
                )
            elif now - run.started_mono > run.spec.ready_timeout:
                what = f"{run.spec.name} (pid {run.pid}) was not ready after {run.spec.ready_timeout:.0f}s"
                self._note(run.spec.name, what)
                if self.state == rt.STARTING:
                    self._fail(f"{what}; see {self.log_path(run.spec.name)}")
                    return
                self._stop([run], JOB_STOP_GRACE, final_state=rt.C_BACKOFF, why="not ready in time")
                run.consecutive_failures += 1
                run.next_start = now + min(BACKOFF_MAX, 0.5 * 2**run.consecutive_failures)

    # ---- mechanics ----------------------------------------------------------------------
    def _launch(self, run: ComponentRun) -> None:
        spec = run.spec
        secrets = {k: v for k, v in self.secret_env.items() if k in spec.secrets}
        env = {**self.base_env, "PYTHONUNBUFFERED": "1", **spec.env, **secrets}
        run.attempt += 1
        self._note(spec.name, f"starting {spec.name} (attempt {run.attempt}): {' '.join(spec.argv)}")
        try:
            for folder in spec.make_dirs:
                Path(folder).mkdir(parents=True, exist_ok=True)
            proc = start_process(spec.argv, env=env, log_path=self.log_path(spec.name), cwd=spec.cwd)
        except OSError as e:
            self._note(spec.name, f"cannot start {spec.name}: {e}")
            if self.state == rt.STARTING or spec.group == JOB:
                self._fail(f"cannot start {spec.name}: {e}")
            else:
                run.state, run.next_start = rt.C_BACKOFF, time.monotonic() + BACKOFF_MAX
            return
        run.proc, run.pid = proc, proc.pid
        run.stopped = False
        run.started = process_identity(proc.pid)
        run.started_mono = time.monotonic()
        run.state = rt.C_RUNNING if spec.ready == "none" else rt.C_STARTING
        self._dirty = True
        # Record the PID at once: if this supervisor is killed now, delete can still find the process.
        self._write(force=True)

    def _stop(self, runs: list[ComponentRun], grace: float, *, final_state: str, why: str) -> None:
        for r in runs:
            self._note(r.spec.name, f"stopping {r.spec.name} (pid {r.pid}): {why}")
        popen = {r.pid: r.proc for r in runs if r.proc is not None}
        codes = stop_components(list(popen), grace, popen)
        for r in runs:
            if r.proc is not None:
                code = codes.get(r.pid)
                r.last_exit, r.last_exit_at = code, time.time()
                self._note(r.spec.name, f"{r.spec.name} (pid {r.pid}) {describe_exit(code)} after being stopped")
                r.stopped = True
            r.proc = None
            r.state = final_state
        self._dirty = True

    def _fail(self, reason: str) -> None:
        log.error("start failed: %s", reason)
        self.reason = reason
        self.state = rt.FAILED
        self.stop_all()
        self._write(force=True)

    def _probe(self, spec: ComponentSpec) -> bool:
        if spec.ready == "none":
            return True
        if spec.ready == "tcp":
            return wait_tcp(spec.port)
        path = spec.ready[len("http:") :]
        try:
            return requests.get(f"http://{LOOPBACK}:{spec.port}{path}", timeout=0.5).ok
        except requests.RequestException:
            return False

    def _is_ready(self, name: str) -> bool:
        run = self.runs[name]
        return run.state in (rt.C_RUNNING, rt.C_COMPLETED)

    def _job_members(self) -> list[ComponentRun]:
        return [r for r in self.runs.values() if r.spec.group == JOB]

    def _everything_started(self) -> bool:
        services_up = all(r.state == rt.C_RUNNING for r in self.runs.values() if r.spec.group != JOB)
        job_started = not self._job_members() or self.job.state != rt.J_PENDING
        return services_up and job_started

    def _note(self, component: str, message: str) -> None:
        """Log to the supervisor's log and append the same line to the component's log."""
        log.info("%s", message)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        path = self.log_path(component)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"[supervisor {stamp}] {message}\n")

    def _install_signals(self) -> dict:
        """Handlers that only set a flag; returns the previous ones (restored when run() ends)."""
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        # The terminal that ran -a may close: that must not stop the pipeline (but it ends a foreground job).
        signal.signal(signal.SIGHUP, self.request_stop if self.foreground else signal.SIG_IGN)
        return previous

    def snapshot(self) -> dict:
        return {
            "state": self.state,
            "reason": self.reason,
            "started_at": self.started_at,
            "supervisor": {"pid": os.getpid(), "started": process_identity(os.getpid())},
            "components": {n: r.to_json() for n, r in self.runs.items()},
            "job": self.job.to_json() if self._job_members() else None,
            "state_dir": str(self.layout.state),
            "generation": self.generation,
        }

    def _write(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or self._dirty or now - self._last_write >= HEARTBEAT:
            rt.write_runtime(self.layout, self.snapshot())
            self._last_write = now
            self._dirty = False


def configure_logging(stream=None) -> None:
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    root = logging.getLogger("elastic_control")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)


def run_supervisor(state_dir: str | Path, *, plan: LocalPlan | None = None, secret_env: dict | None = None) -> int:
    """Entry of the detached supervisor process (``elastic-control supervise``)."""
    layout = StateFolder.of(state_dir)
    plan = plan or load_local_plan(layout.components_file)
    sup = Supervisor(layout, plan, secret_env=secret_env)
    if plan.model_path or plan.serving_url:
        sup.hooks.append(
            RolloutWatcher(
                layout, model_path=plan.model_path, serving_url=plan.serving_url, transfer_url=plan.transfer_url
            )
        )
    return sup.run()
