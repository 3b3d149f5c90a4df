"""The winner trained once more on the whole window, when the candidates trained on less of it.

Without ``--validation`` every 5th line of each hour judged the candidates and none trained on it; with
validation hours at an end of the window, the candidates' window stopped short of them. Either way the
winner's pass learned from less than the user's window holds: on small logs, where held-out lines are most
of what a search costs, a fifth fewer lines cost the winner 0.002-0.009 AUC on the next hour (Criteo
slices of 2,000-6,000 training lines, CHANGELOG.md). So, as a grid search refits its best estimator on all
the data, tune trains the winner's settings once more on the whole window, in ``DIR/refit/``: a candidate
folder whose data.config is the window of ``-f`` and whose candidate.json has no validation lines (its
worker trains and does not judge: it has seen every judging line). The leaderboard's ``best.pass`` is then
that pass; ``best.validation`` stays the judged candidate's figures, ``best.judged_pass`` its pass.

Resume: ``DIR/refit/result.json`` is the done marker. A refit of other settings or another window (the
search went on and found another winner) starts afresh; one that was interrupted resumes its training
job after its last complete pass, as a candidate's does.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

from elastic_control.tuning.candidates import CandidateFolder, start_worker, write_candidate
from elastic_control.tuning.split import Split
from elastic_control.tuning.study import stop_worker

REFIT_DIR = "refit"
POLL_SECONDS = 1.0


def refit_folder(output: Path) -> CandidateFolder:
    return CandidateFolder(Path(output) / REFIT_DIR)


def _window(split: Split) -> tuple[str, str]:
    return split.window_start.strftime("%Y%m%d/%H"), split.window_end.strftime("%Y%m%d/%H")


def _same(spec: dict | None, *, trial: int, settings: dict, window: tuple[str, str], size: tuple) -> bool:
    if not spec:
        return False
    mine = (spec.get("refit_of"), spec.get("settings"), (spec.get("train_start"), spec.get("train_end")))
    return mine == (trial, settings, window) and (spec.get("trainers"), spec.get("pservers")) == size


def refit(
    best: dict,
    *,
    output: Path,
    split: Split,
    slot_conf: Path,
    trainers: int,
    pservers: int,
    max_epochs_cap: int | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Train ``best`` (a leaderboard row: trial, settings) on the whole window of ``split``; returns
    ``{"pass", "window", "why", "train_seconds"}``, or ``{"failed", "why"}``: the search's result stands
    without it."""
    folder = refit_folder(output)
    window = _window(split)
    size = (trainers, pservers)
    if not _same(folder.spec, trial=best["trial"], settings=best["settings"], window=window, size=size):
        shutil.rmtree(folder.path, ignore_errors=True)  # another winner's, or a half-written folder
        write_candidate(
            folder,
            number=best["trial"],
            settings=best["settings"],
            train_values=split.window_values,
            train_window=window,
            validation_config=None,
            trainers=trainers,
            pservers=pservers,
            max_epochs_cap=max_epochs_cap,
            refit_of=best["trial"],
        )
    result = folder.result
    if result is None:
        log(
            f"refit: candidate {best['candidate']}'s settings train on the whole window {window[0]}..{window[1]} "
            f"({split.refit_reason}): {folder.path}"
        )
        proc = start_worker(folder, slot_conf)
        try:
            while proc.poll() is None:
                time.sleep(POLL_SECONDS)
        finally:  # Ctrl-C: the worker and its job's roles end; the next run resumes after their last pass
            stop_worker(proc)
        result = folder.result
        if proc.returncode != 0 or result is None:
            reason = (folder.read("failed.json") or {}).get("reason") or f"worker exit code {proc.returncode}"
            return {"failed": f"{reason} (log {folder.path / 'worker.log'})", "why": split.refit_reason}
    return {
        "pass": result["pass"],
        "window": {"start": window[0], "end": window[1]},
        "why": split.refit_reason,
        "train_seconds": result.get("train_seconds"),
    }
