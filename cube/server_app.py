"""One cube-server worker: routes, merged lookups, and the control calls that switch versions.

Lookups that arrive in the same event-loop turn (from any connection) are
merged: their keys are concatenated and looked up in ONE vectorised pass per
version, then split back. At 26 keys per request this turns ~100 us of
per-request Python into a shared cost; it never mixes versions, because every
request is bound to one ShardIndex object when it is parsed.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import socket
import threading
import time
from pathlib import Path
from time import perf_counter

import numpy as np

from ctr_foundation.errors import ElasticControlError, UsageError
from ctr_foundation.http_protocol import Request, Response, Slot
from cube.lookup_protocol import LookupProtocol
from cube.server_metrics import ServerMetrics
from cube.shard_format import shard_file_name, valid_version_name
from cube.version_store import ControlState, StateFile, VersionSet, load_index, stamp_of

WATCH_INTERVAL = 0.02  # seconds between state-file checks
METRICS_INTERVAL = 1.0
ACK_TIMEOUT = 60.0
VERSION_HEADER = "X-Cube-Version"
MAX_KEY = 2**64
CONTROL_ENDPOINTS = ("/v1/load", "/v1/activate", "/v1/unpin")


class BadRequest(UsageError):
    """A control call whose body is not what the endpoint takes (400)."""


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
        last_metrics = 0.0
        while True:
            await asyncio.sleep(WATCH_INTERVAL)
            if self.store.stamp() != self._stamp:
                # Loading maps and faults in pages: do it off the event loop so lookups go on.
                await loop.run_in_executor(None, self.apply_state_file)
            now = time.monotonic()
            if now - last_metrics >= METRICS_INTERVAL:
                last_metrics = now
                self.metrics.snapshot(self.store.dir, self.worker)

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
        if req.method == "POST" and path in CONTROL_ENDPOINTS:
            denied = self._check_token(req)
            if denied:
                return self._count(path.rsplit("/", 1)[1], denied)
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

    def _check_token(self, req: Request) -> Response | None:
        if not self.token:
            return Response.error(403, "control calls are disabled: the server has no ELASTIC_CTR_TOKEN")
        got = req.headers.get("authorization", "")
        if not got.startswith("Bearer ") or not hmac.compare_digest(got[7:].encode(), self.token.encode()):
            return Response.error(401, "missing or wrong bearer token (Authorization: Bearer $ELASTIC_CTR_TOKEN)")
        return None

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
        try:
            body = json.loads(req.body) if req.body else {}
        except (ValueError, RecursionError) as e:  # invalid UTF-8 and bad JSON are ValueErrors
            raise BadRequest(f"body must be a JSON object: {str(e)[:200]}") from None
        if not isinstance(body, dict):
            raise BadRequest("body must be a JSON object")
        version = body.get("version")
        if not valid_version_name(version):
            raise BadRequest("body must have a 'version': a non-empty name of letters, digits, '-', '_' and '.'")
        if "path" in body and not (isinstance(body["path"], str) and body["path"] and "\x00" not in body["path"]):
            raise BadRequest("'path' must be a non-empty string (relative to the server's data folder)")
        if not isinstance(body.get("pin", False), bool):
            raise BadRequest("'pin' must be true or false")
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
        except BadRequest as e:
            response = Response.error(400, str(e))
        except ElasticControlError as e:
            response = Response.error(422 if endpoint == "load" else 409, str(e))
        except TimeoutError as e:
            response = Response.error(504, str(e))
        except Exception as e:  # noqa: BLE001 - a control call is always answered
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
        if req.headers.get("content-type", "").startswith("application/json"):
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
        single = len(items) == 1
        keys = np.frombuffer(items[0][1] if single else b"".join([it[1] for it in items]), dtype="<u8")
        rows, found = index.lookup_rows(keys)
        rows = memoryview(rows.reshape(-1))  # flat bytes: slices below are byte ranges, not rows
        rb = index.row_bytes
        total = len(keys)
        prefixes = self._head_prefixes.get((index.version, index.dim))
        if prefixes is None:
            prefixes = self._head_prefixes_for(index)
        if single:
            hits = int(np.count_nonzero(found))
            _, body, slot, deliver, t0 = items[0]
            bitmap = np.packbits(found, bitorder="little").tobytes()
            head = prefixes[slot.keep_alive] + b"%d\r\nX-Cube-Misses: %d\r\n\r\n" % (
                total * rb + len(bitmap),
                total - hits,
            )
            deliver(slot, b"".join((head, rows, bitmap)))
            self.metrics.observe_lookups(1, total, total - hits, (perf_counter() - t0,))
            return
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
        """The JSON debugging variant: keys must be JSON integers in [0, 2**64); nothing is coerced."""
        try:
            body = json.loads(req.body or b"{}")
        except (ValueError, RecursionError) as e:
            return Response.error(400, f'JSON lookup body must be {{"keys": [uint64, ...]}}: {str(e)[:200]}')
        keys = body.get("keys") if isinstance(body, dict) else None
        if not isinstance(keys, list):
            return Response.error(400, 'JSON lookup body must be {"keys": [uint64, ...]} with a list of integers')
        if len(keys) > self.max_batch:
            return Response.error(413, f"{len(keys)} keys exceed the batch limit {self.max_batch}")
        for i, k in enumerate(keys):
            if type(k) is not int or not 0 <= k < MAX_KEY:  # bool is an int subclass: refused too
                shown = json.dumps(k)[:40] if not isinstance(k, (dict, list)) else type(k).__name__
                return Response.error(400, f"keys[{i}] = {shown} is not an integer in [0, 2**64)")
        keys = np.array(keys, dtype=np.uint64)
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
        self._max_body_bytes = min(max_body, self.max_batch * 8)
        server = await loop.create_server(lambda: LookupProtocol(self, max_body), sock=sock)
        watcher = loop.create_task(self.watch_state())
        try:
            await server.serve_forever()
        finally:
            watcher.cancel()


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
