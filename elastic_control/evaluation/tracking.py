"""MLflow records of evaluations and gate decisions, in the training store (training/tracking.py)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from elastic_control.console import warn
from elastic_control.evaluation.report import write_outputs


def _flat_metrics(metrics: dict) -> dict:
    out = {}
    for name in ("model", "baseline"):
        for k, v in metrics.get(name, {}).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k if name == "model" else f"baseline_{k}"] = v
    for k, v in metrics.get("comparison", {}).items():
        if isinstance(v, (int, float)):
            out[k] = v
    return {k.replace("@", "_at_"): v for k, v in out.items()}


def model_path_of(pass_dir: str | Path) -> Path:
    """The MODEL_PATH a pass folder lives in (its parent): where the training store is."""
    return Path(pass_dir).resolve().parent


def log_evaluation(result, artifacts: dict[str, Path] | None = None, run_name: str | None = None) -> str | None:
    """One MLflow run with the metrics, params and plots of an evaluation; returns its run id."""
    try:
        # function-level: imports mlflow and pyarrow (seconds)
        from elastic_control.training.tracking import Tracker

        spec = result.spec
        tracker = Tracker(
            model_path_of(spec.model), run_name=run_name or f"eval-{result.metrics['model']['pass']}", warn=warn
        )
        tracker.log_params(
            {
                "model": spec.model,
                "baseline": spec.baseline or "",
                "window_start": spec.start,
                "window_end": spec.end,
                "shares": spec.shares,
                "group_slot": spec.group_slot,
                "ndcg_k": spec.ndcg_k,
            }
        )
        tracker.log_metrics(_flat_metrics(result.metrics), step=0)
        if artifacts is None:
            tmp = Path(tempfile.mkdtemp(prefix="elastic-ctr-eval-art-"))
            artifacts = write_outputs(_without_rows(result), tmp)
        for key in ("metrics", "roc", "calibration"):
            if key in artifacts:
                tracker.client.log_artifact(tracker.run_id, str(artifacts[key]))
        tracker.finish()
        return tracker.run_id
    except Exception as e:  # noqa: BLE001 - tracking is bookkeeping; the evaluation itself succeeded
        warn(f"MLflow: could not record the evaluation: {e}")
        return None


def _without_rows(result):
    import copy
    import dataclasses

    r = copy.copy(result)
    r.spec = dataclasses.replace(result.spec, keep_scored=False)
    return r


def log_gate_decision(decision, candidate: str, active: str | None, rule_text: str) -> str | None:
    """A 'gate-PASS' run tagged promoted/rejected with the reason and the metrics it judged."""
    try:
        # function-level: imports mlflow and pyarrow (seconds)
        from elastic_control.training.tracking import Tracker

        name = Path(candidate).name
        tracker = Tracker(model_path_of(candidate), run_name=f"gate-{name}", warn=warn)
        tracker.log_params({"candidate": str(candidate), "active": str(active or ""), "rule": rule_text})
        tracker.log_metrics({k: v for k, v in _flat_metrics(decision.metrics).items()}, step=0)
        tracker.client.set_tag(tracker.run_id, "gate.decision", "promoted" if decision.passed else "rejected")
        tracker.client.set_tag(tracker.run_id, "gate.reason", decision.reason[:5000])
        tracker.client.set_tag(tracker.run_id, "gate.pass", name)
        tracker.finish()
        return tracker.run_id
    except Exception as e:  # noqa: BLE001
        warn(f"MLflow: could not record the gate decision: {e}")
        return None
