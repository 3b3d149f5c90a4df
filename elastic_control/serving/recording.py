"""Live metrics recorded to MLflow periodically (run ``serving-monitor`` in experiment ``elastic-ctr``).

A monitor hook (app.py calls it every few seconds); every ``every`` seconds it hands the window's
figures to its own thread, which logs them as metrics named ``ARM.FIGURE`` (``control.calibration``,
``challenger.auc``, ...) with tags naming each arm's version. A slow or unreachable MLflow never
delays serving: a recording still under way when the next one is due is skipped and counted.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

log = logging.getLogger("elastic_control.serving")
EXPERIMENT = "elastic-ctr"
RUN_NAME = "serving-monitor"


def metrics_of(summary: list[dict], alerts: list[dict]) -> dict[str, float]:
    """The figures worth a time series, flattened as ``ARM.FIGURE``."""
    out: dict[str, float] = {}
    for s in summary:
        if s.get("weight", 1.0) == 0.0 and not s["predictions"]["count"]:
            continue
        arm = s["arm"]
        fb = s["feedback"]
        for name, value in (
            ("predictions", s["predictions"]["count"]),
            ("mean_prediction", s["predictions"]["mean"]),
            ("feedback", fb["count"]),
            ("observed_ctr", fb["observed_ctr"]),
            ("calibration", fb["calibration"]),
            ("logloss", fb["logloss"]),
            ("auc", fb["auc"]),
            ("unknown_key_share", s["coverage"]["unknown_share"]),
        ):
            if value is not None:
                out[f"{arm}.{name}"] = float(value)
    out["alerts"] = float(len(alerts))
    return out


class MlflowRecorder:
    def __init__(self, tracking_uri: str, *, every: float = 60.0, source: str = ""):
        self.tracking_uri = tracking_uri
        self.every = every
        self.source = source
        self.skipped = 0
        self.recorded = 0
        self.last_error: str | None = None
        self._due = time.monotonic() + every
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._run_id: str | None = None
        self._step = 0
        threading.Thread(target=self._run, name="serving-mlflow", daemon=True).start()

    def __call__(self, summary: list[dict], alerts: list[dict]) -> None:
        if time.monotonic() < self._due:
            return
        self._due = time.monotonic() + self.every
        versions = {f"arm.{s['arm']}.version": s["version"] for s in summary if s["predictions"]["count"]}
        try:
            self._queue.put_nowait((int(time.time() * 1000), metrics_of(summary, alerts), versions))
        except queue.Full:
            self.skipped += 1

    def _client(self):
        from mlflow.tracking import MlflowClient

        client = MlflowClient(self.tracking_uri)
        if self._run_id is None:
            exp = client.get_experiment_by_name(EXPERIMENT)
            exp_id = exp.experiment_id if exp else client.create_experiment(EXPERIMENT)
            run = client.create_run(exp_id, run_name=RUN_NAME, tags={"component": "serving", "source": self.source})
            self._run_id = run.info.run_id
        return client

    def _run(self) -> None:
        while True:
            at, metrics, tags = self._queue.get()
            try:
                from mlflow.entities import Metric, RunTag

                client = self._client()
                self._step += 1
                client.log_batch(
                    self._run_id,
                    metrics=[Metric(k, v, at, self._step) for k, v in metrics.items()],
                    tags=[RunTag(k, v) for k, v in tags.items()],
                )
                self.recorded += 1
                self.last_error = None
            except Exception as e:  # noqa: BLE001 - recording is best effort, serving goes on
                if str(e) != self.last_error:
                    log.warning("could not record live metrics to MLflow at %s: %s", self.tracking_uri, e)
                self.last_error = str(e)
