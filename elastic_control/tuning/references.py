"""The rows candidates are measured against, on the same validation lines.

- logistic regression on the same feasigns (evaluation/logistic_peer.py), fitted on the candidates'
  training lines; the best C of its grid on the validation lines, its most favourable figure. Kept in
  DIR/references/logistic_regression.json (it does not change while the split does not). Needs
  scikit-learn (a development dependency): without it the row is left out.
- the production model: the current pass of the plan's MODEL_PATH, when there is a plan and a pass.
"""

from __future__ import annotations

import json
from pathlib import Path

from ctr_foundation.atomic import atomic_write_json
from ctr_foundation.errors import ElasticControlError
from ctr_foundation.pass_format import latest_complete_pass
from elastic_control.config.data_config import parse_data_config
from elastic_control.evaluation import logistic_peer
from elastic_control.plan import load_plan
from elastic_control.tuning.candidates import judge_pass
from elastic_control.tuning.split import Split, config_text, lines_of


def logistic_regression(split: Split, output: Path, warn=print) -> dict | None:
    cache = Path(output) / "references" / "logistic_regression.json"
    try:
        cached = json.loads(cache.read_text())
        if cached.get("validation") == split.how:
            return cached
    except (OSError, ValueError):
        pass
    try:
        import sklearn  # noqa: F401
    except ImportError:
        warn("logistic regression reference left out: scikit-learn is not installed")
        return None

    window = {
        "START_DATE_HR": split.train_start.strftime("%Y%m%d/%H"),
        "END_DATE_HR": split.train_end.strftime("%Y%m%d/%H"),
    }
    train = lines_of(parse_data_config(config_text({**split.train_values, **window}), "training window", env={}))
    held = lines_of(split.validation)
    if not train or not held:
        return None
    peer = logistic_peer.best_fit(logistic_peer.logistic_regression(train, held))
    row = {
        "what": f"C={peer.c}, {len(train)} training lines",
        "validation": split.how,
        "auc": peer.auc,
        "logloss": peer.log_loss,
        "calibration": peer.calibration,
    }
    atomic_write_json(cache, row)
    return row


def production(state_dir: str | None, split: Split, warn=print) -> dict | None:
    """The plan's current pass judged on the validation lines (None: no plan, or no pass yet)."""
    if not state_dir or not (Path(state_dir) / "plan.json").exists():
        return None
    try:
        model_path = load_plan(state_dir).data_config().model_path
        current = latest_complete_pass(model_path) if model_path else None
        if current is None:
            return None
        metrics = judge_pass(str(current.path), str(split.validation_config))
    except ElasticControlError as e:
        warn(f"production reference left out: {e}")
        return None
    return {"what": f"{current.path}", "pass": str(current.path), **metrics}
