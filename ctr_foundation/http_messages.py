"""HTTP/1.1 messages for the one HTTP layer: strict request heads, body framing, requests and responses.

Strict on purpose (docs/contracts.md, "HTTP rules"): a request head must use
CRLF line ends only, hold no NUL or other control bytes, no obsolete line
folding and no whitespace before a header's colon; a body is framed by
exactly one ``Content-Length`` (duplicates must agree) or by
``Transfer-Encoding: chunked`` alone; chunk sizes are plain hex. Everything
else is a 400 (the connection is then closed: its framing can no longer be
trusted), so a body can never be read as a second request.
"""

from __future__ import annotations

import json
import re
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import BinaryIO
from urllib.parse import parse_qsl, unquote_to_bytes

import orjson

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
    408: "Request Timeout",
    409: "Conflict",
    411: "Length Required",
    413: "Payload Too Large",
    415: "Unsupported Media Type",
    417: "Expectation Failed",
    422: "Unprocessable Entity",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
    505: "HTTP Version Not Supported",
    507: "Insufficient Storage",
}

NO_BODY_METHODS = frozenset({"GET", "HEAD", "DELETE", "OPTIONS", "TRACE"})

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# name ":" OWS value OWS; the value holds visible bytes, spaces and tabs (obs-text allowed), nothing else.
_HEADER_LINE = re.compile(
    rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):[ \t]*((?:[\t\x20-\x7e\x80-\xff]*[\x21-\x7e\x80-\xff])?)[ \t]*"
)
_TARGET = re.compile(rb"/[\x21-\x7e]*")
_DIGITS = re.compile(r"[0-9]{1,19}")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,15}")  # a chunk of up to 2^60 - 1 bytes; every limit is far below


class HttpError(Exception):
    """A request the server answers with ``status`` and a JSON ``{"error": message}``.

    ``close``: the connection cannot carry another request (bad framing, or a
    body left unread). ``headers``: extra response headers (``Allow``, ``WWW-Authenticate``).
    """

    def __init__(self, status: int, message: str, *, close: bool = False, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.close = close
        self.headers = headers or {}

    def response(self) -> Response:
        return Response.error(self.status, self.message, headers=self.headers, close=self.close)


# ---- JSON bodies: the shared parser every JSON endpoint uses ----
# The body must be UTF-8, nested at most ``max_depth`` levels, with no integer literal longer than
# ``MAX_INT_DIGITS`` digits and no NaN/Infinity; anything else is an HttpError 400 naming the problem
# (never a hang, a 500 or a dropped connection).

DEFAULT_MAX_DEPTH = 64
MAX_INT_DIGITS = 40  # a uint64 has 20; longer literals are refused before Python converts them


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _bounded_int(text: str) -> int:
    if len(text) > MAX_INT_DIGITS and len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"integer literal of {len(text)} digits (at most {MAX_INT_DIGITS})")
    return int(text)


# Every integer literal goes through _bounded_int (the C scanner calls it only for integers, so bodies of
# strings, such as predict bodies of lines, pay nothing for it). A search of the body for long digit runs
# instead cost more than decoding: a 33 KB body of 32 Criteo lines 17 us (json 28 us), a 36 KB body of
# 1,248 19-digit feasigns 1.6 ms (the hook: +270 us). Built once: json.loads(text, **kwargs) builds a
# new decoder (and its C scanner) per call.
_DECODER = json.JSONDecoder(parse_constant=_refuse_constant, parse_int=_bounded_int)

# orjson decodes first (a 33 KB body of 32 Criteo lines: 16 us against json's 32 us, and counting its
# brackets for the depth check took 31 us more). Its answer is taken only where it is json's: orjson turns
# an integer literal beyond 64 bits into a float (json keeps the int, or refuses it past MAX_INT_DIGITS),
# so a float that large, or nesting past max_depth, sends the body through json's path above, which gives
# today's answer or message; so does anything orjson refuses (its messages differ from json's).
_WIDE = float(2**63)  # orjson keeps every integer literal in [-2**63, 2**64) an int


def _orjson_answer(obj, max_depth: int) -> bool:
    """Whether orjson's ``obj`` is json's answer too: nested at most ``max_depth`` levels, and no float of
    2**63 or more (an integer literal orjson did not keep as an int). One pass, level by level."""
    level, depth = [obj], 0
    while level:
        depth += 1
        below: list = []
        for o in level:
            t = type(o)
            if t is dict:
                if depth > max_depth:
                    return False
                below.extend(o.values())  # keys are strings
            elif t is list:
                if depth > max_depth:
                    return False
                below.extend(o)
            elif t is float and not -_WIDE < o < _WIDE:
                return False
        level = below
    return True


# The bytes nesting_depth looks at when a body has no backslash: quotes and brackets (a translate table).
_STRUCTURE = bytes(1 if c in b'"[]{}' else 0 for c in range(256))


def nesting_depth(data: bytes) -> int:
    """Deepest nesting of arrays/objects in JSON text ``data`` (brackets inside strings not counted)."""
    import numpy as np

    b = np.frombuffer(data, dtype=np.uint8)
    if not len(b):
        return 0
    if b"\\" not in data:  # no escapes (the usual case): only quotes and brackets matter, a few of the bytes
        b = b[np.flatnonzero(np.frombuffer(data.translate(_STRUCTURE), dtype=np.uint8))]
        quote = b == 34
    else:
        backslash = b == 92
        # length of the run of backslashes ending at each byte, to find the quotes that are not escaped
        count = np.cumsum(backslash, dtype=np.int64)
        run = count - np.maximum.accumulate(np.where(backslash, 0, count))
        before = np.concatenate(([0], run[:-1]))
        quote = (b == 34) & (before % 2 == 0)
    outside = (np.cumsum(quote) % 2 == 0) & ~quote
    delta = ((b == 91) | (b == 123)).astype(np.int64) - ((b == 93) | (b == 125))
    return int(np.max(np.cumsum(delta * outside), initial=0))


def parse_json(body: bytes, *, max_depth: int = DEFAULT_MAX_DEPTH, max_bytes: int | None = None):
    """``body`` as JSON; HttpError 400 (413 over ``max_bytes``) naming what is wrong with it."""
    if max_bytes is not None and len(body) > max_bytes:
        raise HttpError(413, f"JSON body of {len(body)} bytes exceeds the limit of {max_bytes}")
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        pass  # json's path names the problem (or takes what orjson cannot, e.g. a lone surrogate escape)
    else:
        if _orjson_answer(obj, max_depth):
            return obj
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HttpError(400, f"malformed JSON: the body is not valid UTF-8 (byte {e.start})") from None
    if body.count(b"[") + body.count(b"{") > max_depth and nesting_depth(body) > max_depth:
        raise HttpError(400, f"JSON nested deeper than {max_depth} levels")
    try:
        return _DECODER.decode(text)
    except RecursionError:
        raise HttpError(400, "JSON nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, and int conversion limits
        raise HttpError(400, f"malformed JSON: {e}") from None


def parse_json_object(body: bytes, **kwargs) -> dict:
    """``parse_json`` for endpoints that take a JSON object; an empty body is ``{}``."""
    if not body.strip():
        return {}
    obj = parse_json(body, **kwargs)
    if not isinstance(obj, dict):
        raise HttpError(400, f"the body must be a JSON object, not {type(obj).__name__}")
    return obj


@dataclass
class Request:
    """One request. ``path`` is percent-decoded (valid UTF-8, no NUL); ``raw_path`` as sent.

    ``body`` holds the whole body for in-memory routes; streaming routes read
    ``stream`` (a BodyReader) instead and ``body`` stays empty.
    """

    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]  # lower-case names; repeated headers joined with ", "
    body: bytes = b""
    raw_path: str = ""
    version: str = "HTTP/1.1"
    keep_alive: bool = True
    stream: BodyReader | None = None
    # framing, filled by parse_head
    content_length: int | None = None
    chunked: bool = False
    expect_continue: bool = False

    @property
    def has_body(self) -> bool:
        return self.chunked or bool(self.content_length)

    def json(self, *, max_depth: int | None = None):
        """The body as JSON through the shared parser (400 on anything that is not plain JSON)."""
        return parse_json(self.body, max_depth=max_depth or DEFAULT_MAX_DEPTH)


@dataclass
class FileBody:
    """A response body sent from an open file (``sendfile`` where the loop can), closed when sent."""

    file: BinaryIO
    offset: int
    size: int


@dataclass
class Response:
    status: int = 200
    body: bytes | list | FileBody = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)
    close: bool = False  # close the connection after this answer

    @classmethod
    def json(cls, obj, status: int = 200, headers: dict | None = None, *, indent: int | None = None) -> Response:
        text = json.dumps(obj, indent=indent, default=str) + "\n"
        return cls(status, text.encode(), "application/json", headers or {})

    @classmethod
    def error(cls, status: int, message: str, *, headers: dict | None = None, close: bool = False) -> Response:
        r = cls.json({"error": message}, status, headers)
        r.close = close
        return r

    def length(self) -> int:
        if isinstance(self.body, FileBody):
            return self.body.size
        if isinstance(self.body, list):
            return sum(len(p) for p in self.body)
        return len(self.body)

    def encode_head(self, keep_alive: bool) -> bytes:
        head = [
            f"HTTP/1.1 {self.status} {REASONS.get(self.status, 'Unknown')}",
            f"Content-Type: {self.content_type}",
            f"Content-Length: {self.length()}",
            "Connection: keep-alive" if keep_alive else "Connection: close",
        ]
        head += [f"{k}: {v}" for k, v in self.headers.items()]
        return "\r\n".join(head).encode("latin-1") + b"\r\n\r\n"

    def encode(self, keep_alive: bool, head_only: bool = False) -> list:
        """Head and body as a list of bytes (not for FileBody, which the protocol streams)."""
        if head_only:
            return [self.encode_head(keep_alive)]
        parts = self.body if isinstance(self.body, list) else [self.body]
        return [self.encode_head(keep_alive), *parts]


# The head of a 200 JSON answer, by keep-alive (``Response.encode_head``'s lines, prebuilt for the hot path).
_OK_JSON_START = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
_OK_JSON_HEADS = {
    keep: (_OK_JSON_START, b"\r\nConnection: " + word + b"\r\n\r\n")
    for keep, word in ((True, b"keep-alive"), (False, b"close"))
}


def ok_json_bytes(body: bytes, slot: Slot) -> bytes:
    """A whole 200 answer with a JSON ``body`` for ``slot``, head and body as one bytes, ready for the slot
    (what ``Response(200, body).encode`` writes, built on the caller's thread: serving's batch workers)."""
    start, end = _OK_JSON_HEADS[slot.keep_alive]
    if slot.head_only:
        return b"%s%d%s" % (start, len(body), end)
    return b"%s%d%s%s" % (start, len(body), end, body)


class Slot:
    """The place of one request's answer in its connection's ordered output."""

    __slots__ = ("response", "keep_alive", "head_only")

    def __init__(self, keep_alive: bool, head_only: bool = False):
        self.response = None  # a Response, or bytes already encoded (cube's fast path)
        self.keep_alive = keep_alive
        self.head_only = head_only


def media_type(headers: dict[str, str]) -> str:
    """The media type of a request's ``Content-Type`` (lower-cased, parameters dropped), "" when absent.

    Media types are case-insensitive and may carry parameters (RFC 9110 8.3.1): ``APPLICATION/JSON`` and
    ``application/json; charset=utf-8`` are both ``application/json``. Every server compares this, never the
    raw header.
    """
    return headers.get("content-type", "").partition(";")[0].strip().lower()


def parse_head(raw: bytes, *, max_headers: int = 100) -> Request:
    """Parse a request head (without its final blank line) strictly; raise HttpError (closing) if bad."""
    if b"\x00" in raw:
        raise HttpError(400, "NUL byte in the request head", close=True)
    lines = raw.split(b"\r\n")
    for line in lines:
        if b"\n" in line or b"\r" in line:
            raise HttpError(400, "bare LF or CR in the request head (lines must end with CRLF)", close=True)
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]):
        raise HttpError(400, f"malformed request line {lines[0][:80]!r}", close=True)
    method_b, target_b, version_b = parts
    if version_b not in (b"HTTP/1.1", b"HTTP/1.0"):
        if re.fullmatch(rb"HTTP/[0-9]\.[0-9]", version_b):  # a 400, not 505: bad input is always a 4xx here
            raise HttpError(400, f"{version_b.decode()} is not supported; use HTTP/1.1", close=True)
        raise HttpError(400, f"malformed request line {lines[0][:80]!r}", close=True)
    if not _TARGET.fullmatch(target_b):
        raise HttpError(400, f"request target must be a path starting with '/': {target_b[:80]!r}", close=True)
    if len(lines) - 1 > max_headers:
        raise HttpError(431, f"more than {max_headers} header lines", close=True)
    headers: dict[str, str] = {}
    lengths: list[str] = []
    encodings = 0
    for line in lines[1:]:
        if line[:1] in (b" ", b"\t"):
            raise HttpError(400, "obsolete line folding in the request head", close=True)
        m = _HEADER_LINE.fullmatch(line)
        if m is None:
            raise HttpError(400, f"malformed header line {line[:80]!r}", close=True)
        name = m.group(1).decode("ascii").lower()
        value = m.group(2).decode("latin-1")
        if name == "content-length":
            lengths.append(value)
        elif name == "transfer-encoding":
            encodings += 1
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    version = version_b.decode("ascii")
    req = Request(method_b.decode("ascii"), "", {}, headers, version=version)
    _framing(req, lengths, encodings)
    conn = {t.strip().lower() for t in headers.get("connection", "").split(",")}
    req.keep_alive = "close" not in conn if version == "HTTP/1.1" else "keep-alive" in conn
    expect = headers.get("expect")
    if expect is not None:
        if expect.lower() != "100-continue":
            raise HttpError(417, f"Expect: {expect[:40]!r} is not supported", close=True)
        req.expect_continue = True
    _target(req, target_b)
    return req


def _framing(req: Request, lengths: list[str], encodings: int) -> None:
    if encodings:
        if lengths:
            raise HttpError(400, "both Content-Length and Transfer-Encoding: send exactly one", close=True)
        te = req.headers["transfer-encoding"]
        if encodings > 1 or te.strip().lower() != "chunked":
            raise HttpError(400, f"Transfer-Encoding {te[:40]!r}: only 'chunked' is supported", close=True)
        if req.version == "HTTP/1.0":
            raise HttpError(400, "chunked bodies need HTTP/1.1", close=True)
        req.chunked = True
        return
    if lengths:
        if not all(_DIGITS.fullmatch(v) for v in lengths):
            raise HttpError(400, f"bad Content-Length {lengths[0][:40]!r}: expected a non-negative integer", close=True)
        if len(set(map(int, lengths))) > 1:
            raise HttpError(400, f"conflicting Content-Length headers {lengths[:3]}", close=True)
        req.content_length = int(lengths[0])


def _target(req: Request, target_b: bytes) -> None:
    raw_path, _, raw_query = target_b.partition(b"?")
    req.raw_path = raw_path.decode("ascii")
    try:
        path = unquote_to_bytes(raw_path).decode("utf-8")
    except UnicodeDecodeError:
        raise HttpError(400, "the path is not valid UTF-8 (after percent-decoding)") from None
    if "\x00" in path:
        raise HttpError(400, "NUL in the path")
    req.path = path
    if raw_query:
        try:
            pairs = parse_qsl(raw_query.decode("ascii"), keep_blank_values=True, errors="strict")
        except (UnicodeDecodeError, ValueError):
            raise HttpError(400, "the query string is not valid UTF-8") from None
        for k, v in pairs:
            if "\x00" in k or "\x00" in v:
                raise HttpError(400, "NUL in the query string")
            req.query[k] = v


class ChunkedDecoder:
    """Incremental ``Transfer-Encoding: chunked`` decoder with a total size limit.

    ``feed(data, pos)`` consumes from ``data[pos:]`` and returns (new pos,
    body pieces). Chunk sizes must be plain hex (no sign, no ``0x``, no
    spaces), every chunk must end with CRLF, trailers are bounded.
    """

    MAX_LINE = 4096
    MAX_TRAILERS = 16 * 1024

    def __init__(self, limit: int):
        self.limit = limit
        self.total = 0
        self.left = 0  # bytes of the current chunk still to come
        self.state = "size"  # size | data | crlf | trailer | done
        self.trailer_bytes = 0
        self.done = False

    def feed(self, data: bytes, pos: int) -> tuple[int, list[bytes]]:
        pieces: list[bytes] = []
        n = len(data)
        while pos < n and not self.done:
            if self.state == "data":
                take = min(self.left, n - pos)
                pieces.append(data[pos : pos + take])
                pos += take
                self.left -= take
                if self.left == 0:
                    self.state = "crlf"
                continue
            if self.state == "crlf":
                if n - pos < 2:
                    break
                if data[pos : pos + 2] != b"\r\n":
                    raise HttpError(400, "malformed chunked body: a chunk must end with CRLF", close=True)
                pos += 2
                self.state = "size"
                continue
            eol = data.find(b"\r\n", pos, pos + self.MAX_LINE)
            if eol < 0:
                if n - pos >= self.MAX_LINE or b"\n" in data[pos:n]:
                    raise HttpError(400, "malformed chunked body: bad chunk line", close=True)
                break
            line = data[pos:eol]
            pos = eol + 2
            if self.state == "trailer":
                self.trailer_bytes += len(line) + 2
                if self.trailer_bytes > self.MAX_TRAILERS:
                    raise HttpError(431, "chunked trailers too large", close=True)
                if line == b"":
                    self.done = True
                elif not _HEADER_LINE.fullmatch(line):
                    raise HttpError(400, f"malformed chunked trailer {line[:40]!r}", close=True)
                continue
            size_b = line.split(b";", 1)[0]
            if not _HEX.fullmatch(size_b) or (b";" in line and not _valid_extensions(line)):
                raise HttpError(400, f"malformed chunk size {line[:40]!r}: expected hex digits", close=True)
            size = int(size_b, 16)
            if size == 0:
                self.state = "trailer"
                continue
            self.total += size
            if self.total > self.limit:
                raise HttpError(413, f"chunked body exceeds the size limit of {self.limit} bytes", close=True)
            self.left = size
            self.state = "data"
        return pos, pieces


def _valid_extensions(line: bytes) -> bool:
    return all(0x20 <= b < 0x7F or b == 0x09 for b in line)


class BodyReader:
    """A streamed request body, read by a handler thread while the event loop receives it.

    ``read(n)`` blocks until bytes arrive; ``b""`` means the body ended
    (complete); a framing error, a timeout or a vanished client raise from
    ``read``. Flow control: the loop stops reading the socket while more than
    ``high`` bytes wait here, and resumes once the reader drained them.
    """

    def __init__(self, *, high: int, on_drained):
        self._cond = threading.Condition()
        self._pieces: deque[bytes] = deque()
        self._buffered = 0
        self._high = high
        self._on_drained = on_drained  # called (from the reader thread) when the buffer fell below high/2
        self._error: BaseException | None = None
        self._ended = False
        self.received = 0
        self.complete = False  # the whole body was read by the handler

    # ---- loop side
    def push(self, piece: bytes) -> bool:
        """Queue a piece; True when the loop should pause reading."""
        with self._cond:
            self._pieces.append(piece)
            self._buffered += len(piece)
            self.received += len(piece)
            self._cond.notify()
            return self._buffered > self._high

    def end(self) -> None:
        with self._cond:
            self._ended = True
            self._cond.notify()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            if not self._ended:
                self._error = error
            self._cond.notify()

    @property
    def ended(self) -> bool:
        return self._ended

    # ---- handler side
    def read(self, n: int = -1) -> bytes:
        with self._cond:
            while not self._pieces and not self._ended and self._error is None:
                self._cond.wait()
            if not self._pieces:
                if self._error is not None:
                    raise self._error
                self.complete = True
                return b""
            piece = self._pieces.popleft()
            if 0 <= n < len(piece):
                self._pieces.appendleft(piece[n:])
                piece = piece[:n]
            before = self._buffered
            self._buffered -= len(piece)
            drained = before > self._high // 2 >= self._buffered
        if drained:
            self._on_drained()
        return piece

    def __iter__(self):
        while True:
            piece = self.read()
            if not piece:
                return
            yield piece
