"""``tune`` as one library call: split, study, candidates, references, leaderboard, MLflow, apply."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from ctr_foundation.atomic import atomic_write_json
from ctr_foundation.errors import ConfigError, UsageError
from elastic_control.config.data_config import load_data_config
from elastic_control.config.slot_conf import load_slot_conf
from elastic_control.console import console, done, info, warn
from elastic_control.plan import load_plan
from elastic_control.tuning import leaderboard, tracking
from elastic_control.tuning import references as refs
from elastic_control.tuning.kube import render_search, start_candidate
from elastic_control.tuning.refit import refit as refit_winner
from elastic_control.tuning.split import prepare_split
from elastic_control.tuning.study import open_study, recover, run_search, seed_study


def default_parallel() -> int:
    """One candidate per two cores (each runs its pservers and trainers), at least one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // 2)


def tune(
    *,
    data_config: str,
    slot_conf: str,
    output: str,
    validation: str | None = None,
    candidates: int = 12,
    parallel: int | None = None,
    trainers: int = 2,
    pservers: int = 1,
    max_epochs_cap: int | None = None,
    timeout: float | None = None,
    seed: int = 0,
    state_dir: str | None = None,
    mlflow_uri: str | None = None,
    references: bool = True,
    show_progress: bool = True,
    plan=None,
    refit: bool = True,
) -> dict:
    """Run (or finish) the search in ``output``; returns the leaderboard (also in output/leaderboard.json).

    ``plan``: a Kubernetes plan (kube_plan): each candidate is then its Volcano training job and evaluation
    jobs in the plan's namespace and queue, followed by a worker process here (tuning/kube_worker.py); the
    pruner sees the passes each job's trainer 0 publishes, and the references are not judged.

    ``refit``: when the candidates trained on less than the window (held-out lines, or validation hours
    trimmed off it), train the winner once more on the whole window (tuning/refit.py; local only)."""
    out = Path(output)
    if plan is not None and not validation:
        raise UsageError(
            "the plan runs on Kubernetes, whose pods cannot read lines held out on this machine: "
            "pass --validation START..END (hours of the plan's dataset that judge)"
        )
    config = load_data_config(data_config)
    load_slot_conf(slot_conf)  # a bad slot.conf fails here, not in every candidate
    check_same_search(out, data_config=data_config, slot_conf=slot_conf, validation=validation)
    split = prepare_split(config=config, output=out, validation=validation)
    if split.train_hours < 1:
        raise ConfigError("no training hours are left once the validation hours are taken out", path=data_config)
    info(f"tune: training on {split.train_hours} hour(s), judged on {split.how}; results in {out}")
    study = open_study(out, candidates=candidates, seed=seed)
    seed_study(study, train_hours=split.train_hours)
    for note in recover(study, out):
        info(note)
    start = None
    if plan is not None:
        info(f"tune: candidates run as Volcano jobs in {plan.namespace} (queue {plan.queue}), {parallel or 1} at once")
        start = functools.partial(start_candidate, plan, output=out, split=split)
    completed = _search_with_progress(
        study,
        output=out,
        split=split,
        slot_conf=Path(slot_conf),
        candidates=candidates,
        parallel=parallel or (1 if plan is not None else default_parallel()),
        trainers=trainers,
        pservers=pservers,
        max_epochs_cap=max_epochs_cap,
        timeout=timeout,
        show=show_progress,
        start=start,
    )
    reference_rows = {"logistic_regression": None, "production": None}
    if references and plan is not None:
        warn("on Kubernetes the references (logistic regression, the plan's pass) are not judged")
    elif references:
        reference_rows["logistic_regression"] = refs.logistic_regression(split, out, warn=warn)
        reference_rows["production"] = refs.production(state_dir, split, warn=warn)
    rows = leaderboard.candidate_rows(study, out)
    chosen = leaderboard.best_row(rows, train_hours=split.train_hours)
    winner = chosen[0]
    refitted = None
    if refit and winner is not None and split.refit_reason:
        if plan is not None:
            info("tune: the winner is not retrained here on Kubernetes: `tune --apply` and `-a` train it on the plan")
        elif not completed:
            warn(
                "tune: the time budget is spent, so the winner is not retrained on the whole window; run the same "
                "command again (without --timeout) to finish the search and retrain it"
            )
        else:
            refitted = refit_winner(
                winner,
                output=out,
                split=split,
                slot_conf=Path(slot_conf),
                trainers=trainers,
                pservers=pservers,
                max_epochs_cap=max_epochs_cap,
                log=info,
            )
            if "failed" in refitted:
                warn(f"tune: retraining the winner on the whole window failed: {refitted['failed']}")
    board = leaderboard.build(
        rows, chosen, split=split, candidates=candidates, references=reference_rows, refit=refitted
    )
    path = leaderboard.write(out, board)
    done(f"leaderboard written to {path}")
    uri = mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        run = tracking.record(board, output=out, uri=uri, warn=warn)
        if run:
            tracking.finish(out, warn=warn)
            done(f"recorded in MLflow (parent run {run})")
    return board


SEARCH_FILE = "search.json"


def check_same_search(output: Path, *, data_config: str, slot_conf: str, validation: str | None) -> None:
    """A search folder belongs to one data.config, slot.conf and validation: resuming it with others would
    mix candidates judged on different lines. The first run records them in DIR/search.json."""
    import json

    inputs = {
        "data_config": str(Path(data_config).resolve()),
        "slot_conf": str(Path(slot_conf).resolve()),
        "validation": validation,
    }
    path = output / SEARCH_FILE
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError):
        output.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, inputs)
        return
    changed = [k for k in inputs if recorded.get(k) != inputs[k]]
    if changed:
        what = ", ".join(f"{k} {recorded.get(k)!r} (now {inputs[k]!r})" for k in changed)
        raise UsageError(
            f"{output} is the search of another {what}: resume it with the same inputs or use a new --output"
        )


def _search_with_progress(study, *, show: bool, candidates: int, **kwargs) -> bool:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, disable=not show, transient=False) as bar:
        task = bar.add_task("candidates", total=candidates)

        def on_change(finished: int, running: list[str]) -> None:
            what = f"running {', '.join(running)}" if running else "candidates"
            bar.update(task, completed=min(finished, candidates), description=what)

        return run_search(
            study,
            candidates=candidates,
            on_change=on_change,
            log=lambda line: bar.console.print(line, markup=False, highlight=False),
            **kwargs,
        )


def kube_plan(state_dir: str | None):
    """The plan of ``state_dir`` when its backend is Kubernetes, else None (candidates run locally)."""
    if not state_dir or not (Path(state_dir) / "plan.json").exists():
        return None
    plan = load_plan(state_dir)
    return plan if plan.backend == "k8s" else None


def render_for_kube(
    plan, *, data_config: str, output: str, validation: str | None, candidates: int, seed: int = 0
) -> list[dict[str, Path]]:
    """Kubernetes plan: every candidate's Volcano training job and evaluation job, rendered (not submitted)."""
    if not validation:
        raise UsageError(
            "the plan runs on Kubernetes, whose pods cannot read lines held out on this machine: "
            "pass --validation START..END (hours of the plan's dataset that judge)"
        )
    out = Path(output)
    split = prepare_split(config=load_data_config(data_config), output=out, validation=validation)
    return render_search(plan, output=out, split=split, candidates=candidates, seed=seed)
