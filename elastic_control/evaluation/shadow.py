"""Shadow scoring: score a candidate pass beside the active version on live requests, log both.

Serving calls a ``ShadowScorer`` as an after-response hook
(``ServingApp.add_after_response_hook``): it sees each merged batch after the
answers went out, with the active version's probabilities. The scorer hands
the batch to its own thread through a bounded queue (a full queue drops the
batch and counts it), so shadowing never slows or fails a live answer. The
thread rebuilds the keys for the candidate's slots and key transform (and its
dense slots' standardised values, when it has any), looks them up in the
candidate's sparse table (in memory) and runs its dense model.

Log: one JSON object per shadowed batch, appended to a JSONL file::

    {"time": 1700000000.1, "active_version": "pass-...", "candidate_version": "pass-...",
     "active": [p, ...], "candidate": [q, ...], "labels": [0, 1, null, ...]}

``labels`` are the clicks of ``line`` instances when they carry one (useful
for replays of logged traffic); null otherwise. ``shadow_report`` summarises a log.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import random
import threading
import time
from pathlib import Path

import numpy as np

from ctr_foundation.errors import DataError
from elastic_control.evaluation.pass_scorer import PassScorer
from elastic_control.inference.scoring import model_input
from elastic_control.metrics import counts_from_arrays, summarize
from elastic_control.serving.instances import build_key_batch

log = logging.getLogger("elastic_control.evaluation.shadow")

QUEUE_BATCHES = 64


def _labels_of(instances: list) -> list:
    out = []
    for inst in instances:
        label = None
        if isinstance(inst, dict) and isinstance(inst.get("line"), str):
            parts = inst["line"].split(None, 2)
            if len(parts) >= 2 and parts[1] in ("0", "1"):
                label = int(parts[1])
        out.append(label)
    return out


class ShadowScorer:
    """An after-response hook scoring a candidate pass on live batches (see the module docstring)."""

    def __init__(
        self,
        candidate_pass_dir: str | os.PathLike,
        log_path: str | os.PathLike,
        *,
        sample_rate: float = 1.0,
        queue_batches: int = QUEUE_BATCHES,
        threads: int = 1,
    ):
        if not 0 < sample_rate <= 1:
            raise DataError(f"shadow sample rate {sample_rate} must be in (0, 1]")
        self.scorer = PassScorer(candidate_pass_dir, threads=threads)
        self.version = self.scorer.name
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.sample_rate = sample_rate
        self.counters = {"batches": 0, "instances": 0, "dropped_batches": 0, "errors": 0, "skipped_batches": 0}
        self._queue: queue.Queue = queue.Queue(maxsize=queue_batches)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="shadow-scorer", daemon=True)
        self._stopping = False
        self._thread.start()

    def __call__(self, scored) -> None:
        """The hook: enqueue a ScoredBatch (instances, batch, version, probabilities); never blocks."""
        if self.sample_rate < 1 and random.random() >= self.sample_rate:
            self._count("skipped_batches")
            return
        try:
            self._queue.put_nowait(
                (time.time(), scored.instances, scored.version, np.asarray(scored.probabilities, np.float32).copy())
            )
        except queue.Full:
            self._count("dropped_batches")

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def score_instances(self, instances: list) -> np.ndarray:
        """The candidate's probabilities for request instances (line or slots form)."""
        info = self.scorer.info
        kb = build_key_batch(instances, info.slots, info.sparse_dim, info.dense_slots)
        vectors, _ = self.scorer.table.lookup(kb.keys)
        return self.scorer.model.predict(model_input(kb, vectors, info.dense_norm))

    def _run(self) -> None:
        with open(self.log_path, "a", encoding="utf-8") as out:
            while True:
                item = self._queue.get()
                if item is None:
                    self._queue.task_done()
                    return
                t, instances, active_version, active = item
                try:
                    candidate = self.score_instances(instances)
                    out.write(
                        json.dumps(
                            {
                                "time": t,
                                "active_version": active_version,
                                "candidate_version": self.version,
                                "active": active.tolist(),
                                "candidate": candidate.tolist(),
                                "labels": _labels_of(instances),
                            }
                        )
                        + "\n"
                    )
                    out.flush()
                    self._count("batches")
                    self._count("instances", len(instances))
                except Exception:  # noqa: BLE001 - a shadow failure must never reach serving
                    log.exception("shadow scoring of %s failed", self.version)
                    self._count("errors")
                finally:
                    self._queue.task_done()

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every queued batch is scored and logged."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._thread.join(5)


def shadow_report(log_path: str | os.PathLike) -> dict:
    """Active vs candidate over a shadow log: means, differences, correlation, AUCs when labels exist."""
    path = Path(log_path)
    if not path.exists():
        raise DataError(f"{path}: no shadow log here (is serving running with a shadow candidate?)")
    active, cand, labels, versions, torn = [], [], [], set(), 0
    with open(path, encoding="utf-8") as f:
        for raw in f:
            try:
                rec = json.loads(raw)
            except json.JSONDecodeError:
                torn += 1  # a line cut by a crash mid-write
                continue
            active.extend(rec["active"])
            cand.extend(rec["candidate"])
            labels.extend(rec.get("labels") or [None] * len(rec["active"]))
            versions.add((rec["active_version"], rec["candidate_version"]))
    if not active:
        raise DataError(f"{path}: the shadow log holds no scored requests yet")
    a, c = np.array(active, np.float64), np.array(cand, np.float64)
    diff = c - a
    report = {
        "log": str(path),
        "instances": len(a),
        "torn_lines": torn,
        "versions": sorted({f"{x} vs {y}" for x, y in versions}),
        "mean_active": float(a.mean()),
        "mean_candidate": float(c.mean()),
        "mean_diff": float(diff.mean()),
        "mean_abs_diff": float(np.abs(diff).mean()),
        "p99_abs_diff": float(np.quantile(np.abs(diff), 0.99)),
        "max_abs_diff": float(np.abs(diff).max()),
        "pearson": float(np.corrcoef(a, c)[0, 1]) if len(a) > 1 and a.std() > 0 and c.std() > 0 else None,
    }
    known = np.array([x is not None for x in labels])
    if known.any():
        y = np.array([x for x in labels if x is not None])
        report["labelled"] = int(known.sum())
        report["observed_ctr"] = float(y.mean())
        for name, s in (("active", a), ("candidate", c)):
            m = summarize(counts_from_arrays(y, s[known].astype(np.float32)))
            report[f"auc_{name}"] = m["auc"]
            report[f"logloss_{name}"] = m["logloss"]
            report[f"calibration_{name}"] = m["calibration"]
    return report


def shadow_report_table(report: dict):
    from rich.table import Table

    t = Table(title=f"shadow scoring: {', '.join(report['versions'])}")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k, v in report.items():
        if k in ("versions", "log"):
            continue
        t.add_row(k, f"{v:.6f}" if isinstance(v, float) else str(v))
    return t
