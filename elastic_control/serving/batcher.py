"""Merged batches: a queue of parsed requests, batch workers each with their own paddle predictors.

Frontends (HTTP, gRPC) parse and validate each request on their own thread, then ``submit`` it. A
worker takes everything queued (up to ``max_batch_instances``), routes every request to its A/B arm
with the split in force, and per arm builds one KeyBatch, looks its keys up (the hot-key cache, then
cube pinned to the arm's version for the misses), pools, appends the version's standardised dense slots
(``scoring.model_input``) and runs the dense model once. So concurrent requests share one cube round
trip per shard and one dense-model run, and every answer's model and cube versions are the same version.

Predictors: each worker creates the DenseModel of every version it scores in its own thread
(issue 15: predictors created in one thread and run in others crashed inside oneDNN under load), and
runs them only there. Loading a version asks every worker to create and probe its predictor first
(``prepare``); only then does the version take traffic. A worker drops a version's predictor when
told (``forget``), between batches, so a batch in flight always finishes on the predictor it began
with.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from elastic_control.inference.scoring import DenseModel, KeyBatch, model_input
from elastic_control.serving.instances import (
    ParsedInstances,
    PredictRequest,
    concat_parsed,
    parsed_key_batch,
    strict_problems,
)
from elastic_control.serving.lookup import CubeUnavailable
from elastic_control.serving.versions import LoadedVersion

log = logging.getLogger("elastic_control.serving")


@dataclass(frozen=True)
class Answer:
    probabilities: np.ndarray  # float32 [n]
    request_id: str
    arm: str
    model_version: str
    cube_version: str

    def to_json(self) -> dict:
        return {
            "predictions": self.probabilities.tolist(),
            "request_id": self.request_id,
            "arm": self.arm,
            "model_version": self.model_version,
            "cube_version": self.cube_version,
        }

    def to_json_bytes(self) -> bytes:
        """``json.dumps(self.to_json())`` + newline, written directly (hot path: one per answered request)."""
        preds = ", ".join(map(float.__repr__, self.probabilities.tolist()))
        return (
            f'{{"predictions": [{preds}], "request_id": "{self.request_id}", "arm": "{self.arm}", '
            f'"model_version": {_quoted(self.model_version)}, "cube_version": {_quoted(self.cube_version)}}}\n'
        ).encode()


_QUOTED: dict[str, str] = {}


def _quoted(text: str) -> str:
    q = _QUOTED.get(text)
    if q is None:
        import json

        q = _QUOTED[text] = json.dumps(text)
        if len(_QUOTED) > 1000:
            _QUOTED.clear()
    return q


@dataclass(frozen=True)
class Refusal:
    status: int  # HTTP status; the gRPC frontend maps it to a status code
    message: str


Outcome = Answer | Refusal


@dataclass
class Job:
    request: PredictRequest
    frontend: Frontend
    context: object  # the frontend's handle on where the answer goes (an HTTP slot, an asyncio future)
    started: float = field(default_factory=time.perf_counter)

    @property
    def n(self) -> int:
        return self.request.parsed.n


class Frontend:
    """Where answers go: ``deliver(items)`` is called on a worker thread with [(job, outcome), ...]."""

    name = "frontend"

    def deliver(self, items: list[tuple[Job, Outcome]]) -> None:  # pragma: no cover - interface
        raise NotImplementedError


@dataclass(frozen=True)
class ScoredBatch:
    """What an after-response hook sees: a merged batch of the control arm as scored by the active version.

    Shadow scoring (evaluation/shadow.py) plugs in here. Hooks run on the batch worker after the
    answers were handed back; their failures are logged, never served.
    """

    instances: list
    batch: KeyBatch
    version: str
    probabilities: np.ndarray


class _Worker:
    def __init__(self, batcher: Batcher, index: int):
        self.batcher, self.index = batcher, index
        self.models: dict[int, DenseModel] = {}  # load_id -> predictor created in this thread
        self.control: collections.deque[tuple[Callable[[], object], Future]] = collections.deque()
        self.thread = threading.Thread(target=self.run, name=f"serving-batch-{index}", daemon=True)

    def model_for(self, version: LoadedVersion) -> DenseModel:
        model = self.models.get(version.load_id)
        if model is None:  # not prepared (a version loaded while this worker was busy): create it here
            model = self.models[version.load_id] = self._create(version)
        return model

    def _create(self, version: LoadedVersion) -> DenseModel:
        model = DenseModel(version.dense_prefix, onednn=self.batcher.onednn, bind_thread=True)
        width = version.input_width
        out = model.predict(np.zeros((1, width), np.float32))
        if out.shape != (1,) or not np.isfinite(out).all():
            raise ValueError(f"version {version.version}: dense model gave {out!r} for one zero row of width {width}")
        return model

    def prepare(self, version: LoadedVersion) -> None:
        self.models[version.load_id] = self._create(version)

    def forget(self, load_id: int) -> None:
        self.models.pop(load_id, None)

    def run_control(self) -> None:
        while self.control:
            fn, fut = self.control.popleft()
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                fut.set_exception(e)

    def run(self) -> None:
        b = self.batcher
        while not b.stopping.is_set():
            self.run_control()
            jobs = b.take_jobs(self)
            if jobs:
                try:
                    b.score(jobs, self)
                except Exception as e:  # noqa: BLE001 - answer every request, whatever happened
                    log.exception("batch failed")
                    b.answer_all([(j, Refusal(500, f"internal error: {type(e).__name__}: {e}")) for j in jobs])
        self.models.clear()


class Batcher:
    """The queue and the workers; ``app`` resolves arms and versions and does lookups (app.py)."""

    def __init__(self, app, *, workers: int = 2, max_batch_instances: int = 2048, onednn: bool = False):
        self.app = app
        self.max_batch_instances = max_batch_instances
        self.onednn = onednn
        self.stopping = threading.Event()
        self.hooks: list[Callable[[ScoredBatch], None]] = []
        self._queue: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._workers = [_Worker(self, i) for i in range(workers)]
        self.inflight = 0  # submitted and not yet answered (drain waits for 0)
        self._inflight_lock = threading.Lock()

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        for w in self._workers:
            w.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        with self._cond:
            self._cond.notify_all()
        for w in self._workers:
            if w.thread.ident is not None:  # a start-up failure stops workers that never started
                w.thread.join(5)

    # ---- per-worker tasks -----------------------------------------------------------------
    def _on_every_worker(self, make_task: Callable[[_Worker], Callable[[], object]], timeout: float) -> list:
        futures = []
        with self._cond:
            for w in self._workers:
                fut: Future = Future()
                w.control.append((make_task(w), fut))
                futures.append(fut)
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        return [f.result(timeout=max(0.0, deadline - time.monotonic())) for f in futures]

    def prepare(self, version: LoadedVersion, timeout: float = 120.0) -> None:
        """Every worker creates (in its own thread) and probes its predictor of ``version``; raises on failure."""
        self._on_every_worker(lambda w: lambda: w.prepare(version), timeout)

    def forget(self, version: LoadedVersion) -> None:
        """Workers drop their predictors of ``version`` between batches (no wait)."""
        with self._cond:
            for w in self._workers:
                w.control.append((lambda w=w: w.forget(version.load_id), Future()))
            self._cond.notify_all()

    # ---- queue ------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        self.submit_many([job])

    def submit_many(self, jobs: list[Job]) -> None:
        """Queue ``jobs`` at once: one lock and at most one wake-up for all of them (issue 13: a wake-up per
        request cost more GIL time than decoding its JSON, and woke a worker for a batch of one)."""
        with self._inflight_lock:
            self.inflight += len(jobs)
        with self._cond:
            self._queue.extend(jobs)
            self._cond.notify()

    def take_jobs(self, worker: _Worker) -> list[Job]:
        with self._cond:
            while not self._queue and not self.stopping.is_set() and not worker.control:
                self._cond.wait(0.5)
            jobs, n = [], 0
            while self._queue and (not jobs or n + self._queue[0].n <= self.max_batch_instances):
                job = self._queue.popleft()
                jobs.append(job)
                n += job.n
            return jobs

    def queued(self) -> int:
        with self._cond:
            return len(self._queue)

    # ---- answers ------------------------------------------------------------------------------
    def answer_all(self, items: list[tuple[Job, Outcome]]) -> None:
        if not items:
            return
        now = time.perf_counter()
        by_frontend: dict[int, tuple[Frontend, list]] = {}
        observed = []
        for job, outcome in items:
            status = 200 if isinstance(outcome, Answer) else outcome.status
            observed.append((status, now - job.started, job.n if status == 200 else 0))
            by_frontend.setdefault(id(job.frontend), (job.frontend, []))[1].append((job, outcome))
        self.app.metrics.observe_requests(observed)
        with self._inflight_lock:
            self.inflight -= len(items)
        for frontend, group in by_frontend.values():
            try:
                frontend.deliver(group)
            except Exception:  # noqa: BLE001 - one frontend's failure must not stop the others
                log.exception("delivering answers through %s failed", frontend.name)

    # ---- scoring --------------------------------------------------------------------------------
    def score(self, jobs: list[Job], worker: _Worker) -> None:
        app = self.app
        groups: dict[tuple[str, int], tuple[str, LoadedVersion, list[Job]]] = {}
        refused: list[tuple[Job, Outcome]] = []
        for job in jobs:
            arm, version = app.resolve(job.request)
            if version is None:
                refused.append((job, app.not_ready()))
                continue
            groups.setdefault((arm, version.load_id), (arm, version, []))[2].append(job)
        self.answer_all(refused)
        for arm, version, group in groups.values():
            self._score_group(arm, version, group, worker)

    def _score_group(self, arm: str, version: LoadedVersion, jobs: list[Job], worker: _Worker) -> None:
        app = self.app
        for attempt in range(2):
            jobs, kb, offsets, refused = _key_batch_of(jobs, version)
            self.answer_all(refused)
            if not jobs:
                return
            try:
                values, found = app.embeddings(version, kb.keys)
            except CubeUnavailable as e:
                app.metrics.count("cube_errors")
                retry = app.after_cube_failure(arm, version) if attempt == 0 else None
                if retry is not None:  # the active version moved on, or a challenger falls back to control
                    arm, version = retry
                    continue
                self.answer_all([(j, Refusal(503, f"cube unavailable: {e}")) for j in jobs])
                return
            break
        probs = worker.model_for(version).predict(model_input(kb, values, version.dense_norm))
        app.metrics.observe_batch(kb.n)
        num_slots = len(version.slots)
        slot_keys = np.bincount(kb.slot_pos, minlength=num_slots)
        slot_unknown = np.bincount(kb.slot_pos[~found], minlength=num_slots)
        app.monitor.observe_predictions(arm, version.version, version.slots, probs, slot_keys, slot_unknown)
        ids = app.prediction_log.record_batch(arm, version.version, probs, [j.n for j in jobs])
        items = [
            (job, Answer(probs[off : off + job.n], rid, arm, version.version, version.version))
            for job, off, rid in zip(jobs, offsets, ids, strict=True)
        ]
        self.answer_all(items)
        if self.hooks and arm == app.control_arm_name():
            instances = [i for j in jobs for i in (j.request.instances or ())]
            scored = ScoredBatch(instances, kb, version.version, probs)
            for hook in self.hooks:
                try:
                    hook(scored)
                except Exception:  # noqa: BLE001
                    log.exception("after-response hook %r failed", hook)


def _key_batch_of(
    jobs: list[Job], version: LoadedVersion
) -> tuple[list[Job], KeyBatch, list[int], list[tuple[Job, Outcome]]]:
    """One KeyBatch for the jobs of one version; a job the version cannot score (a slot it lacks, a number
    for one of its sparse slots, ...: ``strict_problems``) is refused alone."""
    slots, dense_slots = version.slots, version.dense_slots
    merged, offsets = concat_parsed([j.request.parsed for j in jobs])
    refused = []
    if strict_problems(merged, slots, dense_slots):
        # rare: name each bad request's own first problem, with its own instance numbers
        refused = [
            (j, Refusal(400, problems[min(problems)]))
            for j in jobs
            if (problems := strict_problems(j.request.parsed, slots, dense_slots))
        ]
        bad = {id(j) for j, _ in refused}
        jobs = [j for j in jobs if id(j) not in bad]
        if not jobs:
            nothing = ParsedInstances(0, [], [], [], None)
            return [], parsed_key_batch(nothing, slots, version.sparse_dim, dense_slots), [], refused
        merged, offsets = concat_parsed([j.request.parsed for j in jobs])
    return jobs, parsed_key_batch(merged, slots, version.sparse_dim, dense_slots), offsets, refused
