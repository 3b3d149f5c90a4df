"""One HTTP/1.1 connection on raw asyncio: strict framing, limits, backpressure, three kinds of handlers.

Measured for the cube: a raw ``asyncio.Protocol`` handler is
~1.5x faster than aiohttp for small binary requests, and the per-request cost
is what matters at 26 keys per request. Every ElasticCTR server runs on this
protocol (``ctr_foundation.http_server.HttpServer``), so framing, limits,
time-outs and the token check are the same everywhere.

After a request head is parsed (``http_messages.parse_head``), the server's
app maps it to a :class:`Route`, which says how the body is taken and who
answers; the token and the body limit are checked right then, BEFORE any body
byte is read:

- ``loop``: the body is collected in memory; ``handler(request, slot, deliver)``
  runs on the event loop and returns a Response, or None and later calls
  ``deliver(slot, response)`` from the loop (merged lookups, batched predictions).
  Pipelined requests are parsed while earlier ones wait; answers go out in order.
- ``thread``: the body is collected in memory; ``handler(request) -> Response``
  runs in the server's thread pool (file system work, downstream calls).
- ``stream``: ``handler(request) -> Response`` runs in the thread pool as soon
  as the head is admitted and reads the body from ``request.stream`` while it
  arrives (uploads of gigabytes, never held in memory).

Backpressure: while the transport holds more unsent answer bytes than its
high-water mark, the connection stops reading (and parsing) new requests; a
client that never reads its answers is dropped after ``write_timeout``.

Admission, so that no client can hold a server with slow or idle connections:
the whole request head is held to ``max_header_bytes`` however it arrives
(431), and a head with a bare LF or CR is a 400 at once (it could never end
with CRLF CRLF). A body that does not arrive with its head is *unfinished*:
at most ``max_unfinished_bodies`` of them per server (beyond: the slowest one
that has had its chance is closed to make room, else 503 and close), each must
keep ``body_min_rate`` bytes/s after ``body_grace`` seconds (408 otherwise).
A body announced at no more than ``small_body`` bytes (a prediction request,
whose client wrote its head and body in two writes) takes no such place: it
must be complete within ``small_body_timeout`` seconds instead, so that a flood
of large dripping bodies cannot refuse it. A new connection over
``max_connections`` evicts a connection that is between requests: first one
closing after an error answer, then the oldest that is idle or still sending
its head, sparing one accepted less than EVICT_AFTER ago that has sent nothing
(``HttpServer.evict_one``); it is refused with 503 only when every connection
is in the middle of a request.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ctr_foundation.http_auth import check_bearer
from ctr_foundation.http_messages import (
    NO_BODY_METHODS,
    BodyReader,
    ChunkedDecoder,
    FileBody,
    HttpError,
    Request,
    Response,
    Slot,
    parse_head,
)

log = logging.getLogger("ctr_foundation.http")

MAX_HEADER_BYTES = 16 * 1024  # the default; HttpLimits.max_header_bytes decides per server
LOOP, THREAD, STREAM = "loop", "thread", "stream"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
LINGER_SECONDS = 2.0  # after an error answer that closes, input is read and discarded this long


@dataclass(frozen=True)
class Route:
    """How one request is served: who answers, whether it needs the token, the largest body it takes."""

    handler: Callable
    mode: str = LOOP
    token: bool = False
    max_body: int = 0  # bytes; 0: no body at all

    def __post_init__(self):
        if self.mode not in (LOOP, THREAD, STREAM):
            raise ValueError(f"Route mode {self.mode!r}: expected loop, thread or stream")


# An unfinished body younger than this keeps its place (HttpProtocol._displace_slowest_body): a body sent in a
# second write arrives within milliseconds, so only bodies that have had their chance are closed.
DISPLACE_AFTER = 0.25
EVICT_AFTER = 0.25  # a new connection that has sent nothing yet is safe from eviction this long (evictable)
NO_BYTE_AFTER = 0.05


class _BlockingSlot(Slot):
    """The slot of a thread/stream request: the connection parses nothing else until it is answered."""

    __slots__ = ()


class _Incoming:
    """A request whose head is admitted and whose body is still arriving."""

    __slots__ = ("request", "route", "length", "decoder", "chunks", "reader")

    def __init__(self, request: Request, route: Route):
        self.request, self.route = request, route
        self.length = request.content_length or 0  # bytes still to come (Content-Length bodies)
        self.decoder = ChunkedDecoder(route.max_body) if request.chunked else None
        self.chunks: list[bytes] = []
        self.reader: BodyReader | None = None


class HttpProtocol(asyncio.Protocol):
    """One connection of an HttpServer (which holds the app, the token, the limits and the thread pool)."""

    # A subclass may recognise some requests from a few bytes of their head (cube's binary lookups):
    # if data starts with fast_prefix, fast_head(data, start, end) -> (arg, body length, keep_alive) or None,
    # and fast_dispatch(protocol, arg, body, keep_alive) takes the complete body.
    fast_prefix: bytes | None = None
    fast_head = None
    fast_dispatch = None
    fast_max_body = 0

    def __init__(self, server):
        self.server = server
        self._body_open = False  # counted in server.unfinished_bodies (or a small body: see _track_body)
        self._body_small = False
        self._body_since = self._swept = 0.0
        self._body_got = 0  # bytes received since the body became unfinished
        self.limits = server.limits
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.pending: deque[Slot] = deque()
        self.closing = False  # parse no further request
        self.requests = 0  # requests parsed on this connection
        self._head = None  # a fast tuple (arg, length, keep_alive) or an _Incoming whose body is arriving
        self._want = 0  # the buffer must hold this many bytes before it is parsed again
        self._busy = False  # a thread/stream handler owns the connection
        self._sending = False  # a file body is being streamed
        self._write_paused = False
        self._paused: set[str] = set()  # why reading is paused
        self._heard = False
        self._last_rx = self._idle_since = 0.0
        self._partial_since: float | None = None
        self._mark = 0
        self._write_paused_at = 0.0
        self._drained: asyncio.Event | None = None
        self.rejected = False
        self._eof = False
        self._lingering = False
        self._linger_since = 0.0

    @property
    def at_rest(self) -> bool:
        """Nothing of this connection is under way: no bytes buffered, no request unanswered or being
        answered or streamed, no body arriving, not closing, write-paused, lingering or at its end, the
        transport open. A subclass may then answer a whole request that arrived in one chunk by itself
        (cube-server's lone lookup) without overtaking anything; any state this layer adds belongs here."""
        return self.transport is not None and not (
            self.buffer
            or self.pending
            or self._head is not None
            or self.closing
            or self._busy
            or self._sending
            or self._write_paused
            or self._lingering
            or self._eof
        )

    # ---- connection events -------------------------------------------------------------------
    def connection_made(self, transport):
        server = self.server
        if len(server.connections) >= self.limits.max_connections and not server.evict_one():
            # Over the cap: answer at once and close, never let connections pile up.
            self.rejected = True
            busy = Response.error(
                503, f"{server.name}: too many connections ({self.limits.max_connections}), retry later"
            )
            transport.write(b"".join(busy.encode(False)))
            transport.close()
            return
        self.transport = transport
        server.connections[self] = None
        transport.set_write_buffer_limits(high=self.limits.write_high_water, low=self.limits.write_high_water // 4)
        self._last_rx = self._idle_since = server.loop.time()

    def connection_lost(self, exc):
        self.transport = None
        if self.rejected:
            return
        self.server.connections.pop(self, None)
        self.server.lingering.pop(self, None)
        if self._body_open:
            self._close_body()
        head = self._head
        if head is not None and head.__class__ is _Incoming and head.reader is not None:
            head.reader.fail(ConnectionError("the client closed the connection in the middle of the body"))
        if self._drained is not None:
            self._drained.set()

    def eof_received(self):
        """The client half-closed: answer what it sent (keep the transport open for that), then close."""
        self._eof = True
        if self._lingering:
            return None  # the client read our answer and closed: close too
        self._drop_incomplete_body()
        if self.pending or self._busy or self._sending:
            return True
        if self.buffer and not self.closing:
            self.server.loop.call_soon(self._continue)  # pipelined requests still to parse (e.g. after a pause)
            return True
        return None

    def _drop_incomplete_body(self) -> None:
        """After a half-close, a body still arriving can never be complete: nothing of it is answered."""
        head = self._head
        if head is None:
            return
        self._head = None
        self.closing = True
        self.buffer.clear()
        self._want = 0
        self._track_body()
        if head.__class__ is _Incoming and head.reader is not None:
            head.reader.fail(ConnectionError("the client closed the connection in the middle of the body"))

    def _finish_eof(self) -> None:
        """After a half-close: close once every request that arrived complete has its answer."""
        if self._eof and not self.pending and not self._busy and not self._sending and self.transport is not None:
            self._close()

    def pause_writing(self):
        self._write_paused = True
        self._write_paused_at = self.server.loop.time()
        self._pause("write")

    def resume_writing(self):
        self._write_paused = False
        if self._drained is not None:
            self._drained.set()
        self._resume("write")

    def data_received(self, data: bytes) -> None:
        self._heard = True
        self._receive(data)

    # ---- parsing -----------------------------------------------------------------------------
    def _receive(self, data: bytes) -> None:
        if self._body_open:
            self._body_got += len(data)
        self._parse(data)
        if self._body_open is not (self._head is not None and self.transport is not None):
            self._track_body()

    def _parse(self, data: bytes) -> None:
        if self._lingering:
            return  # closing after an error answer: what still arrives is discarded
        if self.buffer:  # the tail of an earlier chunk: continue from it
            self.buffer += data
            if len(self.buffer) < self._want and not self._eof:
                return  # a long body still arriving: do not copy the buffer for every chunk
            data = bytes(self.buffer)
            self.buffer.clear()
        elif self.closing and self._head is None:
            return
        self._want = 0
        pos, n = 0, len(data)
        while pos < n:
            head = self._head
            if head is None:
                if self.closing or self._busy or self._write_paused:
                    break
                end = data.find(b"\r\n\r\n", pos)
                if end < 0:
                    if n - pos > self.limits.max_header_bytes:
                        self._fail(431, f"request head larger than {self.limits.max_header_bytes} bytes")
                        return
                    if _bare_line_end(data, pos, n):
                        self._fail(400, "bare LF or CR in the request head (lines must end with CRLF)")
                        return
                    break
                if end - pos > self.limits.max_header_bytes:  # complete, but arrived whole: the same limit
                    self._fail(431, f"request head larger than {self.limits.max_header_bytes} bytes")
                    return
                fast = None
                if self.fast_prefix is not None and data.startswith(self.fast_prefix, pos):
                    fast = self.fast_head(data, pos, end)
                if fast is not None:
                    pos = end + 4
                    if fast[1] > self.fast_max_body:
                        self._fail(413, f"body of {fast[1]} bytes exceeds the limit of {self.fast_max_body}")
                        return
                    self._head = head = fast
                else:
                    start, pos = pos, end + 4
                    head = self._admit(data[start:end], n - pos)
                    if head is None:
                        if self.transport is None:
                            return
                        continue
                    self._head = head
            if head.__class__ is tuple:  # the fast path: (arg, length, keep_alive)
                length = head[1]
                if n - pos < length:
                    self._want = length
                    break
                body = data[pos : pos + length] if length else b""
                pos += length
                self._head = None
                self.requests += 1
                self.fast_dispatch(self, head[0], body, head[2])
                if not head[2]:
                    self.closing = True
                continue
            pos = self._body(head, data, pos)
            if self._head is not None:
                break
        if pos < n and not self.closing:
            self.buffer += data[pos:] if pos else data
            if self._head is None and len(self.buffer) > self.limits.read_buffer:
                self._pause("buffer")  # pipelined requests waiting: stop reading until they are parsed
        if self._eof:
            self._drop_incomplete_body()
            self._finish_eof()

    def _admit(self, raw: bytes, body_bytes_here: int) -> _Incoming | None:
        """Parse and admit one request head; None when it was answered (or needs no body)."""
        while raw.startswith(b"\r\n"):  # empty lines before a request line are allowed (RFC 9112 2.2)
            raw = raw[2:]
        if not raw:
            return None
        try:
            req = parse_head(raw, max_headers=self.limits.max_headers)
        except HttpError as e:
            self._fail(e.status, e.message)
            return None
        try:
            route = self.server.app.route(req)
            if route.token:  # first: an unauthenticated caller learns nothing else (not even the limits)
                check_bearer(req.headers, self.server.token, self.server.name)
            if req.has_body:
                if req.method in NO_BODY_METHODS:
                    raise HttpError(400, f"{req.method} requests carry no body", close=True)
                if req.content_length is not None and req.content_length > route.max_body:
                    limit = (
                        f"the size limit of {route.max_body} bytes" if route.max_body else "no body on this endpoint"
                    )
                    raise HttpError(413, f"body of {req.content_length} bytes exceeds {limit}", close=True)
                if req.chunked and not route.max_body:
                    raise HttpError(413, "this endpoint takes no body", close=True)
        except HttpError as e:
            self._refuse(req, e)
            return None
        except Exception as e:  # noqa: BLE001 - a routing bug answers 500, never drops the connection
            log.exception("%s: routing %s %s failed", self.server.name, req.method, req.path)
            self._refuse(req, HttpError(500, f"internal error: {type(e).__name__}: {e}", close=True))
            return None
        self.requests += 1
        if req.expect_continue and req.has_body and body_bytes_here == 0 and not self.pending:
            self.transport.write(CONTINUE)
        if route.mode == STREAM:
            return self._start_stream(req, route)
        if not req.has_body:
            self._dispatch(req, route)
            return None
        return _Incoming(req, route)

    def _body(self, inc: _Incoming, data: bytes, pos: int) -> int:
        """Take what is there of ``inc``'s body from ``data[pos:]``; dispatch once it is complete."""
        n = len(data)
        if inc.decoder is None:
            if inc.reader is not None:  # streamed, Content-Length
                take = min(inc.length, n - pos)
                if take:
                    self._push(inc, data[pos : pos + take])
                    inc.length -= take
                    pos += take
                if inc.length == 0:
                    self._head = None
                    inc.reader.end()
                return pos
            if n - pos < inc.length:
                self._want = inc.length
                return pos
            body = data[pos : pos + inc.length]
            self._head = None
            self._dispatch(inc.request, inc.route, body)
            return pos + inc.length
        try:
            pos, pieces = inc.decoder.feed(data, pos)
        except HttpError as e:
            self._head = None
            if inc.reader is not None:
                self.closing = True
                inc.reader.fail(e)  # the handler answers it
            else:
                self._fail(e.status, e.message)
            return n
        if inc.reader is not None:
            for piece in pieces:
                self._push(inc, piece)
        else:
            inc.chunks.extend(pieces)
        if inc.decoder.done:
            self._head = None
            if inc.reader is not None:
                inc.reader.end()
            else:
                self._dispatch(inc.request, inc.route, b"".join(inc.chunks))
        return pos

    def _push(self, inc: _Incoming, piece: bytes) -> None:
        if inc.reader.push(piece):
            self._pause("stream")

    def _stream_drained(self) -> None:
        self._resume("stream")

    # ---- dispatch ----------------------------------------------------------------------------
    def _dispatch(self, req: Request, route: Route, body: bytes = b"") -> None:
        req.body = body
        if not req.keep_alive:
            self.closing = True
        if route.mode == LOOP:
            slot = Slot(req.keep_alive, req.method == "HEAD")
            self.pending.append(slot)
            try:
                response = route.handler(req, slot, self._deliver)
            except HttpError as e:
                response = e.response()
            except Exception as e:  # noqa: BLE001 - a handler bug answers 500, the connection lives on
                log.exception("%s: %s %s failed", self.server.name, req.method, req.path)
                response = Response.error(500, f"internal error: {type(e).__name__}: {e}")
            if response is not None:
                self._deliver(slot, response)
            return
        self._run_blocking(req, route)

    def _start_stream(self, req: Request, route: Route) -> _Incoming | None:
        loop = self.server.loop

        def drained():
            try:
                loop.call_soon_threadsafe(self._stream_drained)
            except RuntimeError:  # the loop is gone (server stopped)
                pass

        req.stream = BodyReader(high=self.limits.stream_buffer, on_drained=drained)
        self._run_blocking(req, route)
        if not req.has_body:
            req.stream.end()
            return None
        inc = _Incoming(req, route)
        inc.reader = req.stream
        return inc

    def _run_blocking(self, req: Request, route: Route) -> None:
        slot = _BlockingSlot(req.keep_alive, req.method == "HEAD")
        self.pending.append(slot)
        self._busy = True
        loop = self.server.loop
        name = self.server.name

        def run():
            try:
                response = route.handler(req)
            except HttpError as e:
                response = e.response()
            except (ConnectionError, TimeoutError) as e:
                log.warning("%s: %s %s: connection lost: %s", name, req.method, req.path, e)
                response = None
            except Exception as e:  # noqa: BLE001 - report, keep serving
                log.exception("%s: %s %s failed", name, req.method, req.path)
                response = Response.error(500, f"internal error: {type(e).__name__}: {e}")
            try:
                loop.call_soon_threadsafe(self._blocking_done, req, slot, response)
            except RuntimeError:  # the loop is gone (server stopped)
                if response is not None and isinstance(response.body, FileBody):
                    response.body.file.close()

        try:
            self.server.executor().submit(run)
        except RuntimeError:  # the pool is shut down: the server is stopping
            self._blocking_done(req, slot, Response.error(503, f"{name} is shutting down", close=True))

    def _blocking_done(self, req: Request, slot: Slot, response: Response | None) -> None:
        if response is None:
            self._abort()
            return
        unread = req.stream is not None and not req.stream.complete
        if unread or response.close:
            response.close = True
            self.closing = True
            if self._head is not None and self._head.__class__ is _Incoming and self._head.request is req:
                self._head = None  # nobody reads the rest of that body
                self._track_body()
        self._deliver(slot, response)

    def _refuse(self, req: Request, e: HttpError) -> None:
        """Answer a request refused at its head; keep the connection only if nothing of it is left unread."""
        keep = req.keep_alive and not e.close and not req.has_body
        slot = Slot(keep, req.method == "HEAD")
        self.pending.append(slot)
        if not keep:
            self.closing = True
        response = e.response()
        response.close = not keep
        self._deliver(slot, response)

    def _fail(self, status: int, message: str) -> None:
        """Answer a request that cannot be framed, then close (the stream is out of sync)."""
        self.closing = True
        self._head = None
        slot = Slot(keep_alive=False)
        self.pending.append(slot)
        self._deliver(slot, Response.error(status, message, close=True))

    # ---- answers -----------------------------------------------------------------------------
    def _deliver(self, slot: Slot, response) -> None:
        slot.response = response
        pending = self.pending
        if not pending or pending[0] is not slot:  # an earlier request is still waiting: answer in order
            return
        while pending and pending[0].response is not None and not self._sending:
            done = pending.popleft()
            transport = self.transport
            if transport is None or self._lingering:
                if done.__class__ is _BlockingSlot:
                    self._busy = False
                _close_file(done.response)
                continue
            r = done.response
            keep = done.keep_alive
            if r.__class__ is bytes:
                transport.write(r)
            else:
                keep = keep and not r.close
                if r.body.__class__ is FileBody and not done.head_only:
                    transport.write(r.encode_head(keep))
                    self._sending = True
                    self.server.loop.create_task(self._send_file(r.body, keep, done))
                    return
                _close_file(r)
                transport.writelines(r.encode(keep, done.head_only))
            if not keep:
                self._close(linger=True)
                continue
            if done.__class__ is _BlockingSlot:
                self._busy = False
                self.server.loop.call_soon(self._continue)
        if self._eof and not pending and not self._sending and self.transport is not None:
            if self.buffer and not self.closing:
                self.server.loop.call_soon(self._continue)  # parse the rest first; _receive closes after
            else:
                self._finish_eof()  # the client half-closed and has every answer

    def _close(self, *, linger: bool = False) -> None:
        """Close after the answers written so far. ``linger``: the client may still be sending (a refused
        upload, pipelined requests after a ``Connection: close``): half-close, so it reads the answer instead
        of a reset, and discard what still arrives for a moment (as web servers' "lingering close")."""
        self.closing = True
        t = self.transport
        if t is None:
            return
        if linger and not self._eof and t.can_write_eof():
            t.write_eof()
            self._lingering = True
            self.server.lingering[self] = None
            self._linger_since = self.server.loop.time()
            if self._paused:
                self._paused.clear()
                t.resume_reading()
            return
        t.close()
        self.transport = None

    async def _send_file(self, body: FileBody, keep: bool, slot: Slot) -> None:
        try:
            await self._write_file(body)
        except (OSError, RuntimeError, asyncio.CancelledError) as e:
            log.warning("%s: sending a file body failed: %s", self.server.name, e)
            keep = False
        finally:
            body.file.close()
            self._sending = False
        if slot.__class__ is _BlockingSlot:
            self._busy = False
        if self.transport is None:
            return
        if not keep:
            self._close(linger=True)
            return
        if self.pending and self.pending[0].response is not None:
            self._deliver(self.pending[0], self.pending[0].response)
        self._continue()

    async def _write_file(self, body: FileBody) -> None:
        loop = self.server.loop
        try:
            sent = await loop.sendfile(self.transport, body.file, body.offset, body.size)
            if sent != body.size:
                raise OSError(f"sent {sent} of {body.size} bytes")
            return
        except (NotImplementedError, AttributeError):
            pass  # an event loop without sendfile (uvloop): copy in pieces, waiting for the transport to drain
        left, offset = body.size, body.offset
        while left:
            piece = os.pread(body.file.fileno(), min(left, 1 << 20), offset)
            if not piece:
                raise OSError(f"file ended {left} bytes early")
            if self.transport is None:
                raise OSError("client went away")
            self.transport.write(piece)
            left -= len(piece)
            offset += len(piece)
            while self._write_paused and self.transport is not None:
                self._drained = asyncio.Event()
                await self._drained.wait()

    def _continue(self) -> None:
        """Parse what waited in the buffer (after a blocking handler answered, or writes drained)."""
        self._resume("buffer")
        if self.transport is not None and not self._busy and not self._lingering:
            self.data_received(b"")

    # ---- flow control and time-outs ----------------------------------------------------------
    def _pause(self, why: str) -> None:
        if not self._paused and self.transport is not None:
            self.transport.pause_reading()
        self._paused.add(why)

    def _resume(self, why: str) -> None:
        if why not in self._paused:
            return
        self._paused.discard(why)
        if not self._paused and self.transport is not None:
            self.transport.resume_reading()
            if why == "write":
                self.server.loop.call_soon(self._continue)

    def _abort(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.abort()
            self.transport = None

    def sweep(self, now: float) -> None:
        """Called by the server about once a second: enforce the header, body, idle and write time-outs."""
        if self.transport is None:
            return
        if self._heard:
            self._heard = False
            self._last_rx = now
        if self._body_open and self._paused:  # we stopped reading (backpressure): that time is not the client's
            self._body_since += now - self._swept
        self._swept = now
        lim = self.limits
        if self._lingering:
            if now - self._linger_since > LINGER_SECONDS:
                self.transport.close()
                self.transport = None
            return
        if self._write_paused:
            if now - self._write_paused_at > lim.write_timeout:
                log.info(
                    "%s: dropping a connection that has not read its answers for %ss",
                    self.server.name,
                    lim.write_timeout,
                )
                self._abort()
            return
        head = self._head
        if head is not None:  # a body is arriving
            if now - self._last_rx > lim.body_timeout:
                self._body_timed_out(head)
            elif self._body_small and now - self._body_since > lim.small_body_timeout:
                self._abandon_body(
                    head,
                    408,
                    f"request body of {self._body_announced()} bytes not complete within {lim.small_body_timeout}s",
                )
            elif (
                self._body_open
                and lim.body_min_rate
                and now > self._body_since + lim.body_grace + self._body_got / lim.body_min_rate
            ):
                self._abandon_body(
                    head,
                    408,
                    f"request body arriving slower than {lim.body_min_rate} bytes/s "
                    f"({self._body_got} bytes in {now - self._body_since:.0f}s)",
                )
            self._track_body()
            return
        if self._busy or self._sending or self.pending:
            return
        if self._mark != self.requests:  # requests went through since the last look
            self._mark = self.requests
            self._idle_since = now
            self._partial_since = None
        if self.buffer:  # part of a request head
            if self._partial_since is None:
                self._partial_since = now
            elif now - self._partial_since > lim.header_timeout:
                self._fail(408, f"request head not complete within {lim.header_timeout}s")
        elif now - self._idle_since > (lim.header_timeout if self.requests == 0 else lim.idle_timeout):
            self.closing = True
            self.transport.close()  # an idle keep-alive connection (or one that never sent a request)
            self.transport = None

    def _body_timed_out(self, head) -> None:
        self._abandon_body(head, 408, f"request body stalled for more than {self.limits.body_timeout}s")

    def _abandon_body(self, head, status: int, message: str) -> None:
        """Answer ``status`` for a request whose body will not be read to its end, and close."""
        if head.__class__ is _Incoming and head.reader is not None:
            self._head = None
            self.closing = True
            head.reader.fail(HttpError(status, message, close=True))  # its handler answers
        else:
            self._fail(status, message)

    def _track_body(self) -> None:
        """Count this connection in the server's unfinished bodies while one is arriving; refuse one over
        the cap (its connection would otherwise be held by a client that may send a byte a minute)."""
        opened = self._head is not None and self.transport is not None
        if opened is self._body_open:
            return
        server = self.server
        if not opened:
            self._close_body()
            return
        announced = self._body_announced()
        small = announced is not None and announced <= self.limits.small_body
        if not small:
            cap = self.limits.max_unfinished_bodies
            if server.unfinished_bodies >= cap and not self._displace_slowest_body():
                self._abandon_body(
                    self._head, 503, f"{server.name}: too many request bodies arriving at once ({cap}), retry later"
                )
                return
            server.unfinished_bodies += 1
            server.arriving[self] = None
        self._body_open, self._body_small = True, small
        self._body_since = self._swept = server.loop.time()
        self._body_got = 0

    def _close_body(self) -> None:
        self._body_open = False
        if self._body_small:
            self._body_small = False
        else:
            self.server.unfinished_bodies -= 1
            self.server.arriving.pop(self, None)

    def _body_announced(self) -> int | None:
        """The Content-Length of the body arriving (None for a chunked one, whose size nobody announced)."""
        head = self._head
        if head.__class__ is tuple:
            return head[1]
        return None if head.request.chunked else head.request.content_length

    def _displace_slowest_body(self) -> bool:
        """With every unfinished-body place taken, close the slowest body that has arrived for at least
        DISPLACE_AFTER seconds below ``body_min_rate`` (408) to make room for this one; False when none is.

        Why: a client whose body follows its head in a second write (most HTTP clients) holds a place for a
        few milliseconds; refused while a flood of one-byte-a-second bodies held every place, a well-behaved
        client got only about 80% of its answers under a flood of twice the connection cap.
        """
        lim = self.limits
        if not lim.body_min_rate:
            return False
        now = self.server.loop.time()
        victim, slowest = None, None
        for conn in self.server.arriving:
            age = now - conn._body_since
            # Old enough to have shown its pace, or not one byte yet where a body in a second write would
            # have arrived long since.
            if age < DISPLACE_AFTER and not (conn._body_got == 0 and age >= NO_BYTE_AFTER):
                continue
            rate = conn._body_got / age
            if rate < lim.body_min_rate and (slowest is None or rate < slowest):
                victim, slowest = conn, rate
        if victim is None or victim._head is None:
            return False
        victim._abandon_body(
            victim._head,
            408,
            f"request body arriving slower than {lim.body_min_rate} bytes/s ({victim._body_got} bytes in "
            f"{now - victim._body_since:.1f}s), closed for a request while every place was taken",
        )
        victim._track_body()
        return True

    def evictable(self, now: float | None) -> bool:
        """Between requests (idle, or still sending a head) or closing: nothing of an answer is lost. Not a
        connection younger than EVICT_AFTER that has sent nothing yet: under a flood of new connections each
        fresh one would otherwise be closed by the next before its request arrived (a well-behaved client
        beside a flood got resets)."""
        if self.transport is None:
            return False
        if self._lingering:
            return True
        if self._head is not None or self.pending or self._busy or self._sending:
            return False
        return bool(self.requests or self.buffer or self._heard) or now is None or now - self._idle_since >= EVICT_AFTER

    def evict(self) -> None:
        """Close to make room for a new connection (see ``HttpServer.evict_one``)."""
        self.server.connections.pop(self, None)
        self.server.lingering.pop(self, None)
        t = self.transport
        if self.buffer and not self._lingering:  # part of a head: say why, then close
            t.write(b"".join(Response.error(503, f"{self.server.name}: too many connections, retry").encode(False)))
        self.closing = True
        self.buffer.clear()
        t.close()
        self.transport = None

    def shutdown(self) -> None:
        head = self._head
        if head is not None and head.__class__ is _Incoming and head.reader is not None:
            head.reader.fail(ConnectionError("the server is shutting down"))
        self._abort()


def _bare_line_end(data: bytes, start: int, end: int) -> bool:
    """Whether ``data[start:end]`` (part of a head) holds an LF or CR that is not part of a CRLF; a CR as the
    last byte may still get its LF."""
    crlf = data.count(b"\r\n", start, end)
    if data.count(b"\n", start, end) != crlf:
        return True
    return data.count(b"\r", start, end) - (data[end - 1 : end] == b"\r") != crlf


def _close_file(response) -> None:
    if response.__class__ is not bytes and response.body.__class__ is FileBody:
        response.body.file.close()
