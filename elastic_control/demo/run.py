"""`elastic-control demo`: the whole pipeline on one machine, from data to live predictions.

Makes hourly data (synthetic planted-model hours, or real Criteo lines with
--criteo), renders and applies the local backend (-r --backend local, -a),
trains the hourly passes on the parameter server, rolls the last pass out
through cube, configures the client (-c) and predicts the held-out hour
through it, then prints the AUC beside logistic regression's on the same
lines (and the Bayes-optimal one on synthetic data, whose planted pairwise
interactions only a deep model can learn), a few predictions, the freshness of every rollout and where the MLflow
UI is. Everything it started is stopped at the end unless --keep.

It drives the pipeline only through the library API (``elastic_control.api``)
and the Deployment handle ``api.apply`` returns, as a user's script would.
"""

from __future__ import annotations

import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from client.api import ServingClient, resolve_client_settings
from ctr_foundation.errors import ComponentError, ElasticControlError, UsageError
from ctr_foundation.records import GOLDEN_FILE, read_golden
from elastic_control.config import Resources
from elastic_control.console import console, done, info, out, warn
from elastic_control.demo.pipeline_watch import wait_for_training, wait_until_served
from elastic_control.metrics import auc_from_counts, counts_from_arrays

DEFAULT_WORKDIR = "elastic-ctr-demo"


@dataclass
class DemoReport:
    workdir: str
    state_dir: str
    timings: dict = field(default_factory=dict)  # stage -> seconds
    passes: list = field(default_factory=list)  # [{"pass", "auc", "seconds"}]
    rollouts: list = field(default_factory=list)
    served_version: str | None = None
    auc: float | None = None
    bayes_auc: float | None = None
    lr_auc: float | None = None  # logistic regression on the same feasigns, trained on the same hours
    predictions: int = 0
    predictions_per_s: float | None = None
    golden_max_diff: float | None = None
    golden_lines: int = 0
    mlflow_url: str | None = None
    examples: list = field(default_factory=list)  # a few (label, prediction, truth) rows
    job: dict | None = None  # the training job's record: attempts, restarts

    def to_json(self) -> dict:
        return dict(self.__dict__)


def _timed(report: DemoReport, stage: str):
    class _T:
        def __enter__(self):
            self.t0 = time.monotonic()

        def __exit__(self, *exc):
            report.timings[stage] = round(time.monotonic() - self.t0, 2)

    return _T()


def _reset_workdir(workdir: Path) -> None:
    """A fresh run: stop a previous demo still running here, clear its data, models and state."""
    # function-level: keeps `elastic-control --help` fast (api loads both backends)
    from elastic_control import api

    state = workdir / "state"
    try:
        previous = api.attach(state_dir=str(state))
        seen = previous.status(probe=False)
    except ElasticControlError:
        previous = seen = None  # no plan (or an unreadable one): nothing of ours can run there
    if seen is not None and seen.state == "running":
        raise UsageError(
            f"a pipeline is still running in {state}/ (a demo run with --keep?); stop it with "
            f"`elastic-control delete --state-dir {state}` or use another --workdir"
        )
    if seen is not None and seen.state not in ("never started", "stopped"):
        previous.delete()  # stops anything an earlier, killed run left behind
    for name in ("data", "models", "state", "criteo-prefix.txt"):
        path = workdir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def predict_through_client(
    state_dir: Path, lines: list[str], *, batch_size: int = 256
) -> tuple[np.ndarray, set, float]:
    """Predictions for ``lines`` from serving via the client library; (probabilities, versions seen, seconds)."""
    config = resolve_client_settings(state_dir=state_dir)
    client = ServingClient(config.serving_url, retry_for=60.0)
    probs: list[float] = []
    versions: set = set()
    t0 = time.monotonic()
    for i in range(0, len(lines), batch_size):
        batch = lines[i : i + batch_size]
        answer = client.predict_instances([{"line": line} for line in batch])
        probs.extend(float(p) for p in answer["predictions"])
        versions.add((answer.get("model_version"), answer.get("cube_version")))
    return np.array(probs, dtype=np.float64), versions, time.monotonic() - t0


def golden_check(state_dir: Path, pass_dir: Path) -> tuple[float | None, int]:
    """Max |served − training| over the pass's golden.jsonl lines (the train/serve skew)."""
    path = pass_dir / GOLDEN_FILE
    if not path.exists():
        return None, 0
    lines, probs = read_golden(path)
    if not lines:
        return None, 0
    served, _, _ = predict_through_client(state_dir, lines)
    return float(np.max(np.abs(served - np.array(probs)))), len(lines)


def _prepare_data(root: Path, criteo, hours: int, lines_per_hour: int, seed: int, extra: dict, interactions):
    """The demo's data: real Criteo lines converted, or synthetic planted-model lines."""
    # function-level: keeps `elastic-control --help` fast (demo.data loads the data readers)
    from elastic_control.demo.data import prepare_criteo, prepare_synthetic

    if criteo:
        info(f"converting real Criteo lines from {criteo} into {hours} training hours + 1 held-out hour")
        return prepare_criteo(root, criteo, train_hours=hours, lines_per_hour=lines_per_hour, extra=extra)
    info(
        f"generating {hours} training hours + 1 held-out hour of synthetic planted-model data "
        f"({lines_per_hour} lines per hour)"
    )
    return prepare_synthetic(
        root, train_hours=hours, lines_per_hour=lines_per_hour, seed=seed, extra=extra, interactions=interactions
    )


def _record_training(report: DemoReport, pipeline, passes) -> None:
    """The job's state and restarts, and each pass's AUC, kind and time since the one before."""
    training = pipeline.status(probe=False).training
    report.job = {k: training.get(k) for k in ("state", "attempt", "restarts", "max_restarts", "reason")}
    if report.job.get("restarts"):
        warn(
            f"the training job was restarted {report.job['restarts']} time(s) from its last complete pass "
            f"(last failure: {report.job.get('reason')})"
        )
    previous = None
    for p in passes:
        seconds = None if p.done_at is None or previous is None else round(p.done_at - previous, 2)
        report.passes.append(
            {
                "pass": p.name,
                "auc": p.auc,
                "seconds_since_previous": seconds,
                "kind": p.kind,
                "rows": p.metrics.get("rows"),
                "keys_live": p.metrics.get("keys_live"),
            }
        )
        previous = p.done_at


def _score_held_out_hour(report: DemoReport, state_dir: Path, data, last: str) -> None:
    """The held-out hour through the client (every answer from ``last``), its AUC, the golden-line skew."""
    with _timed(report, "predict"):
        probs, versions, seconds = predict_through_client(state_dir, data.heldout_lines)
    report.predictions = len(probs)
    report.predictions_per_s = round(len(probs) / seconds, 1) if seconds > 0 else None
    if {v[0] for v in versions} != {last}:
        raise ComponentError(f"serving answered with versions {sorted(versions)} while {last} was active")
    report.auc, _ = auc_from_counts(counts_from_arrays(data.heldout_labels, probs))
    report.golden_max_diff, report.golden_lines = golden_check(state_dir, data.model_path / last)
    for i in range(min(5, len(probs))):
        report.examples.append(
            {
                "label": int(data.heldout_labels[i]),
                "prediction": float(probs[i]),
                "truth": None if data.heldout_truth is None else float(data.heldout_truth[i]),
                "line": data.heldout_lines[i][:60],
            }
        )


def run_demo(
    *,
    workdir: str = DEFAULT_WORKDIR,
    hours: int = 4,
    lines_per_hour: int = 25_000,
    trainers: int = 2,
    pservers: int = 1,
    shards: int = 2,
    criteo: str | None = None,
    keep: bool = False,
    seed: int = 7,
    timeout: float = 900.0,
    show: bool = True,
    on_pass=None,
    deltas: bool = False,
    pass_minutes: int | None = None,
    admit_min_count: int | None = None,
    evict_after: int | None = None,
    interactions: float | None = None,
) -> DemoReport:
    """Run the main job; returns the report (also printed). Stops everything at the end unless ``keep``.

    ``on_pass(event, deployment)`` is called as each training pass completes (tests use it to inject failures).
    ``deltas`` (DELTA_PASSES=1: the first pass a base, the others deltas), ``pass_minutes`` (PASS_MINUTES:
    sub-hour passes, deltas unless ``deltas`` is off), ``admit_min_count`` and ``evict_after`` go into the
    demo's data.config (docs/contracts.md, "Delta passes"). ``interactions`` is the synthetic data's
    ``data synth --interactions`` (default: the interaction model; 0: the original planted model).
    """
    # function-level: keeps `elastic-control --help` fast (api, demo.data: both backends, the data readers)
    from elastic_control import api
    from elastic_control.demo.data import logistic_auc

    if hours < 2:
        raise UsageError(f"--hours {hours}: the demo trains at least 2 hourly passes")
    if criteo and not Path(criteo).is_file():
        raise UsageError(f"--criteo {criteo}: file not found")
    resources = Resources(trainers=trainers, pservers=pservers, cube_shards=shards)  # validates the ranges
    extra = demo_config_keys(deltas, pass_minutes, admit_min_count, evict_after)
    expected_passes = hours * (60 // pass_minutes if pass_minutes else 1)
    root = Path(workdir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    _reset_workdir(root)
    state_dir = root / "state"
    report = DemoReport(workdir=str(root), state_dir=str(state_dir))
    t_start = time.monotonic()

    with _timed(report, "data"):
        data = _prepare_data(root, criteo, hours, lines_per_hour, seed, extra, interactions)
    done(f"data: {data.lines_total} lines ({data.source}) in {report.timings['data']:.1f}s under {data.dataset}")
    # Fitted in a thread while the pipeline starts and trains (the main thread mostly waits there), so
    # the peer's figure costs the demo little wall time.
    lr_pool = ThreadPoolExecutor(max_workers=1)
    lr_future = lr_pool.submit(logistic_auc, data, pass_minutes)
    lr_pool.shutdown(wait=False)
    if extra:
        info("data.config: " + " ".join(f"{k}={v}" for k, v in extra.items()))
    report.bayes_auc = data.bayes_auc

    pipeline = None
    try:
        with _timed(report, "render"):
            api.configure_resource(
                resources=resources,
                slot_conf=str(data.slot_conf),
                data_config=str(data.data_config),
                backend="local",
                state_dir=str(state_dir),
            )
        with _timed(report, "startup"):
            pipeline = api.apply(state_dir=str(state_dir), wait=False)
            pipeline.wait()
        mlflow = pipeline.status(probe=False).component("mlflow")
        report.mlflow_url = f"http://{mlflow.address}" if mlflow and mlflow.address else None
        info(f"MLflow UI (live while the pipeline runs): {report.mlflow_url}")

        t_train = time.monotonic()
        remaining = lambda: max(30.0, timeout - (time.monotonic() - t_start))  # noqa: E731
        passes = wait_for_training(
            pipeline,
            expected_passes=expected_passes,
            timeout=remaining(),
            show=show,
            on_pass=(lambda event: on_pass(event, pipeline)) if on_pass else None,
        )
        report.timings["training"] = round(time.monotonic() - t_train, 2)
        _record_training(report, pipeline, passes)
        last = passes[-1].name

        with _timed(report, "rollout_wait"):
            rollout = wait_until_served(pipeline, last, timeout=remaining(), show=show)
        report.served_version = last
        fresh = rollout.get("freshness_s")
        done(f"serving answers with {last}" + (f" {fresh:.1f}s after its donefile line" if fresh is not None else ""))

        api.configure_client(state_dir=str(state_dir))
        _score_held_out_hour(report, state_dir, data, last)
        report.lr_auc = lr_future.result()
        report.rollouts = pipeline.status(probe=False).rollouts
        report.timings["total"] = round(time.monotonic() - t_start, 2)
        print_report(report, data)
        return report
    finally:
        if pipeline is not None:
            _stop_or_keep(pipeline, keep, state_dir)


def _stop_or_keep(pipeline, keep: bool, state_dir: Path) -> None:
    if keep:
        info(
            f"the pipeline keeps running (--keep): `elastic-control status --state-dir {state_dir}`, "
            f"`elastic-control delete --state-dir {state_dir}` to stop it"
        )
        return
    try:
        pipeline.delete()
    except Exception as e:  # noqa: BLE001 - never hide the demo's own error behind a cleanup error
        warn(f"cleanup failed: {e}; run `elastic-control delete --state-dir {state_dir}`")


def demo_config_keys(deltas: bool, pass_minutes, admit_min_count, evict_after) -> dict:
    """The demo's incremental data.config keys (validated like any data.config by -r)."""
    extra: dict = {}
    if deltas:
        extra["DELTA_PASSES"] = 1
    if pass_minutes:
        extra["PASS_MINUTES"] = pass_minutes  # sub-hour passes are deltas by default (data_config.py)
    if admit_min_count:
        extra["ADMIT_MIN_COUNT"] = admit_min_count
    if evict_after:
        extra["EVICT_AFTER_PASSES"] = evict_after
    return extra


def _size(n: float) -> str:
    """Bytes for a person: the demo's small tables ship tens of kB, a real day's passes hundreds of MB."""
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def print_report(report: DemoReport, data) -> None:
    console.rule("ElasticCTR demo")
    unit = "passes" if any(p.get("kind") == "delta" for p in report.passes) else "hourly passes"
    info(f"trained {len(report.passes)} {unit} on {data.source}; serving {report.served_version}")
    for p in report.passes:
        auc = f"AUC {p['auc']:.4f}" if p["auc"] is not None else "AUC n/a"
        rows = f", {p['kind']} of {p['rows']} rows, {p['keys_live']} live keys" if p.get("rows") is not None else ""
        info(f"  {p['pass']}: {auc} (held out by the trainer){rows}")
    line = f"held-out hour through the client: {report.predictions} predictions, AUC {report.auc:.4f}"
    if report.bayes_auc is not None:
        line += f" (Bayes-optimal {report.bayes_auc:.4f}, gap {report.bayes_auc - report.auc:+.4f})"
    info(line)
    if report.lr_auc is not None:
        info(
            f"logistic regression on the same feasigns and hours: AUC {report.lr_auc:.4f}; "
            f"the model {report.auc - report.lr_auc:+.4f} against it"
        )
    if report.golden_max_diff is not None:
        info(
            f"train/serve consistency: max |serving − training program| = {report.golden_max_diff:.2e} over "
            f"{report.golden_lines} golden lines of {report.served_version}"
        )
    info(
        "a few predictions (label, predicted probability"
        + (", true probability)" if data.heldout_truth is not None else ")")
        + ":"
    )
    for e in report.examples:
        truth = f"  true {e['truth']:.4f}" if e["truth"] is not None else ""
        info(f"  click={e['label']}  p={e['prediction']:.4f}{truth}   {e['line']}…")
    for r in report.rollouts:
        if r.get("freshness_s") is not None:
            kind = f" ({r['kind']})" if r.get("kind") else ""
            shipped = f", {_size(r['shipped_bytes'])} shipped to the shards" if r.get("shipped_bytes") else ""
            info(
                f"freshness of {r['version']}{kind}: {r['freshness_s']:.1f}s"
                f" from its donefile line to serving answering with it{shipped}"
            )
    t = report.timings
    info(
        "timings: "
        + ", ".join(f"{k} {v:.1f}s" for k, v in t.items())
        + (f"; {report.predictions_per_s:.0f} predictions/s through the client" if report.predictions_per_s else "")
    )
    info(
        f"MLflow UI: {report.mlflow_url} while the pipeline runs (demo --keep keeps it); afterwards: "
        f".venv/bin/mlflow ui --backend-store-uri sqlite:///{report.state_dir}/mlflow/mlflow.db"
    )
    extras = [f"logistic regression {report.lr_auc:.4f}"] if report.lr_auc is not None else []
    extras += [f"Bayes-optimal {report.bayes_auc:.4f}"] if report.bayes_auc is not None else []
    out(f"AUC {report.auc:.4f}" + (f" ({', '.join(extras)})" if extras else ""))
