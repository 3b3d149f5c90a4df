"""A seeded, bounded HTTP fuzzer for ElasticCTR's servers (tests/test_http_fuzz.py).

Each case starts from one of a server's valid requests and mutates it (bytes,
request line, headers, framing, body size and content, pipelining), or is
plain random bytes; it is sent on a new connection, which is then
half-closed, and everything the server sends back is checked:

- only well-formed HTTP/1.1 responses (status line, headers, Content-Length,
  exactly that much body), and the connection ends (no hang);
- no 5xx (a server may list the ones a downstream failure legitimately
  gives, e.g. cube-agent's 502 for a download that cannot be fetched);
- no silence: a request with a complete head and no body framing gets an answer;
- every ``check_every`` cases, and at the end, a good request still works;
- the server's resident memory stays within ``rss_growth_mb`` of what it was
  after the first cases.

The same seed gives the same cases, so a failure names seed and case number
and can be replayed.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from helpers_http import exchange, parse_answers, rss_mb

NASTY_HEADERS = [
    b"Content-Length: 5\r\nContent-Length: 6",
    b"Content-Length: -1",
    b"Content-Length: 99999999999999999999",
    b"Content-Length: 1e3",
    b"Content-Length: 0x10",
    b"Content-Length: 4, 4",
    b"Content-Length: 100000000",
    b"Transfer-Encoding: chunked",
    b"Transfer-Encoding: gzip",
    b"Transfer-Encoding: chunked, chunked",
    b"Transfer-Encoding: identity",
    b"Expect: 100-continue",
    b"Expect: bogus",
    b"Connection: close",
    b"Connection: keep-alive, close",
    b"X-Folded: a\r\n b",
    b"X-Bare: a\nY: b",
    b"X-Nul: a\x00b",
    b"X-Cr: a\rb",
    b"Bad Name: x",
    b"Space-Before : colon",
    b":empty-name",
    b"X-Long: " + b"a" * 20000,
    b"X-Ctl: \x01\x02",
    b"X-High: \xff\xfe",
    b"Authorization: Bearer wrong",
    b"Authorization: Basic Zm9vOmJhcg==",
    b"Authorization: Bearer",
    b"Content-Type: application/json",
    b"Content-Type: application/octet-stream",
    b"Host: ",
]
METHODS = [b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"PATCH", b"BREW", b"get", b"G ET", b"", b"X" * 300]
TARGETS = [
    b"/",
    b"//",
    b"/%00",
    b"/a%00b",
    b"/%ff%fe",
    b"/%c3%28",
    b"/../../etc/passwd",
    b"/files/%2e%2e/x",
    b"/v1/lookup?version=%ff",
    b"/v1/lookup?version=%00",
    b"/v1/lookup?version=" + b"v" * 3000,
    b"/" + b"p" * 20000,
    b"*",
    b"http://example.com/",
    b"/?" + b"&" * 5000,
    b"/healthz#frag",
    b"/\x7f",
    b"/a b",
]
VERSIONS = [b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.1x", b"HTTP/1.", b"", b"http/1.1", b"HTTP/1.1 extra"]
JSON_BODIES = [
    b"[" * 50_000 + b"]" * 50_000,
    b'{"a":' * 3000 + b"1" + b"}" * 3000,
    b'{"version": ' + b"9" * 5000 + b"}",
    b'{"keys": [' + b"1" * 45 + b"]}",
    b'{"version": NaN}',
    b'{"version": "\xff\xfe"}',
    b'{"version": "a\\u0000b"}',
    b"[]",
    b"null",
    b'"just a string"',
    b"{",
    b'{"keys": "123"}',
    b'{"keys": [-1, 1.9, true, null, "x", [1], {}]}',
    b'{"instances": [{"line": "1 0 \xc2\xb2:1"}]}',
    b'{"instances": [{"slots": {"1": ["' + b"9" * 4300 + b'"]}}]}',
    b'{"instances": 5}',
    b'{"instances": [' + b"{}," * 20000 + b"{}]}",
]
SIZES = [0, 1, 7, 8, 9, 100, 4096, 65536, 1 << 20, 3 << 20, 9 << 20]


def _split(req: bytes) -> tuple[bytes, list[bytes], bytes]:
    end = req.find(b"\r\n\r\n")
    if end < 0:
        return req, [], b""
    lines = req[:end].split(b"\r\n")
    return lines[0], lines[1:], req[end + 4 :]


def _join(line: bytes, headers: list[bytes], body: bytes) -> bytes:
    return b"\r\n".join([line, *headers]) + b"\r\n\r\n" + body


def _fix_length(headers: list[bytes], body: bytes) -> list[bytes]:
    kept = [h for h in headers if not h.lower().startswith((b"content-length:", b"transfer-encoding:"))]
    return kept + [b"Content-Length: %d" % len(body)]


class Mutator:
    """Seeded mutations of valid requests."""

    def __init__(self, rng: random.Random, token: str | None):
        self.rng = rng
        self.token = token.encode() if token else None
        self.ops: list[Callable[[bytes], bytes]] = [
            self.flip,
            self.insert,
            self.delete,
            self.duplicate,
            self.truncate,
            self.add_header,
            self.drop_header,
            self.method,
            self.target,
            self.version,
            self.body,
            self.rechunk,
            self.json_body,
            self.pipeline,
            self.random_bytes,
            self.auth,
        ]

    def mutate(self, req: bytes, seeds: list[bytes]) -> bytes:
        self._seeds = seeds
        for _ in range(self.rng.choice((1, 1, 1, 2, 3))):
            req = self.rng.choice(self.ops)(req)
        return req

    def flip(self, req):
        b = bytearray(req)
        for _ in range(self.rng.randint(1, 4)):
            if b:
                b[self.rng.randrange(len(b))] = self.rng.randrange(256)
        return bytes(b)

    def insert(self, req):
        at = self.rng.randrange(len(req) + 1)
        return (
            req[:at]
            + self.rng.choice([b"\r", b"\n", b"\x00", b" ", b":", b"\t", b"%", b"\xff", b"\r\n", b"\r\n\r\n"])
            + req[at:]
        )

    def delete(self, req):
        if not req:
            return req
        a = self.rng.randrange(len(req))
        return req[:a] + req[a + self.rng.randint(1, 20) :]

    def duplicate(self, req):
        if not req:
            return req
        a = self.rng.randrange(len(req))
        b = min(len(req), a + self.rng.randint(1, 200))
        return req[:b] + req[a:b] + req[b:]

    def truncate(self, req):
        return req[: self.rng.randrange(len(req) + 1)]

    def add_header(self, req):
        line, headers, body = _split(req)
        headers.insert(self.rng.randrange(len(headers) + 1), self.rng.choice(NASTY_HEADERS))
        if self.rng.random() < 0.05:
            headers += [b"X-Many-%d: y" % i for i in range(150)]
        return _join(line, headers, body)

    def drop_header(self, req):
        line, headers, body = _split(req)
        if headers:
            headers.pop(self.rng.randrange(len(headers)))
        return _join(line, headers, body)

    def method(self, req):
        line, headers, body = _split(req)
        parts = line.split(b" ", 1)
        return _join(self.rng.choice(METHODS) + b" " + (parts[1] if len(parts) > 1 else b""), headers, body)

    def target(self, req):
        line, headers, body = _split(req)
        parts = line.split(b" ")
        if len(parts) >= 3:
            parts[1] = self.rng.choice(TARGETS) if self.rng.random() < 0.7 else parts[1] + self.rng.choice(TARGETS)
        return _join(b" ".join(parts), headers, body)

    def version(self, req):
        line, headers, body = _split(req)
        parts = line.split(b" ")
        parts[-1] = self.rng.choice(VERSIONS)
        return _join(b" ".join(parts), headers, body)

    def body(self, req):
        line, headers, _ = _split(req)
        size = self.rng.choice(SIZES)
        body = self.rng.randbytes(min(size, 4096)) * (size // 4096 + 1)
        body = body[:size]
        if self.rng.random() < 0.8:
            headers = _fix_length(headers, body)
        return _join(line, headers, body)

    def rechunk(self, req):
        line, headers, body = _split(req)
        headers = [h for h in headers if not h.lower().startswith((b"content-length:", b"transfer-encoding:"))]
        headers.append(b"Transfer-Encoding: chunked")
        out, pos = [], 0
        while pos < len(body):
            n = self.rng.randint(1, max(1, len(body) // 3 + 1))
            out.append(b"%x\r\n%s\r\n" % (n, body[pos : pos + n]))
            pos += n
        out.append(b"0\r\n\r\n")
        if self.rng.random() < 0.5:
            bad = self.rng.choice([b"-1", b"zz", b"0x10", b" 5", b"fffffffffffffffffff", b"5;\x00", b"", b"10000000"])
            out.insert(self.rng.randrange(len(out) + 1), bad + b"\r\n")
        if self.rng.random() < 0.2:
            out[-1] = out[-1][:-2]  # no final CRLF
        return _join(line, headers, b"".join(out))

    def json_body(self, req):
        line, headers, _ = _split(req)
        body = self.rng.choice(JSON_BODIES)
        return _join(line, _fix_length(headers, body) + [b"Content-Type: application/json"], body)

    def pipeline(self, req):
        other = self.rng.choice(self._seeds)
        if self.rng.random() < 0.5:
            other = self.rng.choice([op for op in self.ops if op != self.pipeline])(other)
        return req + other

    def random_bytes(self, req):
        return self.rng.randbytes(self.rng.randint(0, 3000))

    def auth(self, req):
        line, headers, body = _split(req)
        headers = [h for h in headers if not h.lower().startswith(b"authorization:")]
        if self.token and self.rng.random() < 0.7:
            headers.append(b"Authorization: Bearer " + self.token)
        return _join(line, headers, body)


@dataclass
class Target:
    name: str
    port: int
    pid: int
    seeds: list[bytes]  # valid requests (with the token where they need it)
    check_good: Callable[[], None]  # raises AssertionError unless a good request works
    token: str | None = None
    allowed_5xx: frozenset[int] = frozenset()
    rss_growth_mb: float = 64.0
    alive: Callable[[], bool] = lambda: True
    host: str = "127.0.0.1"  # a pod's IP in the pod harness


@dataclass
class Report:
    cases: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    silent: int = 0
    rss_start: float = 0.0
    rss_max: float = 0.0
    seconds: float = 0.0

    def summary(self) -> str:
        top = ", ".join(f"{s}x{n}" for s, n in sorted(self.statuses.items()))
        return (
            f"{self.cases} cases in {self.seconds:.1f}s; statuses {top}; {self.silent} closed unanswered; "
            f"RSS {self.rss_start:.0f} -> max {self.rss_max:.0f} MiB"
        )


def _declares_body(data: bytes) -> bool:
    low = data.lower()
    return b"content-length" in low or b"transfer-encoding" in low


def fuzz(target: Target, *, seed: int, seconds: float, check_every: int = 25, warmup: int = 40) -> Report:
    """Run cases for ``seconds`` (at least ``warmup + 1``); AssertionError naming seed and case on a fault."""
    rng = random.Random(seed)
    mut = Mutator(rng, target.token)
    report = Report()
    start = time.monotonic()
    target.check_good()
    report.rss_start = report.rss_max = rss_mb(target.pid)
    case = 0
    while case <= warmup or time.monotonic() - start < seconds:
        case += 1
        base = rng.choice(target.seeds)
        data = base if rng.random() < 0.05 else mut.mutate(base, target.seeds)
        where = f"{target.name} seed {seed} case {case}: {data[:300]!r}{'...' if len(data) > 300 else ''}"
        try:
            reply = exchange(target.port, data, timeout=20, host=target.host)
            answers = parse_answers(reply, head_request=b"HEAD " in data)
        except AssertionError as e:
            raise AssertionError(f"{where}\n  -> {e}") from None
        for a in answers:
            report.statuses[a.status] = report.statuses.get(a.status, 0) + 1
            assert a.status < 500 or a.status in target.allowed_5xx, f"{where}\n  -> {a.status}: {a.body[:300]!r}"
        if not answers:
            report.silent += 1
            rest = data
            while rest.startswith(b"\r\n"):  # empty lines before a request are no request (RFC 9112 2.2)
                rest = rest[2:]
            complete_head = b"\r\n\r\n" in rest[: 16 * 1024 + 4]
            assert not complete_head or _declares_body(data), f"{where}\n  -> closed without an answer"
        if case == warmup:
            report.rss_start = rss_mb(target.pid)
        if case % check_every == 0:
            assert target.alive(), f"{where}\n  -> the server died"
            target.check_good()
            report.rss_max = max(report.rss_max, rss_mb(target.pid))
    assert target.alive(), f"{target.name}: the server died"
    target.check_good()
    report.rss_max = max(report.rss_max, rss_mb(target.pid))
    report.cases = case
    report.seconds = time.monotonic() - start
    growth = report.rss_max - report.rss_start
    assert growth < target.rss_growth_mb, f"{target.name}: RSS grew {growth:.0f} MiB ({report.summary()})"
    return report
