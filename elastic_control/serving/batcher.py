"""Merged batches: a queue of parsed requests, batch workers each with their own paddle predictors.

Frontends (HTTP, gRPC) validate each request on their own thread (a request of lines only is left
unparsed: the worker parses the lines of all such requests of its batch at once, instances.parse_parts),
then ``submit`` it (Frontend.submit: one wake-up per pass of the frontend's loop). A worker takes what is
queued (up to ``max_batch_instances``; a large request one part at a time, see
``Batcher``), routes every request to its A/B arm with the split in force, and per arm builds one
KeyBatch, takes its keys from the hot-key cache, pools, appends the version's standardised dense slots
(``scoring.model_input``) and runs the dense model once. When some of a batch's keys are neither cached
nor looked up yet, its new requests are set aside while those keys are looked up in cube, pinned to the
arm's version, one lookup for all of them (one request per shard that holds one of the keys), and come
back to the front of the queue together, as one batch, once every shard asked has answered or
``LOOKUP_HOLD`` after the lookup began, whichever is first (a slower shard then delays only the requests
that need it). So concurrent requests share one cube round trip per shard and one dense-model run,
every answer's model and cube versions are the same version, and no request waits long on a shard it
does not need.

Predictors: each worker creates the DenseModel of every version it scores in its own thread
(predictors created in one thread and run in others crashed inside oneDNN under load), and
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
import orjson

from elastic_control.inference.scoring import DENSE_BLOCK_ROWS, DenseModel, KeyBatch, model_input
from elastic_control.serving.instances import (
    InstanceError,
    ParsedInstances,
    PredictRequest,
    UnparsedLines,
    concat_parsed,
    parse_parts,
    parsed_key_batch,
    slice_parsed,
    strict_problems,
)
from elastic_control.serving.lookup import CubeUnavailable
from elastic_control.serving.versions import LoadedVersion

log = logging.getLogger("elastic_control.serving")

# Seconds a request arriving while others are in flight may wait for more to join its batch
# (Frontend.submit; serving's --batch-delay in milliseconds).
DEFAULT_BATCH_DELAY = 0.002

# Seconds the requests of a batch with keys to look up wait for the whole lookup before those it has
# answered go on alone. Coming back as one batch they share one dense-model run: split per shard and
# into requests with and without keys to look up, a cold cache scored single requests in up to three
# times as many runs as without a cache (bench/bench_serving.py, 1 x c32; CHANGELOG.md). Above a loaded
# shard's round trip (a 0.5 ms hold split the batches again); far below the lookup timeout, what a
# stalled shard costs the requests that need it.
LOOKUP_HOLD = 0.01

# What the app answers for a part whose lookup failed when the reload thread should look for a newer version
# first (ServingApp.after_cube_failure): the part waits in Batcher._held until release_held.
CHECK_FIRST = object()


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
        """``to_json()`` as JSON + newline (hot path: one per answered request; orjson 1.5 us for 32 floats, the
        same numbers as json.dumps, which took 17 us)."""
        return orjson.dumps(self.to_json(), option=orjson.OPT_APPEND_NEWLINE)


@dataclass(frozen=True)
class Refusal:
    status: int  # HTTP status; the gRPC frontend maps it to a status code
    message: str


Outcome = Answer | Refusal


@dataclass(eq=False)
class Job:
    request: PredictRequest
    frontend: Frontend
    context: object  # the frontend's handle on where the answer goes (an HTTP slot, an asyncio future)
    started: float = field(default_factory=time.perf_counter)
    # the batcher's bookkeeping (under Batcher._jobs_lock once the job is queued)
    pin: tuple[str, LoadedVersion] | None = None  # the arm and version that score every part of it
    retried: bool = False
    queued_rows: int = 0  # instances handed out as parts so far
    scored_rows: int = 0
    probabilities: np.ndarray | None = None  # a request split into parts: the parts' answers gather here
    answered: bool = False

    @property
    def n(self) -> int:
        return self.request.parsed.n


@dataclass(eq=False)
class _Part:
    """Instances ``lo`` .. ``hi - 1`` of a job: the unit the workers merge into batches. A small request is
    one part; a large one is cut into parts of at most ``Batcher.part_instances`` that take turns with other
    requests in the queue."""

    job: Job
    lo: int
    hi: int
    parsed: ParsedInstances
    # looked up for it while it waited: (load_id, [(keys sorted unique, values, found), ...])
    rows: tuple[int, list] | None = None
    error: CubeUnavailable | None = None  # its lookup failed
    held: bool = False  # it waited once for the reload thread to look for a newer version

    @property
    def n(self) -> int:
        return self.hi - self.lo

    @property
    def whole(self) -> bool:
        return self.lo == 0 and self.hi == self.job.n


class Frontend:
    """A frontend's event loop and the batch workers: requests in (``submit``, on the loop), answers out
    (``deliver(items)``, called on a worker thread with [(job, outcome), ...])."""

    name = "frontend"

    def __init__(self, app):
        self.app = app
        self.loop = None  # the frontend's event loop, set once it runs
        self._pending: list[Job] = []  # submitted on the loop, not yet queued
        self._pending_instances = 0
        self._timer = None  # the delayed flush while requests wait for others to join them

    def submit(self, job: Job) -> None:
        """Queue ``job`` for the batch workers at the end of the loop's current pass (on the loop thread).

        The requests that became ready together (every readable connection's, every gRPC call the loop
        took in) are queued with one lock and one wake-up (``Batcher.submit_many``), so a worker wakes to
        a merged batch instead of to the first of them. A lone request waits for nothing: the pass ends
        right after its own callback. While other requests are in flight, the first one queued after them
        waits up to ``Batcher.batch_delay`` seconds (or until a full batch is pending) for more to join:
        under concurrent load, calls that arrive one at a time (gRPC's, typically) would otherwise wake a
        worker each, and a batch of one request spends on the GIL what the frontend needs to take calls in.
        """
        if not self._pending:
            batcher = self.app.batcher
            if batcher.batch_delay and batcher.inflight > 0:
                self._timer = self.loop.call_later(batcher.batch_delay, self.flush)
            else:
                self.loop.call_soon(self.flush)
        self._pending.append(job)
        self._pending_instances += job.n
        if self._timer is not None and self._pending_instances >= self.app.batcher.max_batch_instances:
            self.flush()  # a full batch has nothing to wait for

    def flush(self) -> None:
        """Queue what ``submit`` holds (the loop's callback; the drain calls it before waiting for the workers)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        jobs, self._pending, self._pending_instances = self._pending, [], 0
        if jobs:
            self.app.batcher.submit_many(jobs)

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
        if model is None and version.retired:  # a part pinned before the switch: kept, it would never be dropped
            return self._create(version)
        if model is None:  # not prepared (a version loaded while this worker was busy): create it here
            model = self.models[version.load_id] = self._create(version)
        return model

    def _create(self, version: LoadedVersion) -> DenseModel:
        model = DenseModel(
            version.dense_prefix, onednn=self.batcher.onednn, bind_thread=True, block_rows=self.batcher.block_rows
        )
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
            parts = b.take_parts(self)
            if parts:
                try:
                    b.score(parts, self)
                except Exception as e:  # noqa: BLE001 - answer every request, whatever happened
                    log.exception("batch failed")
                    b.refuse_jobs(parts, Refusal(500, f"internal error: {type(e).__name__}: {e}"))
        self.models.clear()


class Batcher:
    """The queue and the workers; ``app`` resolves arms and versions and does lookups (app.py).

    The queue is fair between requests: a request of more than ``part_instances`` instances is cut into
    parts of that size, one part per batch, and after each part the rest of it goes behind the requests
    that came meanwhile; so a small request waits for at most about one part of each large request ahead
    of it, not for whole large requests. Workers never wait on cube: a batch whose keys are all in the
    cache (or were looked up for its parts) is scored at once; otherwise its new parts are set aside while
    the missing keys are looked up (lookup.py: per shard, bounded by the lookup timeout) and come back to
    the front of the queue with their rows, together (``_Pending``), or with the lookup's error (a 503 for
    their requests alone), and the parts back from a lookup already are scored at once.
    """

    def __init__(
        self,
        app,
        *,
        workers: int = 2,
        max_batch_instances: int = 2048,
        onednn: bool = False,
        part_instances: int = 256,
        block_rows: int | None = DENSE_BLOCK_ROWS,
        batch_delay: float = DEFAULT_BATCH_DELAY,
        lookup_hold: float = LOOKUP_HOLD,
    ):
        self.app = app
        self.lookup_hold = lookup_hold
        self.max_batch_instances = max_batch_instances
        self.batch_delay = batch_delay  # seconds a request may wait for others while requests are in flight
        self.part_instances = max(1, min(part_instances, max_batch_instances))
        self.block_rows = block_rows
        self.onednn = onednn
        self.stopping = threading.Event()
        self.hooks: list[Callable[[ScoredBatch], None]] = []
        self._queue: collections.deque[Job | _Part] = collections.deque()
        self._cond = threading.Condition()
        self._jobs_lock = threading.Lock()
        self._workers = [_Worker(self, i) for i in range(workers)]
        self._held: list[_Part] = []  # parts waiting for the reload thread's next look (CHECK_FIRST)
        self._lookups: list[_Pending] = []  # lookups holding answered parts back until LOOKUP_HOLD (under _cond)
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
        """Queue ``jobs`` at once: one lock and at most one wake-up for all of them (a wake-up per request
        cost more GIL time than decoding its JSON, and woke a worker for a batch of one)."""
        with self._inflight_lock:
            self.inflight += len(jobs)
        with self._cond:
            self._queue.extend(jobs)
            self._cond.notify()

    def release_held(self) -> None:
        """The reload thread has looked for a newer version: the parts that waited for it are scored again."""
        with self._cond:
            parts, self._held = self._held, []
        if parts:
            self._come_back(parts)

    def _come_back(self, parts: list[_Part]) -> None:
        """Parts whose lookup ended go to the front of the queue: they have waited already."""
        with self._cond:
            self._queue.extendleft(reversed(parts))
            self._cond.notify()

    def _hold(self, pending: _Pending) -> None:
        with self._cond:
            self._lookups.append(pending)

    def _release_expired_holds(self) -> float:
        """Under _cond: put the parts of lookups whose hold ended at the front of the queue; the seconds to the
        next hold's end (0.5 when none holds)."""
        now, wait, holding = time.monotonic(), 0.5, []
        for pending in self._lookups:
            until = pending.hold_until
            if until is None:  # complete, failed or released already
                continue
            if until <= now:
                self._queue.extendleft(reversed(pending.release_held()))
            else:
                holding.append(pending)
                wait = min(wait, until - now)
        self._lookups = holding
        return wait

    def take_parts(self, worker: _Worker) -> list[_Part]:
        with self._cond:
            while True:
                wait = self._release_expired_holds() if self._lookups else 0.5
                if self._queue or self.stopping.is_set() or worker.control:
                    break
                self._cond.wait(wait)
            parts: list[_Part] = []
            taken: set[int] = set()  # jobs with a part in this batch: at most one new part of each
            n = 0
            while self._queue:
                item = self._queue[0]
                if isinstance(item, _Part):
                    if parts and n + item.n > self.max_batch_instances:
                        break
                    self._queue.popleft()
                    parts.append(item)
                    n += item.n
                    continue
                job = item
                if job.answered:  # refused while parts of it were out
                    self._queue.popleft()
                    continue
                size = min(job.n - job.queued_rows, self.part_instances)
                if parts and (n + size > self.max_batch_instances or id(job) in taken):
                    break
                self._queue.popleft()
                lo, hi = job.queued_rows, job.queued_rows + size
                parsed = job.request.parsed if (lo, hi) == (0, job.n) else slice_parsed(job.request.parsed, lo, hi)
                job.queued_rows = hi
                parts.append(_Part(job, lo, hi, parsed))
                taken.add(id(job))
                n += size
                if hi < job.n:  # the rest waits behind the requests that came after it
                    self._queue.append(job)
            return parts

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

    def refuse_jobs(self, parts: list[_Part], refusal: Refusal) -> None:
        """Answer ``refusal`` for the jobs of ``parts`` not answered yet (their other parts are dropped)."""
        self.answer_all([(job, refusal) for job in self._first_answers([p.job for p in parts])])

    def _first_answers(self, jobs: list[Job]) -> list[Job]:
        out = []
        with self._jobs_lock:
            for job in jobs:
                if not job.answered:
                    job.answered = True
                    out.append(job)
        return out

    # ---- scoring --------------------------------------------------------------------------------
    def score(self, parts: list[_Part], worker: _Worker) -> None:
        app = self.app
        groups: dict[tuple[str, int], tuple[str, LoadedVersion, list[_Part]]] = {}
        refused: list[tuple[_Part, Refusal]] = self._parse_lines(parts)
        for part in parts:
            job = part.job
            if job.answered or isinstance(part.parsed, UnparsedLines):  # answered, or its lines were refused
                continue
            if part.error is not None:
                error = part.error
                retry = self._after_failure(part)
                if retry is CHECK_FIRST:
                    continue
                if retry is None:
                    refused.append((part, Refusal(503, f"cube unavailable: {error}")))
                    continue
            elif job.pin is None:
                arm, version = app.resolve(job.request)
                if version is None:
                    refused.append((part, app.not_ready()))
                    continue
                if not part.whole and (
                    problems := strict_problems(job.request.parsed, version.slots, version.dense_slots)
                ):
                    refused.append((part, Refusal(400, problems[min(problems)])))
                    continue
                job.pin = (arm, version)
            arm, version = job.pin
            groups.setdefault((arm, version.load_id), (arm, version, []))[2].append(part)
        for part, refusal in refused:
            self.refuse_jobs([part], refusal)
        for arm, version, group in groups.values():
            self._score_group(arm, version, group, worker)

    @staticmethod
    def _parse_lines(parts: list[_Part]) -> list[tuple[_Part, Refusal]]:
        """Parse the lines the frontends left unparsed, every part's at once (instances.parse_parts); the
        parts with a bad line are refused (and keep their UnparsedLines)."""
        waiting = [p for p in parts if isinstance(p.parsed, UnparsedLines) and not p.job.answered]
        refused = []
        for part, parsed in zip(waiting, parse_parts([p.parsed for p in waiting]), strict=True):
            if isinstance(parsed, InstanceError):
                refused.append((part, Refusal(parsed.status, str(parsed))))
            else:
                part.parsed = parsed
        return refused

    def _after_failure(self, part: _Part):
        """The (arm, version) a part whose lookup failed is tried again with, once; None (-> 503); or CHECK_FIRST
        when it waits (once) for the reload thread to look for a newer version first.

        Only a whole request is tried again (a part of a larger one would mix versions in one answer), and only
        where another version can answer: the version moved on in cube, or a challenger falls back to control.
        A shard that did not answer is not asked again: the next lookup would wait for it too."""
        job, error = part.job, part.error
        part.error, part.rows = None, None
        if job.retried or not part.whole or job.pin is None:
            return None
        arm, version = job.pin
        challenger = version is not self.app.active and arm != self.app.control_arm_name()
        if not (error.version_missing or challenger):
            return None
        retry = self.app.after_cube_failure(arm, version, held=part.held)
        if retry is CHECK_FIRST:
            part.error, part.held = error, True
            with self._cond:
                self._held.append(part)
            self.app.check_soon()  # after the part is held: the look that follows releases it
            return CHECK_FIRST
        if retry is None or retry[1] is None:
            return None
        job.pin, job.retried = retry, True
        return retry

    def _score_group(self, arm: str, version: LoadedVersion, parts: list[_Part], worker: _Worker) -> None:
        app = self.app
        while parts:
            parts, kb, offsets, refused = _key_batch_of(parts, version)
            for part, refusal in refused:
                self.refuse_jobs([part], refusal)
            if not parts:
                return
            values, found, hit = app.cached_rows(version, kb.keys, [p.rows for p in parts], [p.n for p in parts], kb)
            if hit.all():
                self._scored(arm, version, parts, offsets, kb, values, found, worker)
                return
            # The parts with a key neither cached nor looked up wait for a lookup, and so do the parts that have
            # not waited yet: they come back together, as one batch. The parts back from a lookup go on now
            # (made to wait again, they could follow one new request's lookup after another).
            of_part = np.repeat(np.arange(len(parts)), [p.n for p in parts])
            waits = np.array([p.rows is None for p in parts])
            waits[of_part[kb.rows[~hit]]] = True
            waiting = [p for p, w in zip(parts, waits, strict=True) if w]
            keys, key_at = np.unique(kb.keys[~hit], return_inverse=True)
            number = np.cumsum(waits) - 1  # a waiting part's place in ``waiting``
            pending = _Pending(self, waiting, version, keys, key_at, number[of_part[kb.rows[~hit]]])
            self._hold(pending)
            app.fetch(version, keys, pending.piece)
            parts = [p for p, w in zip(parts, waits, strict=True) if not w]

    def _scored(self, arm, version, parts, offsets, kb, values, found, worker) -> None:
        app = self.app
        probs = worker.model_for(version).predict(model_input(kb, values, version.dense_norm))
        app.metrics.observe_batch(kb.n)
        num_slots = len(version.slots)
        # One key a cell (the common case): every slot has n keys, and only the unknown keys' slots are
        # counted (a modulo over a few keys, not over the batch's ~20,000).
        if kb.cell_starts is None:
            slot_keys = np.full(num_slots, kb.n, np.int64)
        else:
            slot_keys = np.bincount(kb.slot_pos, minlength=num_slots)
        slot_unknown = np.bincount(kb.cells[~found] % max(num_slots, 1), minlength=num_slots)
        app.monitor.observe_predictions(arm, version.version, version.slots, probs, slot_keys, slot_unknown)
        whole = [(p, off) for p, off in zip(parts, offsets, strict=True) if p.whole]
        items: list[tuple[Job, Outcome]] = []
        if whole:
            mine = self._first_answers([p.job for p, _ in whole])
            if len(mine) < len(whole):  # a job refused meanwhile (it has no other part: cannot happen)
                whole = [(p, off) for p, off in whole if p.job in mine]
            if len(whole) == len(parts):
                probs_whole = probs
            else:
                probs_whole = np.concatenate([probs[off : off + p.n] for p, off in whole])
            ids = app.prediction_log.record_batch(arm, version.version, probs_whole, [p.n for p, _ in whole])
            items += [
                (p.job, Answer(probs[off : off + p.n], rid, arm, version.version, version.version))
                for (p, off), rid in zip(whole, ids, strict=True)
            ]
        for p, off in zip(parts, offsets, strict=True):
            if not p.whole and (done := self._gather(p, probs[off : off + p.n])) is not None:
                (rid,) = app.prediction_log.record_batch(arm, version.version, done, [len(done)])
                items.append((p.job, Answer(done, rid, arm, version.version, version.version)))
        self.answer_all(items)
        if self.hooks and arm == app.control_arm_name():
            instances = []
            for p in parts:
                given = p.job.request.instances
                instances += given[p.lo : p.hi] if given else []
            scored = ScoredBatch(instances, kb, version.version, probs)
            for hook in self.hooks:
                try:
                    hook(scored)
                except Exception:  # noqa: BLE001
                    log.exception("after-response hook %r failed", hook)

    def _gather(self, part: _Part, probs: np.ndarray) -> np.ndarray | None:
        """Put a part's answers in its job's; the job's probabilities once this was its last part."""
        job = part.job
        with self._jobs_lock:
            if job.answered:
                return None
            if job.probabilities is None:
                job.probabilities = np.empty(job.n, np.float32)
            job.probabilities[part.lo : part.hi] = probs
            job.scored_rows += part.n
            if job.scored_rows < job.n:
                return None
            job.answered = True
            return job.probabilities


class _Pending:
    """Parts of a batch waiting for the lookup of the keys some of them miss. The lookup comes in pieces
    (one per shard). The parts go back to the queue together once every piece is in; when a piece failed or
    ``Batcher.lookup_hold`` has passed first, each part goes back as soon as every key it needs is in (so
    it never waits long for a shard it does not need), and a part that needs a key of a shard that failed
    goes back with that error."""

    def __init__(self, batcher: Batcher, parts: list[_Part], version: LoadedVersion, keys, key_at, part_at):
        self.batcher, self.parts, self.version, self.keys = batcher, parts, version, keys
        pairs = np.unique(np.stack([key_at.astype(np.int64), part_at.astype(np.int64)]), axis=1)
        self.pair_key, self.pair_part = pairs[0], pairs[1]  # each (key, part that needs it) once
        self.left = np.bincount(self.pair_part, minlength=len(parts))  # 0 for a part that needs no key
        self.back = np.zeros(len(parts), bool)  # gone back to the queue
        # parts whose keys are in stay until then (None: each goes back as soon as its keys are in)
        self.hold_until: float | None = time.monotonic() + batcher.lookup_hold
        self.pieces: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.error: list[CubeUnavailable | None] = [None] * len(parts)
        self.failed = False
        self.lock = threading.Lock()

    def piece(self, looked) -> None:
        with self.lock:
            mask = np.zeros(len(self.keys), bool)
            mask[looked.idx] = True
            hit_parts = self.pair_part[mask[self.pair_key]]
            if looked.error is None:
                if len(looked.idx):
                    self.pieces.append((self.keys[looked.idx], looked.values, looked.found))
            else:
                for j in np.unique(hit_parts).tolist():
                    self.error[j] = self.error[j] or looked.error
            self.left -= np.bincount(hit_parts, minlength=len(self.parts))
            first_error = looked.error is not None and not self.failed
            self.failed = self.failed or looked.error is not None
            if self.failed or not self.left.any():
                self.hold_until = None
            back = self._ready()
        if first_error:  # one per failed lookup, however many of its shards failed
            self.batcher.app.metrics.count("cube_errors")
        if back:
            self.batcher._come_back(back)

    def release_held(self) -> list[_Part]:
        """The hold has passed (the batcher's workers watch it): from now on each part goes back once its keys
        are in; those whose keys are in already are returned (for the front of the queue)."""
        with self.lock:
            self.hold_until = None
            return self._ready()

    def _ready(self) -> list[_Part]:
        """Under the lock: the parts to send back now, with the rows looked up for them so far."""
        if self.hold_until is not None:
            return []
        ready = np.flatnonzero((self.left == 0) & ~self.back)
        self.back[ready] = True
        back = []
        for j in ready.tolist():
            p = self.parts[j]
            # Keep what earlier lookups brought this part: the cache is set-associative, so keys it held when
            # the part left can be evicted by the time it is back; with only the newest pieces a part whose
            # keys share a set went back and forth for ever.
            earlier = p.rows[1] if p.rows is not None and p.rows[0] == self.version.load_id else []
            p.rows, p.error = (self.version.load_id, [*earlier, *self.pieces]), self.error[j]
            back.append(p)
        return back


def _key_batch_of(
    parts: list[_Part], version: LoadedVersion
) -> tuple[list[_Part], KeyBatch, list[int], list[tuple[_Part, Outcome]]]:
    """One KeyBatch for the parts of one version; a request the version cannot score (a slot it lacks, a number
    for one of its sparse slots, ...: ``strict_problems``) is refused alone."""
    slots, dense_slots = version.slots, version.dense_slots
    merged, offsets = concat_parsed([p.parsed for p in parts])
    refused = []
    if strict_problems(merged, slots, dense_slots):
        # rare: name each bad request's own first problem, with its own instance numbers
        refused = [
            (p, Refusal(400, problems[min(problems)]))
            for p in parts
            if (problems := strict_problems(p.parsed, slots, dense_slots))
        ]
        bad = {id(p) for p, _ in refused}
        parts = [p for p in parts if id(p) not in bad]
        if not parts:
            nothing = ParsedInstances(0, [], [], [], None)
            return [], parsed_key_batch(nothing, slots, version.sparse_dim, dense_slots), [], refused
        merged, offsets = concat_parsed([p.parsed for p in parts])
    return parts, parsed_key_batch(merged, slots, version.sparse_dim, dense_slots), offsets, refused
