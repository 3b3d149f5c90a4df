"""MLflow: one parent run per search (DIR), a child run per finished candidate, the leaderboard as artifact.

Recorded after each search step from leaderboard.json; DIR/mlflow.json remembers the parent run and the
candidates already recorded, so a resumed search adds to the same parent and records nobody twice.
Tracking is bookkeeping: a failure is a warning, never a failed search.
"""

from __future__ import annotations

import json
from pathlib import Path

from ctr_foundation.atomic import atomic_write_json

EXPERIMENT = "elastic-ctr-tune"
STATE_FILE = "mlflow.json"
PARENT_TAG = "mlflow.parentRunId"


def _numbers(d: dict | None, prefix: str = "") -> dict:
    return {
        f"{prefix}{k}": float(v)
        for k, v in (d or {}).items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def record(board: dict, *, output: Path, uri: str, warn=print) -> str | None:
    """Log the search to ``uri``; returns the parent run id."""
    import mlflow  # noqa: F401  (before anything imports paddle)
    from mlflow.tracking import MlflowClient

    state_path = Path(output) / STATE_FILE
    try:
        state = json.loads(state_path.read_text())
        if state.get("uri") != uri:
            state = {}
    except (OSError, ValueError):
        state = {}
    try:
        client = MlflowClient(tracking_uri=uri)
        experiment = client.get_experiment_by_name(EXPERIMENT)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(EXPERIMENT)
        parent = state.get("parent")
        if not parent:
            parent = client.create_run(
                experiment_id, run_name=f"tune-{Path(output).resolve().name}", tags={"elastic_ctr.tune": str(output)}
            ).info.run_id
            client.log_param(parent, "validation", board["validation"]["how"][:500])
            client.log_param(parent, "candidates", board["budget"]["candidates"])
            state = {"uri": uri, "parent": parent, "recorded": []}
            atomic_write_json(state_path, state)
        for row in board["candidates"]:
            if row["state"] not in ("done", "pruned") or row["candidate"] in state["recorded"]:
                continue
            child = client.create_run(
                experiment_id,
                run_name=f"candidate-{row['candidate']}",
                tags={PARENT_TAG: parent, "elastic_ctr.tune.state": row["state"]},
            ).info.run_id
            for k, v in row["settings"].items():
                client.log_param(child, k, v)
            metrics = {**_numbers(row["validation"], "validation_"), **_numbers(row, "")}
            for k, v in metrics.items():
                client.log_metric(child, k, v)
            if row["pass"]:
                client.set_tag(child, "elastic_ctr.pass", row["pass"])
            client.set_terminated(child, "FINISHED" if row["state"] == "done" else "KILLED")
            state["recorded"].append(row["candidate"])
            atomic_write_json(state_path, state)
        best = board.get("best")
        if best:
            for k, v in _numbers(best["validation"], "best_").items():
                client.log_metric(parent, k, v)
            client.set_tag(parent, "elastic_ctr.best_pass", best["pass"])
            client.set_tag(parent, "elastic_ctr.judged_pass", best["judged_pass"])
        client.log_artifact(parent, str(Path(output) / "leaderboard.json"))
        return parent
    except Exception as e:  # noqa: BLE001 - tracking never fails the search
        warn(f"MLflow: could not record the search: {e}")
        return None


def finish(output: Path, warn=print) -> None:
    """Mark the parent run finished (the search is complete)."""
    try:
        from mlflow.tracking import MlflowClient

        state = json.loads((Path(output) / STATE_FILE).read_text())
        MlflowClient(tracking_uri=state["uri"]).set_terminated(state["parent"], "FINISHED")
    except Exception as e:  # noqa: BLE001
        warn(f"MLflow: could not finish the search's run: {e}")
