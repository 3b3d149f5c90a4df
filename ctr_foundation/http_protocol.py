"""A minimal HTTP/1.1 server protocol on raw asyncio: keep-alive, pipelining, binary bodies.

Measured for the cube (DESIGN.md): a raw ``asyncio.Protocol`` handler is
~1.5x faster than aiohttp for small binary requests, and the per-request cost
is what matters at 26 keys per request. It parses only what cube needs:
a request line, headers, a Content-Length body (no chunked uploads), and
answers in request order even when a handler answers later (merged lookups).
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlsplit

MAX_HEADER_BYTES = 16 * 1024

REASONS = {
    100: "Continue",
    200: "OK",
    201: "Created",
    202: "Accepted",
    204: "No Content",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    409: "Conflict",
    411: "Length Required",
    413: "Payload Too Large",
    415: "Unsupported Media Type",
    431: "Request Header Fields Too Large",
    422: "Unprocessable Entity",
    500: "Internal Server Error",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]  # lower-case names
    body: bytes = b""


@dataclass
class Response:
    status: int = 200
    body: bytes | list = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def json(cls, obj, status: int = 200, headers: dict | None = None) -> Response:
        return cls(status, (json.dumps(obj) + "\n").encode(), "application/json", headers or {})

    @classmethod
    def error(cls, status: int, message: str) -> Response:
        return cls.json({"error": message}, status)

    def encode(self, keep_alive: bool) -> list:
        parts = self.body if isinstance(self.body, list) else [self.body]
        length = sum(len(p) for p in parts)
        head = [
            f"HTTP/1.1 {self.status} {REASONS.get(self.status, 'Unknown')}",
            f"Content-Type: {self.content_type}",
            f"Content-Length: {length}",
            "Connection: keep-alive" if keep_alive else "Connection: close",
        ]
        head += [f"{k}: {v}" for k, v in self.headers.items()]
        return ["\r\n".join(head).encode("latin-1") + b"\r\n\r\n", *parts]


class Slot:
    """The place of one request's answer in its connection's ordered output."""

    __slots__ = ("response", "keep_alive")

    def __init__(self, keep_alive: bool):
        self.response: Response | None = None
        self.keep_alive = keep_alive


# handler(request, slot, deliver) either returns a Response now, or returns None
# and later calls deliver(slot, response) (e.g. after a merged lookup).
Handler = Callable[[Request, Slot, Callable[[Slot, Response], None]], "Response | None"]


class HttpProtocol(asyncio.Protocol):
    """One connection; ``handler`` is shared by all connections of a server."""

    def __init__(self, handler: Handler, max_body: int):
        self.handler = handler
        self.max_body = max_body
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.pending: deque[Slot] = deque()
        self.closing = False
        self._head: tuple | None = None  # parsed head of a request whose body is incomplete

    def connection_made(self, transport):
        self.transport = transport

    def connection_lost(self, exc):
        self.transport = None

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        self.buffer += data
        while not self.closing:
            if self._head is None:
                end = self.buffer.find(b"\r\n\r\n")
                if end < 0:
                    if len(self.buffer) > MAX_HEADER_BYTES:
                        self._fail(431, "request head too large")
                    return
                try:
                    self._head = self._parse_head(bytes(self.buffer[:end]))
                except ValueError as e:
                    self._fail(400, str(e))
                    return
                del self.buffer[: end + 4]
                length = self._head[4]
                if length > self.max_body:
                    self._fail(413, f"body of {length} bytes exceeds the limit of {self.max_body}")
                    return
                if self._head[5] and len(self.buffer) < length:
                    self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            method, target, headers, keep_alive, length, _ = self._head
            if len(self.buffer) < length:
                return
            body = bytes(self.buffer[:length])
            del self.buffer[:length]
            self._head = None
            self._dispatch(method, target, headers, keep_alive, body)

    @staticmethod
    def _parse_head(raw: bytes) -> tuple:
        lines = raw.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise ValueError(f"malformed request line {lines[0][:80]!r}")
        method, target, proto = parts
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise ValueError(f"malformed header line {line[:80]!r}")
            headers[name.strip().lower()] = value.strip()
        if "chunked" in headers.get("transfer-encoding", "").lower():
            raise ValueError("chunked request bodies are not supported; send Content-Length")
        try:
            length = int(headers.get("content-length", "0"))
            if length < 0:
                raise ValueError
        except ValueError:
            raise ValueError(f"bad Content-Length {headers.get('content-length')!r}") from None
        conn = headers.get("connection", "").lower()
        keep_alive = conn != "close" if proto == "HTTP/1.1" else conn == "keep-alive"
        expect = headers.get("expect", "").lower() == "100-continue"
        return method, target, headers, keep_alive, length, expect

    def _dispatch(self, method, target, headers, keep_alive, body) -> None:
        split = urlsplit(target)
        query = {k: v[-1] for k, v in parse_qs(split.query).items()}
        request = Request(method, unquote(split.path), query, headers, body)
        slot = Slot(keep_alive)
        self.pending.append(slot)
        try:
            response = self.handler(request, slot, self._deliver)
        except Exception as e:  # noqa: BLE001 - a handler bug must not kill the connection loop silently
            response = Response.error(500, f"internal error: {type(e).__name__}: {e}")
        if response is not None:
            self._deliver(slot, response)
        if not keep_alive:
            self.closing = True

    def _deliver(self, slot: Slot, response: Response) -> None:
        slot.response = response
        while self.pending and self.pending[0].response is not None:
            done = self.pending.popleft()
            if self.transport is None:
                continue
            self.transport.writelines(done.response.encode(done.keep_alive))
            if not done.keep_alive:
                self.transport.close()
                self.transport = None

    def _fail(self, status: int, message: str) -> None:
        """Answer a request that cannot be framed, then close (the stream is out of sync)."""
        self.closing = True
        slot = Slot(keep_alive=False)
        self.pending.append(slot)
        self._deliver(slot, Response.error(status, message))
