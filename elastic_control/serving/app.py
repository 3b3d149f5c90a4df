"""Serving's core: the active version, hot reload, merged batches, and the HTTP routes.

Requests are parsed for shape on the event loop and queued; batch workers
take everything queued (up to ``max_batch_instances``), so concurrent
requests share one cube round trip per shard and one dense-model run. A
worker picks the active version once per batch and pins the cube lookup to
it, so every answer's model and cube versions match. A version switch
replaces the whole LoadedVersion object: batches already running finish
with the old one (cube keeps the previous version mapped), new batches take
the new one, and no request fails during the switch.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ctr_foundation import names
from ctr_foundation.http_json import parse_json
from ctr_foundation.http_messages import HttpError, Request, Response, Slot
from elastic_control.inference.scoring import KeyBatch, pool
from elastic_control.serving.instances import InstanceError, build_key_batch, concat_batches, instances_of
from elastic_control.serving.lookup import CubeUnavailable
from elastic_control.serving.metrics import ServingMetrics
from elastic_control.serving.versions import LoadedVersion

log = logging.getLogger("elastic_control.serving")

DEFAULT_PORT = names.SERVING_PORT
DEFAULT_MAX_BODY = 8 << 20


@dataclass
class PendingRequest:
    instances: list
    slot: Slot
    deliver: Callable[[Slot, Response], None]
    started: float


@dataclass(frozen=True)
class ScoredBatch:
    """What an after-response hook sees: a merged batch as scored by the active version.

    Shadow scoring (issue 7) plugs in here: score ``batch`` with a candidate
    version's lookup and dense model, log both scores. Hooks run on the batch
    worker after the answers were sent; their failures are logged, never served.
    """

    instances: list
    batch: KeyBatch
    version: str
    probabilities: np.ndarray


AfterResponseHook = Callable[[ScoredBatch], None]


class ServingApp:
    def __init__(
        self,
        source,
        *,
        workers: int = 2,
        poll_interval: float = 1.0,
        max_batch_instances: int = 2048,
        reload_wait: float = 10.0,
    ):
        self.source = source
        self.workers = workers
        self.poll_interval = poll_interval
        self.max_batch_instances = max_batch_instances
        self.reload_wait = reload_wait
        self.metrics = ServingMetrics()
        self.active: LoadedVersion | None = None
        self.last_reload_error: str | None = None
        self.loop = None  # the HTTP server's event loop; answers are handed back to it
        self.hooks: list[AfterResponseHook] = []
        self._queue: collections.deque[PendingRequest] = collections.deque()
        self._cond = threading.Condition()
        self._reload_lock = threading.Lock()
        self._failed_version: tuple[str, float] | None = None
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    # ---- lifecycle ------------------------------------------------------
    def start(self) -> None:
        self._threads = [threading.Thread(target=self._poll_versions, name="serving-reload", daemon=True)]
        self._threads += [
            threading.Thread(target=self._batch_worker, args=(i,), name=f"serving-batch-{i}", daemon=True)
            for i in range(self.workers)
        ]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
        for t in self._threads:
            t.join(5)

    def add_after_response_hook(self, hook: AfterResponseHook) -> None:
        """Run ``hook(ScoredBatch)`` after every scored batch (e.g. shadow scoring of a candidate)."""
        self.hooks.append(hook)

    # ---- versions -------------------------------------------------------
    def check_version_now(self, timeout: float | None = None) -> bool:
        """Load the source's current version if it differs from the active one; True if it switched."""
        if not self._reload_lock.acquire(timeout=self.reload_wait if timeout is None else timeout):
            return False
        try:
            record = self.source.current()
            if record is None or (self.active is not None and record.version == self.active.version):
                return False
            version = record.version
            if (
                self._failed_version
                and self._failed_version[0] == version
                and time.monotonic() - self._failed_version[1] < 30
            ):
                return False  # a broken version is retried every 30 s, not every poll
            started = time.monotonic()
            try:
                loaded = self.source.materialise(record, self.workers)
            except Exception as e:  # noqa: BLE001 - keep serving the old version, report why
                self._failed_version = (version, time.monotonic())
                self.last_reload_error = f"version {version} failed to load: {e}"
                self.metrics.count("reload_failures")
                log.error(
                    "%s (still serving %s)", self.last_reload_error, self.active.version if self.active else "nothing"
                )
                return False
            old, self.active = self.active, loaded
            self.last_reload_error = None
            self.metrics.count("reloads")
            log.info(
                "serving version %s (was %s), loaded in %.2fs",
                version,
                old.version if old else None,
                time.monotonic() - started,
            )
            if old is not None:
                # Batches still using ``old`` hold their own reference; close its lookup a bit later.
                threading.Timer(30.0, old.lookup.close).start()
            prune = getattr(self.source, "prune", None)
            if prune:  # downloaded copies of versions nobody can switch back to
                prune(keep={version} | ({old.version} if old else set()))
            return True
        finally:
            self._reload_lock.release()

    def _poll_versions(self) -> None:
        while not self._stopping.is_set():
            try:
                self.check_version_now()
            except Exception as e:  # noqa: BLE001 - the poller must survive a flaky file server
                message = f"cannot read the current version from {self.source.describe}: {e}"
                if message != self.last_reload_error:  # log a lasting outage once, not every poll
                    log.warning(message)
                self.last_reload_error = message
            self._stopping.wait(self.poll_interval)

    # ---- batches --------------------------------------------------------
    def submit(self, job: PendingRequest) -> None:
        with self._cond:
            self._queue.append(job)
            self._cond.notify()

    def _take_jobs(self) -> list[PendingRequest]:
        with self._cond:
            while not self._queue and not self._stopping.is_set():
                self._cond.wait(0.5)
            jobs, n = [], 0
            while self._queue and (not jobs or n + len(self._queue[0].instances) <= self.max_batch_instances):
                job = self._queue.popleft()
                jobs.append(job)
                n += len(job.instances)
            return jobs

    def _batch_worker(self, worker_id: int) -> None:
        while not self._stopping.is_set():
            jobs = self._take_jobs()
            if not jobs:
                continue
            try:
                self._score_jobs(jobs, worker_id)
            except Exception as e:  # noqa: BLE001 - answer every request, whatever happened
                log.exception("batch failed")
                for job in jobs:
                    self._answer(job, Response.error(500, f"internal error: {type(e).__name__}: {e}"))

    def _score_jobs(self, jobs: list[PendingRequest], worker_id: int) -> None:
        model = self.active
        for attempt in range(2):
            if model is None:
                for job in jobs:
                    self._answer(job, self._not_ready())
                return
            try:
                self._score_with(model, jobs, worker_id)
                return
            except CubeUnavailable as e:
                self.metrics.count("cube_errors")
                # The version may have moved on under us (cube dropped ours): switch and retry once.
                if attempt == 0 and (self.active is not model or self.check_version_now()):
                    model = self.active
                    continue
                for job in jobs:
                    self._answer(job, Response.error(503, f"cube unavailable: {e}"))
                return

    def _score_with(self, model: LoadedVersion, jobs: list[PendingRequest], worker_id: int) -> None:
        batches, scored_jobs = [], []
        for job in jobs:
            try:
                batches.append(build_key_batch(job.instances, model.slots, model.sparse_dim))
                scored_jobs.append(job)
            except InstanceError as e:
                self._answer(job, Response.error(400, str(e)))
        jobs[:] = scored_jobs  # a retry must not answer the refused ones twice
        if not scored_jobs:
            return
        merged, offsets = concat_batches(batches)
        unique, inverse = np.unique(merged.keys, return_inverse=True)
        values, _found = model.lookup.lookup(unique, model.version)
        probs = model.dense[worker_id].predict(pool(merged, values[inverse]))
        self.metrics.observe_batch(merged.n)
        for job, b, off in zip(scored_jobs, batches, offsets, strict=True):
            self._answer(
                job,
                Response.json(
                    {
                        "predictions": probs[off : off + b.n].tolist(),
                        "model_version": model.version,
                        "cube_version": model.version,
                    }
                ),
                instances=b.n,
            )
        if self.hooks:
            scored = ScoredBatch([i for j in scored_jobs for i in j.instances], merged, model.version, probs)
            for hook in self.hooks:
                try:
                    hook(scored)
                except Exception:  # noqa: BLE001
                    log.exception("after-response hook %r failed", hook)

    def _answer(self, job: PendingRequest, response: Response, instances: int = 0) -> None:
        self.metrics.observe_request(response.status, time.perf_counter() - job.started, instances)
        self.loop.call_soon_threadsafe(job.deliver, job.slot, response)

    def _not_ready(self) -> Response:
        why = self.last_reload_error or f"waiting for the first active version from {self.source.describe}"
        return Response.error(503, f"no model version is active yet: {why}")

    # ---- HTTP routes (event loop thread) ---------------------------------
    def handle(self, request: Request, slot: Slot, deliver) -> Response | None:
        path, method = request.path, request.method
        if path == "/v1/predict":
            if method != "POST":
                return Response.error(405, "use POST /v1/predict")
            return self._predict(request, slot, deliver)
        if method not in ("GET", "HEAD"):
            return Response.error(405, f"{method} is not allowed on {path}")
        if path == "/healthz":
            return Response.json(
                {
                    "status": "ok",
                    "ready": self.active is not None,
                    "model_version": self.active.version if self.active else None,
                }
            )
        if path == "/readyz":
            return Response.json({"ready": True}) if self.active else self._not_ready()
        if path == "/metrics":
            text = self.metrics.render(self.active.version if self.active else None)
            return Response(200, text.encode(), "text/plain; version=0.0.4")
        if path == "/v1/status":
            return Response.json(self.status())
        return Response.error(404, f"unknown path {path}; try POST /v1/predict")

    def _predict(self, request: Request, slot: Slot, deliver) -> Response | None:
        started = time.perf_counter()
        try:
            body = parse_json(request.body)  # the shared parser: UTF-8, depth and integer-size limits
        except HttpError as e:
            return self._refuse(e.status, e.message, started)
        try:
            instances = instances_of(body)
        except InstanceError as e:
            return self._refuse(e.status, str(e), started)  # 413 for too many instances (docs/contracts.md)
        if self.active is None:
            response = self._not_ready()
            self.metrics.observe_request(503, time.perf_counter() - started)
            return response
        self.submit(PendingRequest(instances, slot, deliver, started))
        return None

    def _refuse(self, status: int, message: str, started: float) -> Response:
        self.metrics.observe_request(status, time.perf_counter() - started)
        return Response.error(status, message)

    def status(self) -> dict:
        a = self.active
        return {
            "model_version": a.version if a else None,
            "cube_version": a.version if a else None,
            "ready": a is not None,
            "source": self.source.describe,
            "slots": list(a.slots) if a else None,
            "embedding_dim": a.dim if a else None,
            "sparse_dim": a.sparse_dim if a else None,
            "loaded_at": a.loaded_at if a else None,
            "last_reload_error": self.last_reload_error,
            "workers": self.workers,
            "metrics": self.metrics.snapshot(),
        }
