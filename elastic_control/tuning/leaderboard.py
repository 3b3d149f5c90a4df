"""The search's result: DIR/leaderboard.json (written atomically) and the table people read.

leaderboard.json::

    {"format": 1, "train_window": {"start", "end"}, "validation": {"how", "config"},
     "budget": {"candidates": N, "finished": K},
     "best": {"candidate", "pass", "settings", "validation"} or null,
     "candidates": [{"candidate", "trial", "state", "settings", "pass", "passes", "validation",
                     "examples_per_sec", "seconds"}, ...],   # best validation AUC first
     "references": {"logistic_regression": {...} or null, "production": {...} or null}}
"""

from __future__ import annotations

from pathlib import Path

from ctr_foundation.atomic import atomic_write_json
from elastic_control.tuning.candidates import PRUNED_FILE, CandidateFolder
from elastic_control.tuning.space import describe

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


def build(study, *, output: Path, split, candidates: int, references: dict) -> dict:
    rows = candidate_rows(study, output)
    done = [r for r in rows if r["state"] == "done" and (r["validation"] or {}).get("auc") is not None]
    best = done[0] if done else None
    return {
        "format": FORMAT,
        "train_window": {
            "start": split.train_start.strftime("%Y%m%d/%H"),
            "end": split.train_end.strftime("%Y%m%d/%H"),
        },
        "validation": {"how": split.how, "config": str(Path(split.validation_config).resolve())},
        "budget": {"candidates": candidates, "finished": sum(r["state"] in ("done", "pruned") for r in rows)},
        "best": ({k: best[k] for k in ("candidate", "pass", "settings", "validation")} if best is not None else None),
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
