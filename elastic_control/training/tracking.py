"""MLflow tracking for trainer 0: parameters, step metrics, per-pass metrics, one model version per pass.

MLFLOW_TRACKING_URI comes from the environment; when unset, a local SQLite
store ``MODEL_PATH/mlflow.db`` (artifacts in ``MODEL_PATH/mlartifacts``) is
used, so a laptop run keeps its history beside its models. Import this module
before paddle (mlflow imports pyarrow, which must come first).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import mlflow  # noqa: F401  (before paddle: see the module docstring)
from mlflow.tracking import MlflowClient

from ctr_foundation import pass_format
from ctr_foundation.env_vars import MLFLOW_TRACKING_URI
from ctr_foundation.model_registry import CANDIDATE, PASS_TAG, REGISTERED_MODEL
from ctr_foundation.records import GOLDEN_FILE

EXPERIMENT = "elastic-ctr"
LOCAL_STORE = "mlflow.db"
LOCAL_ARTIFACTS = "mlartifacts"
# Run artifact folder of the registered passes: passes/PASS/{dense/, meta.json, golden.jsonl}.
PASS_ARTIFACTS = "passes"
# Trainer 0 may start before the tracking server answers (on a cluster it comes up beside the job):
# it tries this long to start its run, then trains without tracking rather than failing the job.
START_RETRY_SECONDS = 120.0
# After a failed call during training, tracking pauses this long (each call may itself retry for minutes).
PAUSE_AFTER_FAILURE_SECONDS = 60.0


def _tracking_errors() -> tuple[type[BaseException], ...]:
    import requests

    return (mlflow.exceptions.MlflowException, requests.RequestException, OSError)


def tracking_uri(model_path: str | os.PathLike) -> str:
    """MLFLOW_TRACKING_URI, or a SQLite store in MODEL_PATH."""
    uri = MLFLOW_TRACKING_URI.get()
    if uri:
        return uri
    return f"sqlite:///{Path(model_path).resolve() / LOCAL_STORE}"


class Tracker:
    """One MLflow run for one training job (trainer 0).

    Tracking never stops training: starting the run is retried for
    ``retry_for`` seconds, then given up with a warning; a failed call later
    is reported and tracking pauses for a minute. ``active`` says whether
    there is a run to log to.
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        run_name: str = "train",
        warn=print,
        retry_for: float = START_RETRY_SECONDS,
        retry_pause: float = 2.0,
    ):
        self.uri = tracking_uri(model_path)
        self.client = MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)
        self._warn = warn
        self.run_id: str | None = None
        self._paused_until = 0.0
        deadline, attempt = time.monotonic() + retry_for, 0
        while True:
            attempt += 1
            try:
                self.run_id = self._start_run(model_path, run_name)
                if attempt > 1:
                    warn(f"MLflow: tracking on {self.uri} started after {attempt} attempts")
                return
            except _tracking_errors() as e:
                reason = _first_line(e)
                if time.monotonic() + retry_pause > deadline:
                    warn(
                        f"MLflow: cannot track on {self.uri} ({reason}); training goes on without tracking "
                        "(check MLFLOW_TRACKING_URI and that the server accepts this host name)"
                    )
                    return
                if attempt == 1:
                    warn(f"MLflow: {self.uri} is not usable yet ({reason}); retrying for up to {retry_for:g}s")
                time.sleep(retry_pause)

    @property
    def active(self) -> bool:
        return self.run_id is not None

    def _call(self, what: str, fn) -> None:
        """Run one tracking call; a failure is reported and pauses tracking, never raised."""
        if self.run_id is None or time.monotonic() < self._paused_until:
            return
        try:
            fn()
        except _tracking_errors() as e:
            self._paused_until = time.monotonic() + PAUSE_AFTER_FAILURE_SECONDS
            self._warn(
                f"MLflow: {what} failed ({_first_line(e)}); tracking paused for {PAUSE_AFTER_FAILURE_SECONDS:g}s"
            )

    def _start_run(self, model_path: str | os.PathLike, run_name: str) -> str:
        exp = self.client.get_experiment_by_name(EXPERIMENT)
        if exp is None:
            artifacts = None
            if self.uri.startswith("sqlite:"):
                artifacts = (Path(model_path).resolve() / LOCAL_ARTIFACTS).as_uri()
            exp_id = self.client.create_experiment(EXPERIMENT, artifact_location=artifacts)
        else:
            exp_id = exp.experiment_id
        return self.client.create_run(exp_id, run_name=run_name).info.run_id

    def log_params(self, params: dict) -> None:
        from mlflow.entities import Param

        batch = [Param(k, str(v)[:500]) for k, v in params.items()]
        self._call("logging parameters", lambda: self.client.log_batch(self.run_id, params=batch))

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
            self._call("logging metrics", lambda: self.client.log_batch(self.run_id, metrics=items))

    def register_pass(
        self, pass_dir: str | os.PathLike, *, pass_name: str, window: dict, metrics: dict, family: str | None = None
    ) -> str | None:
        """Log the pass's small files as run artifacts and register them as a new model version, with the
        alias ``candidate`` (ctr_foundation/model_registry.py).

        An MLflow *server* only accepts a version source inside the run's
        artifact directory (a bare local path is refused with "local path has
        to be contained within the artifact directory of the run"), so the
        source is ``<run artifact URI>/passes/PASS``, holding ``dense/``,
        ``meta.json`` and ``golden.jsonl``. The sparse table stays in the pass
        folder only (it grows with the vocabulary: gigabytes per hour on real
        logs); the version's ``pass_dir`` tag says where that folder is.
        Returns the version, or None when MLflow refused (training goes on).
        """
        if self.run_id is None:
            return None
        folder = Path(pass_dir).resolve()
        tags = {
            PASS_TAG: pass_name,
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
            # MLflow 3 aliases instead of the deprecated stages: candidate is the newest registered pass
            # (cube-transfer moves champion to the pass it activates: ctr_foundation/model_registry.py).
            self.client.set_registered_model_alias(REGISTERED_MODEL, CANDIDATE, version.version)
            return str(version.version)
        except _tracking_errors() as e:
            # Registration is bookkeeping: a registry that refuses it must not stop training.
            self._warn(f"MLflow: could not register {pass_name}: {e}")
            return None

    def finish(self, status: str = "FINISHED") -> None:
        self._paused_until = 0.0  # the run's end is worth one more try
        self._call("ending the run", lambda: self.client.set_terminated(self.run_id, status=status))


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300]}" if text else type(error).__name__
