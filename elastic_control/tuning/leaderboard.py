"""The search's result: DIR/leaderboard.json (written atomically) and the table people read.

leaderboard.json::

    {"format": 1, "train_window": {"start", "end"}, "validation": {"how", "config"},
     "budget": {"candidates": N, "finished": K},
     "best": {"candidate", "pass", "settings", "validation", "judged_pass", "why", "refit"} or null,
     "candidates": [{"candidate", "trial", "state", "settings", "pass", "passes", "validation",
                     "examples_per_sec", "seconds"}, ...],   # best validation AUC first
     "references": {"logistic_regression": {...} or null, "production": {...} or null}}

The winner is the finished candidate with the best validation AUC, unless the product defaults are within one
standard error of that AUC (Hanley and McNeil's, from the validation lines' positives and negatives): on a
few hundred validation lines the top AUC of a dozen candidates owes much to chance, and the defaults are
then the safer bet (Breiman's one-standard-error rule). ``best.why`` says which rule chose it.

``best.pass`` is the pass to use: the winner retrained on the whole window when the candidates trained on
less of it (``best.refit``: {"pass", "window", "why", "train_seconds"}, or {"failed", "why"}; null when no
refit ran, tuning/refit.py), else the judged candidate's pass. ``best.validation`` and ``best.judged_pass``
are always the judged candidate's.
"""

from __future__ import annotations

import json
from pathlib import Path

from ctr_foundation.atomic import atomic_write_json
from elastic_control.metrics import auc_standard_error
from elastic_control.tuning.candidates import PRUNED_FILE, CandidateFolder
from elastic_control.tuning.space import describe, product_defaults

LEADERBOARD_FILE = "leaderboard.json"
FORMAT = 1


def candidate_rows(study, output: Path) -> list[dict]:
    """One row per trial that has a candidate folder, best validation AUC first."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        folder = CandidateFolder.of(output, t.number)
        spec = folder.spec
        if spec is None:
            continue
        result = folder.result or {}
        state = t.state.name.lower()
        if state == "fail" and folder.read(PRUNED_FILE):
            state = "pruned"
        rows.append(
            {
                "candidate": folder.name,
                "trial": t.number,
                "state": {"complete": "done", "fail": "failed"}.get(state, state),
                "settings": spec["settings"],
                "pass": result.get("pass"),
                "passes": result.get("passes"),
                "validation": result.get("validation"),
                "examples_per_sec": result.get("examples_per_sec"),
                "seconds": _seconds(result),
            }
        )
    return sorted(rows, key=_rank_key)


def _seconds(result: dict) -> float | None:
    if "train_seconds" not in result:
        return None
    return round(result["train_seconds"] + result.get("eval_seconds", 0.0), 1)


def _rank_key(row: dict):
    auc = (row.get("validation") or {}).get("auc")
    return (row["state"] != "done" or auc is None, -(auc or 0.0), row["trial"])


def best_row(rows: list[dict], *, train_hours: int) -> tuple[dict | None, str]:
    """The winner among ``rows`` (sorted as candidate_rows sorts them) and why it won: the best validation AUC,
    or the product defaults when their AUC is within one standard error of it."""
    done = [r for r in rows if r["state"] == "done" and (r["validation"] or {}).get("auc") is not None]
    if not done:
        return None, ""
    top, v = done[0], done[0]["validation"]
    defaults = json.loads(json.dumps(product_defaults(train_hours)))  # as candidate.json holds settings
    base = next((r for r in done if r["settings"] == defaults), None)
    positives, examples = v.get("positives"), v.get("examples")
    if base is None or base is top or not isinstance(positives, int) or not isinstance(examples, int):
        return top, "the best validation AUC"
    se = auc_standard_error(v["auc"], positives, examples - positives)
    if se is not None and base["validation"]["auc"] >= v["auc"] - se:
        return base, (
            f"the product defaults: their validation AUC is within one standard error ({se:.4f}) of the best, "
            f"candidate {top['candidate']}'s {v['auc']:.5f}"
        )
    return top, "the best validation AUC"


def _best(chosen: tuple[dict | None, str], refit: dict | None) -> dict | None:
    row, why = chosen
    if row is None:
        return None
    best = {k: row[k] for k in ("candidate", "pass", "settings", "validation")}
    best.update(judged_pass=row["pass"], why=why, refit=refit)
    if refit and refit.get("pass"):
        best["pass"] = refit["pass"]
    return best


def build(
    rows: list[dict], chosen: tuple[dict | None, str], *, split, candidates: int, references: dict, refit: dict | None
) -> dict:
    """The leaderboard of ``rows`` (candidate_rows) with ``chosen`` (best_row) as its best."""
    return {
        "format": FORMAT,
        "train_window": {
            "start": split.train_start.strftime("%Y%m%d/%H"),
            "end": split.train_end.strftime("%Y%m%d/%H"),
        },
        "validation": {"how": split.how, "config": str(Path(split.validation_config).resolve())},
        "budget": {"candidates": candidates, "finished": sum(r["state"] in ("done", "pruned") for r in rows)},
        "best": _best(chosen, refit),
        "candidates": rows,
        "references": references,
    }


def write(output: Path, board: dict) -> Path:
    path = Path(output) / LEADERBOARD_FILE
    atomic_write_json(path, board)
    return path


def _f(v, digits: int = 5) -> str:
    return "-" if not isinstance(v, (int, float)) else f"{v:.{digits}f}"


def table(board: dict):
    """A rich table: every candidate, then the reference rows."""
    from rich.table import Table

    t = Table(title=f"tune leaderboard (validation: {board['validation']['how']})")
    for name, justify in (
        ("#", "right"),
        ("candidate", "left"),
        ("state", "left"),
        ("settings", "left"),
        ("AUC", "right"),
        ("log loss", "right"),
        ("calibration", "right"),
        ("examples/s", "right"),
        ("time (s)", "right"),
    ):
        t.add_column(name, justify=justify)
    for i, row in enumerate(board["candidates"], start=1):
        v = row["validation"] or {}
        t.add_row(
            str(i),
            row["candidate"],
            row["state"],
            describe(row["settings"]),
            _f(v.get("auc")),
            _f(v.get("logloss")),
            _f(v.get("calibration"), 3),
            _f(row["examples_per_sec"], 0),
            _f(row["seconds"], 0),
        )
    for name, ref in (board.get("references") or {}).items():
        if not ref:
            continue
        t.add_row(
            "",
            name.replace("_", " "),
            "reference",
            ref.get("what", ""),
            _f(ref.get("auc")),
            _f(ref.get("logloss")),
            _f(ref.get("calibration"), 3),
            "-",
            "-",
            style="dim",
        )
    return t
