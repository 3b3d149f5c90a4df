"""cube-server's connection protocol: the generic HttpProtocol plus a fast path for binary lookups.

At 26 keys per request, what a request costs in Python decides whether cube
keeps up with Redis. The generic parser builds a header dict, a Request and a
Response object and splits the URL for every request; that alone costs more
than the lookup. Here a binary ``POST /v1/lookup`` on a keep-alive
HTTP/1.1 connection is recognised with a few bytes operations on the head
(bytes.find on the lower-cased head, no dict, no URL parsing) and handed
straight to the worker's merge queue; its answer comes back as one ready
bytes object. Anything unusual (JSON body, Expect, chunked, odd spacing,
an escaped query, another method or path) goes through the generic parser,
which also answers every error, so both paths behave the same.
"""

from __future__ import annotations

from ctr_foundation.http_protocol import MAX_HEADER_BYTES, HttpProtocol, Slot

LOOKUP_PREFIX = b"POST /v1/lookup"
_VERSION_QUERY = b"/v1/lookup?version="
_PLAIN_VERSION = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.")
_FAST = object()  # marks a parsed head that belongs to the fast path
# Unsent answer bytes per connection above which its requests are no longer read (and below which
# reading resumes). One 1M-key answer (36 MB at dim 9) is always sent whole; this bounds what piles up.
WRITE_HIGH_WATER = 4 << 20
WRITE_LOW_WATER = 1 << 20


def parse_lookup_head(data: bytes, start: int, end: int) -> tuple | None:
    """(version or None, body length, keep_alive) of a plain binary lookup head, else None.

    ``data[start:end]`` is the head without its final blank line. None means
    "not for the fast path" (never "bad request"): the generic parser decides.
    """
    line_end = data.find(b"\r\n", start, end)
    if line_end < 0:
        line_end = end
    if data[line_end - 9 : line_end] != b" HTTP/1.1":
        return None
    target = data[start + 5 : line_end - 9]
    if target == b"/v1/lookup":
        version = None
    elif target.startswith(_VERSION_QUERY) and len(target) > 19 and _PLAIN_VERSION.issuperset(target[19:]):
        version = target[19:].decode("ascii")
    else:
        return None
    head = data[line_end:end].lower()  # "\r\nname: value" ... ; header names are case-insensitive
    if b" :" in head or b"\t:" in head or b"\r\ntransfer-encoding:" in head or b"\r\nexpect:" in head:
        return None
    at = head.rfind(b"\r\ncontent-length:")
    if at < 0:
        return None
    eol = head.find(b"\r\n", at + 17)
    raw = head[at + 17 :] if eol < 0 else head[at + 17 : eol]
    if not raw.strip().isdigit():
        return None
    length = int(raw)
    at = head.rfind(b"\r\ncontent-type:")
    if at >= 0 and head[at + 15 : at + 48].lstrip().startswith(b"application/json"):
        return None
    keep_alive = True
    at = head.rfind(b"\r\nconnection:")
    if at >= 0:
        eol = head.find(b"\r\n", at + 13)
        keep_alive = (head[at + 13 :] if eol < 0 else head[at + 13 : eol]).strip() != b"close"
    return version, length, keep_alive


class LookupProtocol(HttpProtocol):
    """One cube-server connection: fast binary lookups, everything else via HttpProtocol.

    ``worker.fast_lookup(protocol, version, body, keep_alive)`` queues a lookup;
    the answer comes back through ``_deliver`` as bytes (already encoded) or
    as a Response (errors), in request order either way.
    """

    def __init__(self, worker, max_body: int):
        super().__init__(worker.handle, max_body)
        self.worker = worker
        self._reading_paused = False

    def connection_made(self, transport):
        super().connection_made(transport)
        self.worker.connections += 1
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER, low=WRITE_LOW_WATER)

    def connection_lost(self, exc):
        super().connection_lost(exc)
        self.worker.connections -= 1

    # Backpressure: a client that sends lookups but does not read the answers must not make the
    # server buffer them without bound. Once the unsent answers of a connection exceed the high-water
    # mark, stop reading its requests until the client has read them down to the low-water mark
    # (what it already sent waits in the kernel's socket buffers, which are bounded).
    def pause_writing(self):
        super().pause_writing()
        if self.transport is not None and not self._reading_paused:
            self._reading_paused = True
            self.transport.pause_reading()

    def resume_writing(self):
        super().resume_writing()
        if self.transport is not None and self._reading_paused:
            self._reading_paused = False
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        try:
            self._receive(data)
        finally:  # even after an early return: what was queued must be answered
            self.worker.end_of_chunk()

    def _receive(self, data: bytes) -> None:
        if self.closing:
            return
        if self.buffer:  # the tail of an earlier chunk: continue from it (the rare, split case)
            self.buffer += data
            if self._head is not None and len(self.buffer) < self._head[4]:
                return  # a long body still arriving: do not copy the buffer for every chunk
            data = bytes(self.buffer)
            self.buffer.clear()
        pos, n = 0, len(data)
        while pos < n and not self.closing:
            head = self._head
            if head is None:
                end = data.find(b"\r\n\r\n", pos)
                if end < 0:
                    if n - pos > MAX_HEADER_BYTES:
                        self._fail(431, "request head too large")
                        return
                    break
                fast = parse_lookup_head(data, pos, end) if data.startswith(LOOKUP_PREFIX, pos) else None
                if fast is None:
                    try:
                        head = self._parse_head(data[pos:end])
                    except ValueError as e:
                        self._fail(400, str(e))
                        return
                    if head[5] and n - (end + 4) < head[4]:
                        self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                else:
                    head = (_FAST, fast[0], None, fast[2], fast[1], False)
                pos = end + 4
                if head[4] > self.max_body:
                    self._fail(413, f"body of {head[4]} bytes exceeds the limit of {self.max_body}")
                    return
                self._head = head
            length = head[4]
            if n - pos < length:
                break
            body = data[pos : pos + length] if length else b""
            pos += length
            self._head = None
            if head[0] is _FAST:
                self.worker.fast_lookup(self, head[1], body, head[3])
                if not head[3]:
                    self.closing = True
            else:
                self._dispatch(head[0], head[1], head[2], head[3], body)
        if pos < n and not self.closing:
            self.buffer += data[pos:] if pos else data

    def new_slot(self, keep_alive: bool) -> Slot:
        """Reserve this request's place in the connection's ordered answers."""
        slot = Slot(keep_alive)
        self.pending.append(slot)
        return slot

    def _deliver(self, slot: Slot, response) -> None:
        slot.response = response
        pending = self.pending
        if pending[0] is not slot:  # an earlier request is still waiting: answer in order
            return
        while pending and pending[0].response is not None:
            done = pending.popleft()
            transport = self.transport
            if transport is None:
                continue
            r = done.response
            if r.__class__ is bytes:
                transport.write(r)
            else:
                transport.writelines(r.encode(done.keep_alive))
            if not done.keep_alive:
                transport.close()
                self.transport = None
