"""Serving's core: versions (active and pinned), the A/B split, readiness, lookups, feedback, monitoring.

Frontends (routes.py for HTTP, grpc_frontend.py for gRPC) parse and validate each request, then hand
it to the batcher (batcher.py), which merges concurrent requests and scores them per arm. The control
arm follows the source's active version (cube/current.json); challenger arms are pinned to cube
versions that stay loaded, and pinned in cube (pins.py), until the split ends.

A version switch replaces the whole LoadedVersion: batches already running finish with the old one
(cube keeps the previous version mapped, and its predictors stay until every worker moved on), new
batches take the new one only after every worker has created and probed its predictor, so no
request fails during a switch. A split change is the same: the new split (and any version it adds)
is ready before it takes traffic; a request routed to an arm that no longer exists is scored by the
control arm, and every answer names the arm and versions that actually scored it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass

import numpy as np

from ctr_foundation import names, native_memory
from elastic_control.serving.arms import Arm, Split, SplitError, make_split
from elastic_control.serving.batcher import CHECK_FIRST, DEFAULT_BATCH_DELAY, Batcher, Refusal
from elastic_control.serving.cache import EmbeddingCaches
from elastic_control.serving.feedback import PredictionLog
from elastic_control.serving.instances import PredictRequest
from elastic_control.serving.lookup import CubeUnavailable, Looked, failed_piece
from elastic_control.serving.metrics import ServingMetrics
from elastic_control.serving.monitor import Monitor
from elastic_control.serving.versions import LoadedVersion

log = logging.getLogger("elastic_control.serving")

DEFAULT_PORT = names.SERVING_PORT
DEFAULT_GRPC_PORT = names.SERVING_GRPC_PORT
DEFAULT_MAX_BODY = 8 << 20
DEFAULT_CACHE_ENTRIES = 1 << 20


class SplitConflict(SplitError):
    """A split that cannot take effect now (a challenger's version is not available) -> HTTP 409."""


@dataclass(frozen=True)
class Promotion:
    """A challenger that won: it serves every request until the active version changes."""

    arm: str
    version: str
    active_at_promotion: str | None


class ServingApp:
    def __init__(
        self,
        source,
        *,
        workers: int = 2,
        poll_interval: float = 1.0,
        max_batch_instances: int = 2048,
        reload_wait: float = 10.0,
        cache_entries: int = DEFAULT_CACHE_ENTRIES,
        monitor: Monitor | None = None,
        prediction_log: PredictionLog | None = None,
        token: str | None = None,
        onednn: bool = False,
        probe_interval: float = 1.0,
        pin_wait: float = 60.0,
        batch_delay: float = DEFAULT_BATCH_DELAY,
    ):
        self.source = source
        self.workers = workers
        self.poll_interval = poll_interval
        self.reload_wait = reload_wait
        self.probe_interval = probe_interval
        self.pin_wait = pin_wait  # how long a new challenger may take to be held by every cube shard
        self.token = token
        self.metrics = ServingMetrics()
        self.monitor = monitor or Monitor()
        self.prediction_log = prediction_log or PredictionLog()
        self.cache = EmbeddingCaches(cache_entries) if cache_entries else None
        self.batcher = Batcher(
            self, workers=workers, max_batch_instances=max_batch_instances, onednn=onednn, batch_delay=batch_delay
        )
        self.active: LoadedVersion | None = None
        self.pinned: dict[str, LoadedVersion] = {}  # challengers' versions
        self.split = Split.single()
        self.promotion: Promotion | None = None
        self.last_reload_error: str | None = None
        self.draining = False
        self.frontends: dict[str, object] = {}  # name -> frontend with its address, for status
        self._load_ids = itertools.count(1)
        self._reload_lock = threading.Lock()
        self._split_lock = threading.Lock()
        self._failed_version: tuple[str, float] | None = None
        self._probe: dict[int, tuple[str | None, float]] = {}  # load_id -> (failure reason or None, when)
        self._stopping = threading.Event()
        self._check_soon = threading.Event()  # wakes the reload thread before its poll interval is over
        self._threads: list[threading.Thread] = []
        self._reload_thread: threading.Thread | None = None  # the one thread that switches versions
        self._alerts_in_force: set[tuple] = set()
        self.monitor_hooks: list = []  # fn(summary, alerts) every monitor tick (e.g. MLflow recording)
        self.split_hooks: list = []  # fn(split) once a split with challengers is in force (the MLflow alias)
        self.start_split: Split | None = None  # --split: applied once the first version is active
        self._start_split_error: tuple[str, float] | None = None

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self.batcher.start()
        self._reload_thread = threading.Thread(target=self._poll_versions, name="serving-reload", daemon=True)
        self._threads = [
            self._reload_thread,
            threading.Thread(target=self._probe_loop, name="serving-probe", daemon=True),
            threading.Thread(target=self._monitor_loop, name="serving-monitor", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stopping.set()
        self._check_soon.set()
        self.batcher.stop()
        for t in self._threads:
            t.join(5)

    def begin_drain(self) -> None:
        """Readiness turns false (``draining``); requests already accepted are still answered."""
        self.draining = True

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every accepted request is answered; True if it happened within ``timeout``."""
        deadline = time.monotonic() + timeout
        while self.batcher.inflight > 0:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def add_after_response_hook(self, hook) -> None:
        """Run ``hook(ScoredBatch)`` after every scored batch of the control arm (e.g. shadow scoring)."""
        self.batcher.hooks.append(hook)

    # ---- versions -------------------------------------------------------------------------------
    def _materialise(self, record) -> LoadedVersion:
        loaded = self.source.materialise(record)
        loaded.load_id = next(self._load_ids)
        self.batcher.prepare(loaded)  # every worker's own predictor, created and probed in its thread
        self._probe_now(loaded)  # readiness knows at once whether cube answers for it
        return loaded

    def _probe_now(self, v: LoadedVersion) -> None:
        try:
            reason = v.probe()
        except Exception as e:  # noqa: BLE001 - a probe failure is a reason, not a crash
            reason = f"{type(e).__name__}: {e}"
        self._probe[v.load_id] = (reason, time.monotonic())

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
                pinned = self.pinned.get(version)
                loaded = pinned if pinned is not None else self._materialise(record)
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
            if self.promotion is not None and version != self.promotion.active_at_promotion:
                log.info("active version is now %s: the promotion of %s ends", version, self.promotion.version)
                self.promotion = None
                self._release_unused()
            log.info(
                "serving version %s (was %s), loaded in %.2fs",
                version,
                old.version if old else None,
                time.monotonic() - started,
            )
            if old is not None and not self._in_use(old):
                self._retire(old)
            prune = getattr(self.source, "prune", None)
            if prune:  # downloaded copies of versions nobody can switch back to
                prune(keep={version} | ({old.version} if old else set()) | set(self.pinned))
            return True
        finally:
            self._reload_lock.release()

    def _in_use(self, v: LoadedVersion) -> bool:
        return v is self.active or any(p is v for p in self.pinned.values())

    def _retire(self, old: LoadedVersion) -> None:
        """Drop a version nothing routes to any more: predictors between batches, its lookup a bit later."""
        old.retired = True  # first: nothing creates a cache or a kept predictor for it from here on
        if self.cache is not None:  # at once: /v1/status then shows no cache of a version nothing routes to
            self.cache.drop(old)
        self.batcher.forget(old)
        self._probe.pop(old.load_id, None)
        t = threading.Timer(30.0, self._release_retired, args=(old,))
        t.daemon = True
        t.start()

    @staticmethod
    def _release_retired(old: LoadedVersion) -> None:
        old.release()
        native_memory.give_back_freed_memory()

    def _poll_versions(self) -> None:
        while not self._stopping.is_set():
            self._check_soon.clear()
            try:
                self.check_version_now()
            except Exception as e:  # noqa: BLE001 - the poller must survive a flaky file server
                message = f"cannot read the current version from {self.source.describe}: {e}"
                if message != self.last_reload_error:  # log a lasting outage once, not every poll
                    log.warning(message)
                self.last_reload_error = message
            finally:
                self.batcher.release_held()  # parts that waited for this look at the source (after_cube_failure)
            if self.start_split is not None and self.active is not None:
                self._apply_start_split()
            self._check_soon.wait(self.poll_interval)

    def _apply_start_split(self) -> None:
        last = self._start_split_error
        if last and time.monotonic() - last[1] < 10:
            return
        try:
            self.set_split(self.start_split)
            self.start_split = None
        except SplitError as e:
            if not last or last[0] != str(e):
                log.error("the --split cannot start yet (retrying every 10 s): %s", e)
            self._start_split_error = (str(e), time.monotonic())

    # ---- routing ----------------------------------------------------------------------------------
    def control_arm_name(self) -> str:
        return self.promotion.arm if self.promotion else self.split.control.name

    def resolve(self, request: PredictRequest) -> tuple[str, LoadedVersion | None]:
        """(arm, version) that scores a request, with the split in force now."""
        if self.promotion is not None:
            return self.promotion.arm, self.pinned.get(self.promotion.version)
        split = self.split
        arm = split.pick(request.routing_key, request.arm)
        if arm.version is not None:
            v = self.pinned.get(arm.version)
            if v is not None:
                return arm.name, v
            arm = split.control  # the arm's version went away with a split change: control answers
        return arm.name, self.active

    def after_cube_failure(self, arm: str, version: LoadedVersion, *, held: bool = False):
        """Where a batch whose cube lookup failed may be retried once: (arm, version), None (no retry: 503), or
        CHECK_FIRST: set the part aside until the reload thread has looked for a newer version (``held`` once
        it has). A batch worker never reloads itself: a reload waits for every worker to create its predictor,
        so a worker that reloaded (or waited for the reload lock) stalled every reload for as long as its wait
        (20 s, then 120 s and a failed load, when cube dropped the active version during a reload)."""
        if version is self.active or arm == self.control_arm_name():
            # The version may have moved on under us (cube dropped ours): switch and retry once.
            if self.active is not version:
                return self.control_arm_name(), self.active
            if held or self._reload_thread is None or not self._reload_thread.is_alive():
                return None
            return CHECK_FIRST
        if self.active is not None and self.active is not version:  # a challenger's cube failed: control answers
            return self.split.control.name, self.active
        return None

    def check_soon(self) -> None:
        """Have the reload thread look for a newer version now rather than at its next poll."""
        self._check_soon.set()

    def not_ready(self) -> Refusal:
        why = self.last_reload_error or f"waiting for the first active version from {self.source.describe}"
        return Refusal(503, f"no model version is active yet: {why}")

    # ---- embeddings ---------------------------------------------------------------------------------
    def cached_rows(
        self, version: LoadedVersion, keys: np.ndarray, known: list, sizes: list[int], kb
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows float32 [m, width], found bool [m], have bool [m]) for a batch's keys: from the version's cache,
        then from ``known`` (per part of the batch: (load_id, [(keys sorted, rows, found), ...]) looked up for
        it while it waited, or None); ``have``
        is False where neither holds the key (the batcher looks those up without waiting: ``fetch``)."""
        m = len(keys)
        cache = self.cache.for_version(version) if self.cache is not None else None
        if cache is not None:
            hit, values, found = cache.get(keys)
        else:
            hit, values, found = np.zeros(m, bool), np.zeros((m, version.width), np.float32), np.zeros(m, bool)
        mine = [r for r in known if r is not None and r[0] == version.load_id]
        if cache is not None:  # a retired version's part consulted no cache: no lookups to count
            if mine:  # count each key once: the keys of parts back from a lookup were counted before it
                fresh = np.repeat(np.array([r is None for r in known]), sizes)[kb.rows]
                self.cache.count(int(fresh.sum()), int((hit & fresh).sum()))
            else:
                self.cache.count(m, int(hit.sum()))
        for _, pieces in mine:
            for k, v, f in pieces:
                miss = np.flatnonzero(~hit)
                if not len(miss) or not len(k):
                    continue
                at = np.minimum(np.searchsorted(k, keys[miss]), len(k) - 1)
                ok = k[at] == keys[miss]
                sel, at = miss[ok], at[ok]
                values[sel], found[sel], hit[sel] = v[at], f[at], True
        return values, found, hit

    def fetch(self, version: LoadedVersion, keys: np.ndarray, done) -> None:
        """Look ``keys`` (unique, sorted) up in cube for ``version`` without waiting: ``done(Looked)`` per piece
        (a shard's keys, lookup.py) on whichever thread has it, as soon as it is in; what was found is
        remembered in the cache first."""

        def piece(looked: Looked):
            if looked.error is None and looked.values.shape[1] != version.width:
                looked = failed_piece(
                    looked.idx,
                    CubeUnavailable(
                        f"cube answered rows of {looked.values.shape[1]} floats for version {version.version}, "
                        f"expected {version.width}"
                    ),
                )
            if looked.error is None and self.cache is not None and len(looked.idx):
                cache = self.cache.for_version(version)
                if cache is not None:
                    cache.put(keys[looked.idx], looked.values, looked.found)
            done(looked)

        version.lookup.start(keys, version.version, piece)

    # ---- A/B split ------------------------------------------------------------------------------------
    def set_split(self, split: Split) -> Split:
        """Make ``split`` the one in force: its challengers' versions loaded, pinned and probed first."""
        with self._split_lock:
            if self.active is None:
                raise SplitConflict("no active version yet: a split can start once serving answers")
            wanted = {a.version for a in split.challengers}
            if self.active.version in wanted:
                raise SplitError(f"version {self.active.version} is the active version: the control arm serves it")
            loaded: dict[str, LoadedVersion] = {}
            self._write_pins(set(self.pinned) | wanted)  # pin before loading, so nothing removes it meanwhile
            try:
                for v in sorted(wanted - set(self.pinned)):
                    loaded[v] = self._load_pinned(v)
            except Exception:
                self._write_pins(set(self.pinned))
                for lv in loaded.values():
                    self._retire(lv)
                raise
            new_pinned = {v: self.pinned.get(v) or loaded[v] for v in wanted}
            old = self.pinned
            generation = self.split.generation + 1
            split = Split(split.arms, generation)
            self.pinned, self.split, self.promotion = new_pinned, split, None
            self._release(old)
            self._write_pins(set(self.pinned))
            log.info(
                "A/B split %d: %s",
                generation,
                ", ".join(f"{a.name}={a.version or 'active'}:{a.weight:g}" for a in split.arms),
            )
        for hook in self.split_hooks if split.challengers else ():
            try:
                hook(split)
            except Exception:  # noqa: BLE001 - bookkeeping never undoes a split in force
                log.exception("a split hook failed")
        return split

    def end_split(self, winner: str | None = None) -> dict:
        """End the split in one call: drop every challenger, or promote ``winner`` (an arm name)."""
        with self._split_lock:
            split = self.split
            if winner is None or winner == split.control.name:
                single = make_split([Arm(split.control.name, 1.0, None)])
                self.split, self.promotion = Split(single.arms, split.generation + 1), None
                old, self.pinned = self.pinned, {}
                self._release(old)
                self._write_pins(set())
                log.info("A/B split ended: %s serves everything (%s)", split.control.name, self.active_version)
                return {"ended": True, "serving": split.control.name, "version": self.active_version}
            arm = split.arm(winner)
            if arm is None:
                raise SplitError(f"no arm named {winner!r}; arms: {[a.name for a in split.arms]}")
            keep = self.pinned[arm.version]
            self.promotion = Promotion(arm.name, arm.version, self.active_version)
            self.split = Split((Arm(split.control.name, 1.0, None),), split.generation + 1)
            old, self.pinned = self.pinned, {arm.version: keep}
            self._release(old)
            self._write_pins({arm.version}, reason="promoted A/B arm")
            log.info(
                "A/B split ended: arm %s (%s) promoted: it serves everything until the active version changes",
                arm.name,
                arm.version,
            )
            return {
                "ended": True,
                "serving": arm.name,
                "version": arm.version,
                "promoted_until": "the active version changes (cube-transfer rolls out a newer pass)",
            }

    def _load_pinned(self, version: str) -> LoadedVersion:
        try:
            record = self.source.record_for(version)
        except Exception as e:  # noqa: BLE001 - any reason means the same: the version is not available
            raise SplitConflict(f"version {version} cannot be an arm: {e}") from e
        try:
            loaded = self.source.materialise(record)
        except Exception as e:  # noqa: BLE001
            raise SplitConflict(f"version {version} failed to load: {e}") from e
        loaded.load_id = next(self._load_ids)
        # The pin is written: cube-transfer loads the version on every shard (pinned) at its next poll.
        deadline = time.monotonic() + self.pin_wait
        while (reason := loaded.probe()) is not None and time.monotonic() < deadline:
            time.sleep(0.5)
        if reason is not None:
            loaded.release()
            raise SplitConflict(
                f"cube does not answer for version {version} on every shard after {self.pin_wait:.0f}s ({reason}); "
                "cube-transfer loads the versions of cube/pins.json on every shard (docs/contracts.md)"
            )
        self._probe[loaded.load_id] = (None, time.monotonic())
        self.batcher.prepare(loaded)
        return loaded

    def _release(self, old: dict[str, LoadedVersion]) -> None:
        for v in old.values():
            if not self._in_use(v):
                self._retire(v)

    def _release_unused(self) -> None:
        keep = {a.version for a in self.split.challengers}
        old = {v: lv for v, lv in self.pinned.items() if v not in keep}
        self.pinned = {v: lv for v, lv in self.pinned.items() if v in keep}
        self._release(old)
        self._write_pins(set(self.pinned), quiet=True)

    def _write_pins(self, versions: set[str], reason: str = "A/B challenger arm", quiet: bool = False) -> None:
        pins = getattr(self.source, "pins", None)
        if pins is None:
            return
        try:
            pins.set_serving_pins((v, reason) for v in versions)
        except Exception as e:  # noqa: BLE001
            if quiet:
                log.warning("%s", e)
                return
            raise SplitConflict(str(e)) from e

    @property
    def active_version(self) -> str | None:
        return self.active.version if self.active else None

    def arms(self) -> list[dict]:
        """Every arm in force with its weight and the version pair it answers with."""
        if self.promotion is not None:
            return [
                {
                    "name": self.promotion.arm,
                    "weight": 1.0,
                    "model_version": self.promotion.version,
                    "cube_version": self.promotion.version,
                    "pinned": True,
                    "promoted": True,
                }
            ]
        weights = self.split.weights()
        out = []
        for a in self.split.arms:
            v = self.active if a.version is None else self.pinned.get(a.version)
            out.append(
                {
                    "name": a.name,
                    "weight": weights[a.name],
                    "model_version": v.version if v else None,
                    "cube_version": v.version if v else None,
                    "pinned": a.version is not None,
                }
            )
        return out

    # ---- readiness ----------------------------------------------------------------------------------
    def _probe_loop(self) -> None:
        while not self._stopping.is_set():
            for v in [self.active, *self.pinned.values()]:
                if v is not None:
                    self._probe_now(v)
            self._stopping.wait(self.probe_interval)

    def readiness(self) -> tuple[bool, str]:
        """(ready, reason): a model is loaded AND its cube shards answered a probe lookup of it lately."""
        if self.draining:
            return False, "draining: serving is shutting down"
        a = self.active
        if a is None:
            return False, self.not_ready().message
        reason, when = self._probe.get(a.load_id, ("not probed yet", 0.0))
        if reason is not None:
            return False, f"version {a.version} loaded but cube does not answer for it: {reason}"
        if time.monotonic() - when > max(15.0, 5 * self.probe_interval):  # the probe itself hangs
            return False, f"version {a.version}: the last cube probe is {time.monotonic() - when:.0f}s old"
        return True, f"serving {a.version}"

    # ---- feedback and monitoring ------------------------------------------------------------------
    def feedback(self, events) -> dict:
        result = self.prediction_log.join(events, self.monitor.observe_feedback)
        return result.to_json()

    def monitor_document(self) -> dict:
        summary = self.monitor.summary()
        alerts = self.monitor.alerts(summary)
        weights = {a["name"]: a["weight"] for a in self.arms()}
        for s in summary:
            s["weight"] = weights.get(s["arm"], 0.0) if self._serves(s["arm"], s["version"]) else 0.0
        r = self.monitor.rules
        return {
            "window_seconds": self.monitor.window_s,
            "arms": self.arms(),
            "series": summary,
            "alerts": alerts,
            "rules": {
                "calibration_band": [r.calibration_low, r.calibration_high],
                "coverage_floor": r.coverage_floor,
                "min_feedback": r.min_feedback,
                "min_keys": r.min_keys,
            },
            "feedback": self.prediction_log.snapshot(),
            "cache": self.cache.snapshot() if self.cache else None,
        }

    def _serves(self, arm: str, version: str) -> bool:
        return any(a["name"] == arm and a["model_version"] == version for a in self.arms())

    def _monitor_loop(self) -> None:
        while not self._stopping.wait(5.0):
            try:
                summary = self.monitor.summary()
                alerts = self.monitor.alerts(summary)
                self._log_alert_changes(alerts)
                for hook in self.monitor_hooks:
                    hook(summary, alerts)
            except Exception:  # noqa: BLE001 - monitoring must never take serving down
                log.exception("monitor tick failed")

    def _log_alert_changes(self, alerts: list[dict]) -> None:
        now = {(a["kind"], a["arm"], a["version"], a.get("slot")): a for a in alerts}
        for key in now.keys() - self._alerts_in_force:
            log.warning("ALERT %s", now[key]["message"])
        for key in self._alerts_in_force - now.keys():
            kind, arm, version, slot = key
            log.info("alert cleared: %s arm %s (%s)%s", kind, arm, version, f" slot {slot}" if slot else "")
        self._alerts_in_force = set(now)

    def status(self) -> dict:
        a = self.active
        ready, reason = self.readiness()
        return {
            "model_version": a.version if a else None,
            "cube_version": a.version if a else None,
            "ready": ready,
            "ready_reason": reason,
            "draining": self.draining,
            "source": self.source.describe,
            "slots": list(a.slots) if a else None,
            "embedding_dim": a.width if a else None,
            "sparse_dim": a.sparse_dim if a else None,
            "dense_slots": list(a.dense_slots) if a else None,
            "loaded_at": a.loaded_at if a else None,
            "last_reload_error": self.last_reload_error,
            "workers": self.workers,
            "split": self.split.to_json(),
            "arms": self.arms(),
            "promotion": self.promotion.__dict__ if self.promotion else None,
            "frontends": {k: getattr(f, "address", None) for k, f in self.frontends.items()},
            "cache": self.cache.snapshot() if self.cache else None,
            "metrics": self.metrics.snapshot(),
        }
