"""One cube-server worker: routes, merged lookups, and the control calls that switch versions.

Lookups that arrive in the same event-loop turn (from any connection) are
merged: their keys are concatenated and looked up in ONE vectorised pass per
version, then split back. At 26 keys per request this turns ~100 us of
per-request Python into a shared cost; it never mixes versions, because every
request is bound to one ShardIndex object when it is parsed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path
from time import perf_counter

import numpy as np

from ctr_foundation.errors import ElasticControlError, UsageError
from ctr_foundation.http_messages import HttpError, Request, Response, Slot, media_type, parse_json, parse_json_object
from ctr_foundation.http_protocol import Route
from ctr_foundation.http_server import HttpLimits, HttpServer
from cube.lookup_protocol import LookupProtocol
from cube.server_metrics import ServerMetrics
from cube.shard_format import shard_file_name, valid_version_name
from cube.version_store import ControlState, StateFile, VersionSet, load_index, stamp_of

log = logging.getLogger("cube.server")
WATCH_INTERVAL = 0.02  # seconds between state-file checks
METRICS_INTERVAL = 1.0
ACK_TIMEOUT = 60.0
VERSION_HEADER = "X-Cube-Version"
CONTROL_ENDPOINTS = ("/v1/load", "/v1/activate", "/v1/unpin")
CONTROL_MAX_BODY = 64 << 10  # {"version", "path", "pin"}: a control call body is small
# Serving keeps a pool of connections per shard; 1,000 idle clients must not lock anyone out.
LIMITS = HttpLimits(max_connections=4096)


class CubeWorker:
    def __init__(
        self,
        *,
        data_dir: Path,
        state_dir: Path,
        shard: int,
        worker: int,
        workers: int,
        token: str | None,
        max_batch: int,
    ):
        self.data_dir = Path(data_dir)
        self.store = StateFile(state_dir)
        self.shard, self.worker, self.workers = shard, worker, workers
        self.token = token
        self.max_batch = max_batch
        self.metrics = ServerMetrics()
        self.versions = VersionSet(ControlState(shard=shard, workers=workers), {})
        self._pending: list = []  # (index, body, slot, deliver, t0) waiting for the next merged pass
        self._flush_scheduled = False
        self._head_prefixes: dict[tuple[str, int], tuple[bytes, bytes]] = {}
        self._max_body_bytes = max_batch * 8
        self.max_body = max_batch * 8 + 1024  # framing limit of a lookup body (413 and close above)
        self._lookup_route = Route(self.handle, max_body=self.max_body)
        self._control_route = Route(self.handle, token=True, max_body=CONTROL_MAX_BODY)
        self._other_route = Route(self.handle)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.connections = 0  # open connections of this worker (LookupProtocol counts them)
        self._control_lock = asyncio.Lock()
        self._stamp: tuple = ()
        self._last_error: str | None = None
        self._apply_lock = threading.Lock()  # the watcher and a control call may both apply
        self._preloaded: dict = {}  # version -> ((path, stamp), index) validated by a control call
        self.last_load: dict = {}  # the last load this worker took: how long reading and committing took
        self.started = time.time()

    # ---- state ---------------------------------------------------------------------------

    def apply_state_file(self) -> None:
        """Load what the state file says (blocking); remember the error instead of dying."""
        with self._apply_lock:
            self._apply_state_file()

    def _apply_state_file(self) -> None:
        stamp = self.store.stamp()
        try:
            state = self.store.read()
        except ElasticControlError as e:
            self._last_error = str(e)
            return
        if state is None:
            return
        preloaded, self._preloaded = self._preloaded, {}
        self.versions = self.versions.materialise(state, self.data_dir, preloaded)
        errors = self.versions.errors
        self._last_error = "; ".join(f"{v}: {e}" for v, e in sorted(errors.items())) or None
        self._stamp = stamp
        self.store.write_ack(
            self.worker,
            {
                "generation": state.generation,
                "pid": os.getpid(),
                "active": self.active_version,
                "errors": errors,
            },
        )

    @property
    def active_version(self) -> str | None:
        """The active version this worker really holds (None if it is not loaded)."""
        return self.versions.state.active if self.versions.active is not None else None

    async def watch_state(self) -> None:
        loop = asyncio.get_running_loop()
        last_metrics, written = 0.0, None
        while True:
            await asyncio.sleep(WATCH_INTERVAL)
            if self.store.stamp() != self._stamp:
                # Loading maps and faults in pages: do it off the event loop so lookups go on.
                await loop.run_in_executor(None, self.apply_state_file)
            now = time.monotonic()
            if now - last_metrics >= METRICS_INTERVAL:
                last_metrics = now
                counters = self.metrics.to_json()
                if counters != written:  # an idle worker writes nothing
                    # The write fsyncs: off the event loop, so that a slow disk never stalls lookups.
                    await loop.run_in_executor(None, self.metrics.write_snapshot, self.store.dir, self.worker, counters)
                    written = counters

    async def _commit(self, change, *, must_load: str | None = None) -> ControlState:
        """Apply ``change(current) -> next`` to the state file and wait until every worker has it.

        With ``must_load``, a worker that could not load that version fails the call, and the
        version is taken out of the state again (so no worker is left holding it alone).
        """
        loop = asyncio.get_running_loop()
        async with self._control_lock:

            def write(fn):
                with self.store.locked():
                    current = self.store.read() or ControlState(shard=self.shard, workers=self.workers)
                    nxt = fn(current)
                    self.store.write(nxt)
                    return nxt

            nxt = await loop.run_in_executor(None, write, change)
            acks = await self._wait_acks(nxt.generation)
            failed = [f"worker {k}: {a['errors'][must_load]}" for k, a in acks.items() if must_load in a["errors"]]
            if failed:
                await loop.run_in_executor(None, write, lambda cur: cur.without(must_load))
                raise UsageError("; ".join(failed))
            return nxt

    async def _wait_acks(self, generation: int) -> dict[int, dict]:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.apply_state_file)
        deadline = time.monotonic() + ACK_TIMEOUT
        while True:
            acks = self.store.read_acks(self.workers)
            if len(acks) == self.workers and all(a.get("generation", 0) >= generation for a in acks.values()):
                return acks
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers did not apply generation {generation} within {ACK_TIMEOUT}s")
            await asyncio.sleep(WATCH_INTERVAL / 2)

    # ---- HTTP ----------------------------------------------------------------------------

    def route(self, req: Request) -> Route:
        """Decided from the head: lookups take big bodies, control calls need the token (checked before the body)."""
        if req.method == "POST":
            if req.path == "/v1/lookup":
                return self._lookup_route
            if req.path in CONTROL_ENDPOINTS:
                return self._control_route
        return self._other_route

    def handle(self, req: Request, slot: Slot, deliver) -> Response | None:
        path = req.path
        if path == "/v1/lookup" and req.method == "POST":
            return self.lookup(req, slot, deliver)
        if req.method == "GET":
            if path == "/healthz":  # liveness: the process answers (readiness is /readyz)
                return self._count("healthz", Response.json({"status": "ok", "active": self.active_version}))
            if path == "/readyz":
                return self._count("readyz", self.readiness())
            if path == "/v1/status":
                return self._count("status", Response.json(self.status()))
            if path == "/metrics":
                text = self.metrics.render(
                    self.store.dir, self.worker, self.workers, shard=self.shard, active=self.active_version
                )
                return self._count("metrics", Response(200, text.encode(), "text/plain; version=0.0.4"))
        if req.method == "POST" and path in CONTROL_ENDPOINTS:  # the token was checked by the protocol
            asyncio.get_running_loop().create_task(self._control(req, slot, deliver))
            return None
        known = {"/v1/lookup", "/healthz", "/readyz", "/v1/status", "/metrics", *CONTROL_ENDPOINTS}
        if path in known:
            return self._count("other", Response.error(405, f"{req.method} is not allowed on {path}"))
        return self._count("other", Response.error(404, f"no such endpoint {path}; see cube/README.md"))

    def readiness(self) -> Response:
        """200 only when this server can answer un-pinned lookups: an active version is loaded."""
        if self.versions.active is not None:
            return Response.json({"ready": True, "active": self.active_version})
        wanted = self.versions.state.active
        reason = "no active version loaded yet"
        if wanted:
            reason = f"active version {wanted!r} could not be loaded: {self.versions.errors.get(wanted, 'loading')}"
        return Response.json({"ready": False, "reason": reason}, status=503)

    def _count(self, endpoint: str, response: Response) -> Response:
        self.metrics.count_request(endpoint, response.status)
        return response

    def status(self) -> dict:
        """What this worker really holds: a role is named only when its version is loaded."""
        vs = self.versions
        loaded = vs.indexes

        def have(v):
            return v if v in loaded else None

        return {
            "shard": self.shard,
            "worker": self.worker,
            "workers": self.workers,
            "pid": os.getpid(),
            "ready": vs.active is not None,
            **{r: have(getattr(vs.state, r)) for r in ("active", "prepared", "previous")},
            "pinned": [v for v in vs.state.pinned if v in loaded],
            "generation": vs.state.generation,
            "error": self._last_error,
            "dropped": {**vs.state.dropped, **vs.errors},
            "versions": {
                v: {
                    "role": vs.role(v),
                    "rows": i.rows,
                    "dim": i.dim,
                    "kind": i.shard.kind,
                    "parent": i.shard.parent,
                    "path": vs.state.paths.get(v),
                }
                for v, i in sorted(loaded.items())
            },
            "last_load": self.last_load,
            "uptime_seconds": round(time.time() - self.started, 3),
        }

    @staticmethod
    def _control_body(req: Request) -> dict:
        """The JSON object of a control call, checked; HttpError 400 naming what is wrong."""
        body = parse_json_object(req.body, max_bytes=CONTROL_MAX_BODY)
        if not valid_version_name(body.get("version")):
            raise HttpError(400, "body must have a 'version': a non-empty name of letters, digits, '-', '_' and '.'")
        rel = body.get("path")
        if rel is not None and (not isinstance(rel, str) or not rel or "\x00" in rel):
            raise HttpError(400, "'path' must be a non-empty string (no NUL) relative to --data")
        if not isinstance(body.get("pin", False), bool):
            raise HttpError(400, "'pin' must be true or false")
        return body

    def _validate_load(self, version: str, rel: str) -> str:
        """Load (and keep) ``version`` from ``rel`` unless this worker already holds that very file; its stamp."""
        stamp = stamp_of(self.data_dir, rel)
        vs = self.versions
        if version in vs.indexes and vs.state.paths.get(version) == rel and vs.stamps.get(version, "") == stamp:
            return stamp  # the same file, verified when it was loaded: nothing to read again
        have = {v: i.shard for v, i in vs.indexes.items() if v != version}
        index = load_index(self.data_dir, rel, version=version, shard=self.shard, have=have)
        self._preloaded[version] = ((rel, stamp), index)
        return stamp

    async def _control(self, req: Request, slot: Slot, deliver) -> None:
        endpoint = req.path.rsplit("/", 1)[1]
        loop = asyncio.get_running_loop()
        try:
            body = self._control_body(req)
            version = body["version"]
            if endpoint == "load":
                rel = body.get("path") or f"{version}/{shard_file_name(self.shard)}"
                pin = body.get("pin", False)
                # Validate here first, so a corrupt file is refused before any worker is told about it.
                t0 = perf_counter()
                stamp = await loop.run_in_executor(None, self._validate_load, version, rel)
                t1 = perf_counter()
                await self._commit(lambda cur: cur.with_prepared(version, rel, stamp, pin=pin), must_load=version)
                self.last_load = {
                    "version": version,
                    "read_s": round(t1 - t0, 3),
                    "commit_s": round(perf_counter() - t1, 3),
                    "at": time.time(),
                }
            elif endpoint == "activate":
                await self._commit(lambda cur: cur.with_active(version))
            else:
                await self._commit(lambda cur: self._unpinned(cur, version))
            response = Response.json(self.status())
        except HttpError as e:
            response = e.response()
        except ElasticControlError as e:
            response = Response.error(422 if endpoint == "load" else 409, str(e))
        except TimeoutError as e:
            response = Response.error(504, str(e))
        except Exception as e:  # noqa: BLE001 - a control call is always answered, never left hanging
            log.exception("%s failed", req.path)
            response = Response.error(500, f"internal error: {type(e).__name__}: {e}")
        finally:
            self._preloaded.clear()
        deliver(slot, self._count(endpoint, response))

    @staticmethod
    def _unpinned(cur: ControlState, version: str) -> ControlState:
        if version not in cur.pinned:
            raise UsageError(f"version {version!r} is not pinned (pinned: {cur.pinned or 'none'})")
        return cur.without(version)

    # ---- lookups -------------------------------------------------------------------------

    def lookup(self, req: Request, slot: Slot, deliver) -> Response | None:
        """A lookup that came through the generic parser (JSON, or a head the fast path passed on)."""
        version = req.query.get("version") or None
        index = self.versions.get(version)
        if index is None:
            return self._count("lookup", self._no_index(version))
        if media_type(req.headers) == "application/json":
            return self._count("lookup", self._lookup_json(req, index))
        bad = self._check_body(req.body)
        if bad is not None:
            return self._count("lookup", bad)
        self._queue(index, req.body, slot, deliver)
        return None

    def fast_lookup(self, proto, version: str | None, body: bytes, keep_alive: bool) -> None:
        """A binary lookup from LookupProtocol's fast path: bind it to a version and queue it."""
        slot = proto.new_slot(keep_alive)
        versions = self.versions
        index = versions.active if version is None else versions.indexes.get(version)
        if index is None:
            proto._deliver(slot, self._count("lookup", self._no_index(version)))
            return
        if len(body) & 7 or len(body) > self._max_body_bytes:
            proto._deliver(slot, self._count("lookup", self._check_body(body)))
            return
        self._queue(index, body, slot, proto._deliver)

    def lookup_now(self, version: str | None, body: bytes) -> bytes | None:
        """The whole keep-alive answer to a lookup that is alone (LookupProtocol's direct path), or None
        when it is not a plain success (no such version, a bad body, a failure): the caller then sends it
        the ordinary way, which answers the error (and counts it)."""
        t0 = perf_counter()
        versions = self.versions
        index = versions.active if version is None else versions.indexes.get(version)
        if index is None or len(body) & 7 or len(body) > self._max_body_bytes or self._pending:
            return None
        try:
            return self._answer_one(index, body, True, t0)
        except Exception:  # noqa: BLE001 - the ordinary path tries again and answers 500 if it fails again
            log.exception("direct lookup failed")
            return None

    def _answer_one(self, index, body: bytes, keep_alive: bool, t0: float) -> bytes:
        """The encoded answer to one lookup (head, rows, found-bitmap), counted in the metrics."""
        answer, misses = index.lookup_body(np.frombuffer(body, dtype="<u8"))  # rows, then the found-bitmap
        prefixes = self._head_prefixes.get((index.version, index.dim)) or self._head_prefixes_for(index)
        head = prefixes[keep_alive] + b"%d\r\nX-Cube-Misses: %d\r\n\r\n" % (len(answer), misses)
        self.metrics.observe_one(len(body) >> 3, misses, perf_counter() - t0)
        return b"".join((head, answer))

    def _no_index(self, version: str | None) -> Response:
        if version is None:
            return Response.error(503, "no active version yet")
        return Response.error(404, f"unknown version {version!r}; held: {sorted(self.versions.indexes)}")

    def _check_body(self, body: bytes) -> Response | None:
        if len(body) % 8:
            return Response.error(
                400, f"body length {len(body)} is not a multiple of 8 (expected little-endian uint64 keys)"
            )
        if len(body) > self._max_body_bytes:
            return Response.error(413, f"{len(body) // 8} keys exceed the batch limit {self.max_batch}")
        return None

    def _queue(self, index, body: bytes, slot: Slot, deliver) -> None:
        """Queue a checked lookup; every lookup queued before the loop gets back to it shares one pass."""
        self._pending.append((index, body, slot, deliver, perf_counter()))
        if not self._flush_scheduled and self.connections > 1:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def end_of_chunk(self) -> None:
        """A connection has parsed all it received. With one connection there is nothing to wait
        for (no other connection can add keys this turn): answer its requests, pipelined ones merged,
        at once instead of a loop turn later."""
        if self._pending and not self._flush_scheduled:
            self._flush()

    def _flush(self) -> None:
        pending, self._pending, self._flush_scheduled = self._pending, [], False
        if len(pending) == 1 or all(it[0] is pending[0][0] for it in pending):
            groups = [pending]
        else:  # requests pinned to different versions: one pass per version, never mixed
            by_index: dict[int, list] = {}
            for item in pending:
                by_index.setdefault(id(item[0]), []).append(item)
            groups = list(by_index.values())
        for items in groups:
            try:
                self._answer_group(items)
            except Exception as e:  # noqa: BLE001 - never leave a request unanswered
                for _, _, slot, deliver, _ in items:
                    if slot.response is None:
                        deliver(slot, self._count("lookup", Response.error(500, f"lookup failed: {e}")))

    def _answer_group(self, items: list) -> None:
        """One vectorised lookup for every request in ``items`` (all bound to one version), then answer each."""
        index = items[0][0]
        if len(items) == 1:
            _, body, slot, deliver, t0 = items[0]
            deliver(slot, self._answer_one(index, body, slot.keep_alive, t0))
            return
        keys = np.frombuffer(b"".join([it[1] for it in items]), dtype="<u8")
        rows, found = index.lookup_rows(keys)
        rows = memoryview(rows.reshape(-1))  # flat bytes: slices below are byte ranges, not rows
        rb = index.row_bytes
        total = len(keys)
        prefixes = self._head_prefixes.get((index.version, index.dim)) or self._head_prefixes_for(index)
        bitmaps = _split_bitmaps(found, [len(it[1]) >> 3 for it in items])
        hits_upto = np.cumsum(found).tolist()
        start = 0
        all_hits = 0
        for (_, body, slot, deliver, _), bitmap in zip(items, bitmaps, strict=True):
            n = len(body) >> 3
            end = start + n
            hits = (hits_upto[end - 1] if end else 0) - (hits_upto[start - 1] if start else 0)
            all_hits += hits
            head = prefixes[slot.keep_alive] + b"%d\r\nX-Cube-Misses: %d\r\n\r\n" % (n * rb + len(bitmap), n - hits)
            deliver(slot, b"".join((head, rows[start * rb : end * rb], bitmap)))
            start = end
        now = perf_counter()
        self.metrics.observe_lookups(len(items), total, total - all_hits, [now - it[4] for it in items])

    def _head_prefixes_for(self, index) -> tuple[bytes, bytes]:
        """Response head up to the Content-Length value, for (close, keep-alive), cached per version."""
        if len(self._head_prefixes) > 16:
            self._head_prefixes.clear()
        common = (
            f"Content-Type: application/octet-stream\r\n{VERSION_HEADER}: {index.version}\r\n"
            f"X-Cube-Dim: {index.dim}\r\nContent-Length: "
        ).encode("latin-1")
        prefixes = (
            b"HTTP/1.1 200 OK\r\nConnection: close\r\n" + common,
            b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\n" + common,
        )
        self._head_prefixes[(index.version, index.dim)] = prefixes
        return prefixes

    def _lookup_json(self, req: Request, index) -> Response:
        """The JSON debugging variant: keys are JSON integers in [0, 2**64) or their decimal strings; nothing
        else is coerced (-1 is not 2**64-1, 1.9 is not 1, true is not 1, "123" is not the keys [1, 2, 3])."""
        try:
            keys = np.array(_json_keys(parse_json(req.body or b"{}")), dtype=np.uint64)
        except HttpError as e:
            return e.response()
        if len(keys) > self.max_batch:
            return Response.error(413, f"{len(keys)} keys exceed the batch limit {self.max_batch}")
        values, found = index.lookup(keys)
        self.metrics.observe_lookup(len(keys), int(len(keys) - found.sum()), None)
        return Response.json(
            {
                "version": index.version,
                "dim": index.dim,
                "keys": [str(int(k)) for k in keys],
                "found": found.tolist(),
                "values": values.tolist(),
            },
            headers={VERSION_HEADER: index.version},
        )

    # ---- serving -------------------------------------------------------------------------

    async def serve(self, sock: socket.socket, max_body: int) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self.max_body = max_body
        self._max_body_bytes = min(max_body, self.max_batch * 8)
        self._lookup_route = Route(self.handle, max_body=max_body)
        server = HttpServer(
            self,
            sock=sock,
            token=self.token,
            name=f"cube-server shard {self.shard}",
            limits=LIMITS,
            protocol_factory=lambda srv: LookupProtocol(srv, self),
            backlog=2048,
        )
        # SIGTERM stops the server from inside the loop: a plain signal.signal handler may not run while
        # uvloop waits in C, which left workers running until they were killed.
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signal.SIGTERM, server.shutdown)
        watcher = loop.create_task(self.watch_state())
        try:
            await server.serve()
        finally:
            watcher.cancel()


def _json_keys(body) -> list[int]:
    """The keys of a JSON lookup body: integers 0 <= k < 2^64 or their decimal strings, nothing coerced.

    (-1 is not 2^64-1, 1.9 is not 1, true is not 1, and "123" is not the keys [1, 2, 3].)
    """
    keys = body.get("keys") if isinstance(body, dict) else None
    if not isinstance(keys, list):
        raise HttpError(400, 'JSON lookup body must be {"keys": [uint64 or decimal string, ...]}')
    out = []
    for i, k in enumerate(keys):
        if isinstance(k, str) and 0 < len(k) <= 20 and k.isascii() and k.isdigit():
            k = int(k)
        if type(k) is not int or not 0 <= k < 1 << 64:
            raise HttpError(400, f"keys[{i}] = {k!r}: a key is an unsigned 64-bit integer (or its decimal string)")
        out.append(k)
    return out


def _split_bitmaps(found: np.ndarray, sizes: list[int]) -> list[bytes]:
    """Each request's found-bitmap (its own bit 0 first) from the merged ``found``.

    Few requests: one packbits each. Many: spread the flags so every request
    starts on a byte boundary, pack once, and slice the bytes.
    """
    if len(sizes) <= 3:
        out, start = [], 0
        for n in sizes:
            out.append(np.packbits(found[start : start + n], bitorder="little").tobytes())
            start += n
        return out
    padded = [(n + 7) & ~7 for n in sizes]
    if padded == sizes:
        packed = np.packbits(found, bitorder="little").tobytes()
    else:
        starts = np.cumsum([0] + sizes[:-1])
        pad_starts = np.cumsum([0] + padded[:-1])
        spread = np.zeros(sum(padded), bool)
        spread[np.arange(len(found)) + np.repeat(pad_starts - starts, sizes)] = found
        packed = np.packbits(spread, bitorder="little").tobytes()
    out, at = [], 0
    for n, p in zip(sizes, padded, strict=True):
        out.append(packed[at : at + ((n + 7) >> 3)])
        at += p >> 3
    return out
