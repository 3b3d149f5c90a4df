"""MLflow tracking for trainer 0: parameters, step metrics, per-pass metrics, one model version per pass.

MLFLOW_TRACKING_URI comes from the environment; when unset, a local SQLite
store ``MODEL_PATH/mlflow.db`` (artifacts in ``MODEL_PATH/mlartifacts``) is
used, so a laptop run keeps its history beside its models. Import this module
before paddle (mlflow imports pyarrow, which must come first).
"""

from __future__ import annotations

import os
from pathlib import Path

import mlflow  # noqa: F401  (before paddle: see the module docstring)
from mlflow.tracking import MlflowClient

from ctr_foundation.env_vars import MLFLOW_TRACKING_URI
from ctr_foundation.records import GOLDEN_FILE

EXPERIMENT = "elastic-ctr"
REGISTERED_MODEL = "elastic-ctr"
LOCAL_STORE = "mlflow.db"
LOCAL_ARTIFACTS = "mlartifacts"
# Run artifact folder of the registered passes: passes/PASS/{dense/, meta.json, golden.jsonl}.
PASS_ARTIFACTS = "passes"


def tracking_uri(model_path: str | os.PathLike) -> str:
    """MLFLOW_TRACKING_URI, or a SQLite store in MODEL_PATH."""
    uri = MLFLOW_TRACKING_URI.get()
    if uri:
        return uri
    return f"sqlite:///{Path(model_path).resolve() / LOCAL_STORE}"


class Tracker:
    """One MLflow run for one training job (trainer 0)."""

    def __init__(self, model_path: str | os.PathLike, *, run_name: str = "train", warn=print):
        self.uri = tracking_uri(model_path)
        self.client = MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)
        self._warn = warn
        exp = self.client.get_experiment_by_name(EXPERIMENT)
        if exp is None:
            artifacts = None
            if self.uri.startswith("sqlite:"):
                artifacts = (Path(model_path).resolve() / LOCAL_ARTIFACTS).as_uri()
            exp_id = self.client.create_experiment(EXPERIMENT, artifact_location=artifacts)
        else:
            exp_id = exp.experiment_id
        self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id

    def log_params(self, params: dict) -> None:
        from mlflow.entities import Param

        self.client.log_batch(self.run_id, params=[Param(k, str(v)[:500]) for k, v in params.items()])

    def log_metrics(self, metrics: dict, step: int) -> None:
        import math
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [
            Metric(k, float(v), now, step)
            for k, v in metrics.items()
            if v is not None and not (isinstance(v, float) and math.isnan(v))
        ]
        if items:
            self.client.log_batch(self.run_id, metrics=items)

    def register_pass(
        self, pass_dir: str | os.PathLike, *, pass_name: str, window: dict, metrics: dict, family: str | None = None
    ) -> str | None:
        """Log the pass's small files as run artifacts and register them as a new model version.

        An MLflow *server* only accepts a version source inside the run's
        artifact directory (a bare local path is refused with "local path has
        to be contained within the artifact directory of the run"), so the
        source is ``<run artifact URI>/passes/PASS``, holding ``dense/``,
        ``meta.json`` and ``golden.jsonl``. The sparse table stays in the pass
        folder only (it grows with the vocabulary: gigabytes per hour on real
        logs); the version's ``pass_dir`` tag says where that folder is.
        Returns the version, or None when MLflow refused (training goes on).
        """
        from ctr_foundation import pass_format

        folder = Path(pass_dir).resolve()
        tags = {
            "pass": pass_name,
            "window_start": window["start"],
            "window_end": window["end"],
            "pass_dir": str(folder),
        }
        if family:
            tags["model_family"] = family
        tags.update({k: f"{v:.6f}" if isinstance(v, float) else str(v) for k, v in metrics.items()})
        artifact_path = f"{PASS_ARTIFACTS}/{pass_name}"
        try:
            for name in (pass_format.META_FILE, GOLDEN_FILE):
                if (folder / name).exists():
                    self.client.log_artifact(self.run_id, str(folder / name), artifact_path)
            self.client.log_artifacts(
                self.run_id, str(folder / pass_format.DENSE_DIR), f"{artifact_path}/{pass_format.DENSE_DIR}"
            )
            try:
                self.client.get_registered_model(REGISTERED_MODEL)
            except mlflow.exceptions.MlflowException:
                self.client.create_registered_model(REGISTERED_MODEL)
            source = f"{self.client.get_run(self.run_id).info.artifact_uri.rstrip('/')}/{artifact_path}"
            version = self.client.create_model_version(REGISTERED_MODEL, source=source, run_id=self.run_id, tags=tags)
            return str(version.version)
        except (mlflow.exceptions.MlflowException, OSError) as e:
            # Registration is bookkeeping: a registry that refuses it must not stop training.
            self._warn(f"MLflow: could not register {pass_name}: {e}")
            return None

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)
