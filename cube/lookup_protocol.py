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

import re

from ctr_foundation.http_messages import Slot
from ctr_foundation.http_protocol import HttpProtocol

LOOKUP_PREFIX = b"POST /v1/lookup"
_VERSION_QUERY = b"/v1/lookup?version="
_PLAIN_VERSION = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.")
# The header lines of a head the fast path may take: names are tokens, values visible bytes, spaces and
# tabs. No NUL, bare CR or LF, obsolete folding or space before a colon: those go to the strict parser (400).
_PLAIN_HEADERS = re.compile(rb"(?:\r\n[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[\t\x20-\x7e\x80-\xff]*)*")


_CACHE: dict[bytes, tuple | None] = {}
_CACHE_ENTRIES = 4096
_CACHE_HEAD_BYTES = 512  # at most 2 MiB of cached heads
_MISS = object()


def parse_lookup_head(data: bytes, start: int, end: int) -> tuple | None:
    """(version or None, body length, keep_alive) of a plain binary lookup head, else None.

    ``data[start:end]`` is the head without its final blank line. None means
    "not for the fast path" (never "bad request"): the generic parser decides.
    Clients send the same few heads over and over (only Content-Length
    changes, and often not even that), so results are cached by the head's bytes.
    """
    head = data[start:end]
    known = _CACHE.get(head, _MISS)
    if known is not _MISS:
        return known
    parsed = _parse_lookup_head(head)
    if len(head) <= _CACHE_HEAD_BYTES:
        if len(_CACHE) >= _CACHE_ENTRIES:
            _CACHE.clear()
        _CACHE[head] = parsed
    return parsed


def _parse_lookup_head(data: bytes) -> tuple | None:
    start, end = 0, len(data)
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
    head = data[line_end:end]
    if _PLAIN_HEADERS.fullmatch(head) is None:
        return None
    head = head.lower()  # "\r\nname: value" ... ; header names are case-insensitive
    if b"\r\ntransfer-encoding:" in head or b"\r\nexpect:" in head or head.count(b"\r\ncontent-length:") != 1:
        return None
    at = head.find(b"\r\ncontent-length:")
    eol = head.find(b"\r\n", at + 17)
    raw = head[at + 17 :] if eol < 0 else head[at + 17 : eol]
    raw = raw.strip()
    if not raw.isdigit() or len(raw) > 18:
        return None
    length = int(raw)
    at = head.rfind(b"\r\ncontent-type:")
    if at >= 0 and head[at + 15 : at + 48].lstrip().startswith(b"application/json"):
        return None
    keep_alive = True
    at = head.find(b"\r\nconnection:")
    if at >= 0:  # as the strict parser reads it: every Connection header, comma-separated tokens
        tokens = b",".join(line.partition(b":")[2] for line in head.split(b"\r\n") if line.startswith(b"connection:"))
        keep_alive = b"close" not in [t.strip() for t in tokens.split(b",")]
    return version, length, keep_alive


class LookupProtocol(HttpProtocol):
    """One cube-server connection: fast binary lookups, everything else through HttpProtocol's strict parser.

    ``worker.fast_lookup(protocol, version, body, keep_alive)`` queues a lookup;
    the answer comes back through ``_deliver`` as bytes (already encoded) or
    as a Response (errors), in request order either way. Backpressure, limits
    and time-outs are HttpProtocol's: a connection whose answers are not read
    stops being read.
    """

    fast_prefix = LOOKUP_PREFIX
    fast_head = staticmethod(parse_lookup_head)

    def __init__(self, server, worker):
        super().__init__(server)
        self.worker = worker
        self.fast_dispatch = worker.fast_lookup
        self.fast_max_body = worker.max_body

    def connection_made(self, transport):
        super().connection_made(transport)
        if not self.rejected:
            self.worker.connections += 1

    def connection_lost(self, exc):
        super().connection_lost(exc)
        if not self.rejected:
            self.worker.connections -= 1

    def data_received(self, data: bytes) -> None:
        self._heard = True
        if self._alone(data):
            return
        try:
            self._receive(data)
        finally:  # even after an early return: what was queued must be answered
            self.worker.end_of_chunk()

    def _alone(self, data: bytes) -> bool:
        """Answer ``data`` at once if it is exactly one whole plain keep-alive lookup on the worker's only
        connection, with nothing before it (no unanswered request, no buffered bytes, no body arriving):
        a single client's request then costs no answer slot, queue or merge pass. Anything else (and
        any lookup that is not a plain success) goes the ordinary way, which parses and answers it."""
        if not self.at_rest or self.worker.connections != 1 or not data.startswith(LOOKUP_PREFIX):
            return False
        end = data.find(b"\r\n\r\n")
        if end < 0 or end > self.limits.max_header_bytes:
            return False
        fast = parse_lookup_head(data, 0, end)
        if fast is None or not fast[2] or fast[1] > self.fast_max_body or len(data) != end + 4 + fast[1]:
            return False
        answer = self.worker.lookup_now(fast[0], data[end + 4 :])
        if answer is None:
            return False
        self.requests += 1
        self.transport.write(answer)
        return True

    def new_slot(self, keep_alive: bool) -> Slot:
        """Reserve this request's place in the connection's ordered answers."""
        slot = Slot(keep_alive)
        self.pending.append(slot)
        return slot
