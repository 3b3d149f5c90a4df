"""The search: an Optuna study in DIR/study.db, candidates run as worker processes, ASHA on pass losses.

Sampling is TPE (multivariate, with a constant liar so that parallel candidates spread out); the first
trials are the seed points of space.py. Pruning is successive halving (Optuna's asynchronous one) on each
pass's held-out log loss, which trainer 0 writes into the donefile's metrics (on Kubernetes, onto its job's
annotation too: CandidateFolder.passes): the step is the number of window hours the candidate has trained so
far, so candidates with different PASS_HOURS meet on one scale.
A candidate whose window is one pass reports once, at its end, and is never stopped early.

Resume: the study lives in its SQLite file and every candidate's result in its result.json. A trial still
RUNNING when tune starts was left by a tune that died: its candidate's result is taken if it finished,
otherwise the trial is marked failed and its settings are tried again as a new candidate.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ctr_foundation.atomic import atomic_write_json
from ctr_foundation.errors import ComponentError
from elastic_control.local.process import stop_components
from elastic_control.tuning.candidates import PRUNED_FILE, CandidateFolder, start_worker, write_candidate
from elastic_control.tuning.space import seed_points, suggest
from elastic_control.tuning.split import HOUR, Split

STUDY_NAME = "elastic-ctr-tune"
STORAGE_FILE = "study.db"
POLL_SECONDS = 1.0
STOP_GRACE = 60.0  # a pruned candidate's worker stops its job's roles in this time, or is killed


def open_study(output: Path, *, candidates: int, seed: int = 0):
    """The study of DIR (created, or loaded to resume), with the seed points queued on creation."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    storage = optuna.storages.RDBStorage(
        f"sqlite:///{(Path(output) / STORAGE_FILE).resolve()}", engine_kwargs={"connect_args": {"timeout": 60}}
    )
    sampler = optuna.samplers.TPESampler(
        seed=seed, n_startup_trials=max(2, min(5, candidates // 3)), multivariate=True, constant_liar=True
    )
    pruner = optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=3)
    return optuna.create_study(
        study_name=STUDY_NAME,
        storage=storage,
        sampler=sampler,
        pruner=pruner,
        direction="maximize",
        load_if_exists=True,
    )


def seed_study(study, *, train_hours: int) -> None:
    if not study.trials:
        for point in seed_points(train_hours):
            study.enqueue_trial(point)


def objective_of(result: dict) -> float | None:
    auc = (result.get("validation") or {}).get("auc")
    return float(auc) if isinstance(auc, (int, float)) else None


def recover(study, output: Path) -> list[str]:
    """Settle the trials a dead tune left RUNNING; returns what was done, for people."""
    import optuna

    notes = []
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        folder = CandidateFolder.of(output, t.number)
        result = folder.result
        if result and objective_of(result) is not None:
            study.tell(t.number, objective_of(result))
            notes.append(f"candidate {folder.name} had finished; its result is kept")
        elif folder.read(PRUNED_FILE):
            study.tell(t.number, state=optuna.trial.TrialState.PRUNED)
        else:
            study.tell(t.number, state=optuna.trial.TrialState.FAIL)
            study.enqueue_trial(t.params, user_attrs={"retry_of": t.number})
            notes.append(f"candidate {folder.name} was interrupted; its settings run again as a new candidate")
    return notes


def finished_count(study) -> int:
    import optuna

    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    return len(study.get_trials(deepcopy=False, states=states))


@dataclass
class Running:
    trial: object
    folder: CandidateFolder
    proc: object
    started: float = field(default_factory=time.monotonic)
    reported: set = field(default_factory=set)


def _report_passes(trial, folder: CandidateFolder, reported: set) -> int | None:
    """Report each new pass's held-out log loss (negated: the study maximises) at the hours trained so far;
    returns the last step reported now (None: no new pass)."""
    import datetime as dt

    spec = folder.spec or {}
    start = spec.get("train_start")
    new = None
    for entry in folder.passes():
        loss = entry.get("logloss")
        if entry.get("pass") in reported or not isinstance(loss, (int, float)) or not start:
            continue
        reported.add(entry["pass"])
        end = dt.datetime.strptime(entry.get("end") or "", "%Y%m%d/%H")
        step = (end - dt.datetime.strptime(start, "%Y%m%d/%H")) // HOUR + 1
        trial.report(-float(loss), step)
        new = step
    return new


def stop_worker(proc) -> None:
    """SIGTERM to the worker and its job's roles (the worker's supervisor stops them too), SIGKILL after a grace."""
    if proc.poll() is None:
        stop_components([proc.pid], grace=STOP_GRACE, popen={proc.pid: proc})
    proc.wait()


def run_search(
    study,
    *,
    output: Path,
    split: Split,
    slot_conf: Path,
    candidates: int,
    parallel: int,
    trainers: int,
    pservers: int,
    max_epochs_cap: int | None = None,
    timeout: float | None = None,
    on_change: Callable[[int, list[str]], None] | None = None,
    log: Callable[[str], None] = print,
    start: Callable | None = None,
) -> bool:
    """Run candidates until ``candidates`` of them completed or were pruned, ``parallel`` at a time.

    ``timeout`` (seconds, as Optuna's ``optimize(timeout=)``): no candidate starts after it; those
    running finish. Returns False when the time ran out before ``candidates`` finished. ``start(folder,
    settings)`` starts a candidate's worker process (default: the local one, candidates.py; on Kubernetes,
    tuning/kube.py's, which submits its Volcano jobs).
    """
    import optuna

    deadline = None if timeout is None else time.monotonic() + timeout
    running: dict[int, Running] = {}
    failures = 0
    window = (split.train_start.strftime("%Y%m%d/%H"), split.train_end.strftime("%Y%m%d/%H"))
    try:
        while True:
            done = finished_count(study)
            if on_change:
                on_change(done, [r.folder.name for r in running.values()])
            out_of_time = deadline is not None and time.monotonic() >= deadline
            if (done >= candidates or out_of_time) and not running:
                if out_of_time and done < candidates:
                    log(f"time budget spent: {done} of {candidates} candidate(s) finished, none started after it")
                return done >= candidates
            while not out_of_time and len(running) < parallel and done + len(running) < candidates:
                trial = study.ask()
                settings = suggest(trial, train_hours=split.train_hours)
                folder = CandidateFolder.of(output, trial.number)
                write_candidate(
                    folder,
                    number=trial.number,
                    settings=settings,
                    train_values=split.train_values,
                    train_window=window,
                    validation_config=split.validation_config,
                    trainers=trainers,
                    pservers=pservers,
                    max_epochs_cap=max_epochs_cap,
                )
                proc = start(folder, settings) if start else start_worker(folder, slot_conf)
                running[trial.number] = Running(trial, folder, proc)
                log(f"candidate {folder.name} started: {settings}")
            for number, r in list(running.items()):
                code = r.proc.poll()
                step = _report_passes(r.trial, r.folder, r.reported)
                # Stopping a candidate after its last pass saves nothing: only one with hours to go is pruned.
                more = step is not None and step < split.train_hours and code is None
                if more and r.trial.should_prune():
                    stop_worker(r.proc)
                    atomic_write_json(r.folder.path / PRUNED_FILE, {"passes": sorted(r.reported)})
                    study.tell(r.trial, state=optuna.trial.TrialState.PRUNED)
                    log(f"candidate {r.folder.name} pruned after {len(r.reported)} pass(es)")
                    del running[number]
                    continue
                if code is None:
                    continue
                del running[number]
                result = r.folder.result
                value = objective_of(result) if code == 0 and result else None
                if value is not None:
                    study.tell(r.trial, value)
                    log(f"candidate {r.folder.name} done: validation AUC {value:.5f}")
                    continue
                study.tell(r.trial, state=optuna.trial.TrialState.FAIL)
                failures += 1
                reason = (r.folder.read("failed.json") or {}).get("reason") or f"worker exit code {code}"
                log(f"candidate {r.folder.name} failed: {reason} (log {r.folder.path / 'worker.log'})")
                if failures > candidates:
                    raise ComponentError(f"{failures} candidates failed, the last one: {reason}")
            time.sleep(POLL_SECONDS)
    finally:
        for r in running.values():  # Ctrl-C or an error: their trials stay RUNNING and are recovered next time
            stop_worker(r.proc)
