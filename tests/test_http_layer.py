"""The one HTTP layer (ctr_foundation.http_*): parsing rules, the token rule, the JSON parser, and a real
HttpServer on loopback with short limits (time-outs, connection cap, backpressure, streaming, pipelining)."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time

import pytest
from helpers_http import exchange, parse_answers, request

from ctr_foundation.errors import ComponentError
from ctr_foundation.http_auth import check_bearer, token_matches
from ctr_foundation.http_json import JsonRoute, downstream_status, make_json_server
from ctr_foundation.http_messages import (
    ChunkedDecoder,
    HttpError,
    Response,
    Slot,
    media_type,
    nesting_depth,
    ok_json_bytes,
    parse_head,
    parse_json,
)
from ctr_foundation.http_protocol import LOOP, STREAM, THREAD, HttpProtocol, Route
from ctr_foundation.http_server import HttpLimits, HttpServer

# ---- request heads --------------------------------------------------------------------------------

GOOD = b"POST /v1/x?version=a%2Fb&n=1 HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\nX-A: 1\r\nX-A: 2"


def test_a_plain_head_parses():
    r = parse_head(GOOD)
    assert (r.method, r.path, r.raw_path, r.query) == ("POST", "/v1/x", "/v1/x", {"version": "a/b", "n": "1"})
    assert r.content_length == 5 and not r.chunked and r.keep_alive and r.headers["x-a"] == "1, 2"
    assert parse_head(b"GET / HTTP/1.0").keep_alive is False
    assert parse_head(b"GET / HTTP/1.1\r\nConnection: close").keep_alive is False
    assert parse_head(b"PUT /f HTTP/1.1\r\nTransfer-Encoding: Chunked").chunked
    assert parse_head(b"PUT /f HTTP/1.1\r\nContent-Length: 7\r\nContent-Length: 7").content_length == 7


BAD_HEADS = {
    b"GET / HTTP/1.1\r\nHost: a\nX: b": (400, "bare LF"),
    b"GET / HTTP/1.1\r\nHost: a\rX: b": (400, "bare LF or CR"),
    b"GET / HTTP/1.1\r\nHost: a\x00": (400, "NUL"),
    b"GET / HTTP/1.1\r\nX: a\r\n b": (400, "folding"),
    b"GET / HTTP/1.1\r\nX : a": (400, "malformed header"),
    b"GET / HTTP/1.1\r\nX\x01: a": (400, "malformed header"),
    b"GET / HTTP/1.1\r\nX: a\x7f": (400, "malformed header"),
    b"GET / HTTP/1.1\r\nnocolon": (400, "malformed header"),
    b"GET  / HTTP/1.1": (400, "request line"),
    b"GET / HTTP/1.1 x": (400, "request line"),
    b"G(T / HTTP/1.1": (400, "request line"),
    b"GET / HTTP/2.0": (400, "not supported"),
    b"GET / FTP/1.1": (400, "request line"),
    b"GET http://evil/ HTTP/1.1": (400, "target"),
    b"GET /\x80 HTTP/1.1": (400, "target"),
    b"GET /a%ff HTTP/1.1": (400, "UTF-8"),
    b"GET /a%00 HTTP/1.1": (400, "NUL"),
    b"GET /a?x=%ff HTTP/1.1": (400, "UTF-8"),
    b"GET /a?x=%00 HTTP/1.1": (400, "NUL"),
    b"PUT / HTTP/1.1\r\nContent-Length: -1": (400, "Content-Length"),
    b"PUT / HTTP/1.1\r\nContent-Length: 1e3": (400, "Content-Length"),
    b"PUT / HTTP/1.1\r\nContent-Length: 5, 5": (400, "Content-Length"),
    b"PUT / HTTP/1.1\r\nContent-Length: 99999999999999999999": (400, "Content-Length"),
    b"PUT / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6": (400, "conflicting"),
    b"PUT / HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked": (400, "exactly one"),
    b"PUT / HTTP/1.1\r\nTransfer-Encoding: gzip": (400, "only 'chunked'"),
    b"PUT / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked": (400, "only 'chunked'"),
    b"PUT / HTTP/1.0\r\nTransfer-Encoding: chunked": (400, "HTTP/1.1"),
    b"PUT / HTTP/1.1\r\nExpect: 200-ok": (417, "Expect"),
}


@pytest.mark.parametrize("raw", list(BAD_HEADS), ids=lambda r: repr(r)[:60])
def test_bad_heads_are_refused_naming_the_problem(raw):
    status, words = BAD_HEADS[raw]
    with pytest.raises(HttpError, match=words) as e:
        parse_head(raw)
    assert e.value.status == status


def test_too_many_headers_is_431():
    raw = b"GET / HTTP/1.1" + b"".join(b"\r\nX-%d: y" % i for i in range(101))
    with pytest.raises(HttpError) as e:
        parse_head(raw)
    assert e.value.status == 431


# ---- chunked bodies -------------------------------------------------------------------------------


def _decode(data: bytes, limit: int = 1 << 20, step: int | None = None) -> bytes:
    dec, out, buf = ChunkedDecoder(limit), [], b""
    for i in range(0, len(data), step or len(data)):
        buf += data[i : i + (step or len(data))]
        pos, pieces = dec.feed(buf, 0)
        buf = buf[pos:]
        out += pieces
    assert dec.done
    return b"".join(out)


def test_chunked_bodies_decode_whatever_the_split():
    data = b"5\r\nhello\r\n1;ext=1\r\n \r\nA\r\n0123456789\r\n0\r\nTrailer: x\r\n\r\n"
    for step in (None, 1, 2, 3, 7):
        assert _decode(data, step=step) == b"hello 0123456789"


@pytest.mark.parametrize(
    "data",
    [
        b"-1\r\nx",
        b"0x5\r\nhello\r\n0\r\n\r\n",
        b" 5\r\nhello\r\n0\r\n\r\n",
        b"5 \r\nhello\r\n0\r\n\r\n",
        b"zz\r\n",
        b"5\r\nhelloXX0\r\n\r\n",
        b"5\nhello\r\n0\r\n\r\n",
        b"1" * 20 + b"\r\n",
        b"+5\r\nhello\r\n0\r\n\r\n",
        b"0\r\nbad trailer\r\n\r\n",
    ],
)
def test_bad_chunk_framing_is_400(data):
    with pytest.raises(HttpError) as e:
        ChunkedDecoder(1 << 20).feed(data, 0)
    assert e.value.status == 400 and e.value.close


def test_chunked_size_limit_holds_across_chunks():
    with pytest.raises(HttpError) as e:
        _decode(b"8\r\n12345678\r\n8\r\n12345678\r\n0\r\n\r\n", limit=15)
    assert e.value.status == 413


# ---- the token ------------------------------------------------------------------------------------


def test_the_token_rule():
    assert token_matches({"authorization": "Bearer s3cret"}, "s3cret")
    assert token_matches({"authorization": "bearer  s3cret "}, "s3cret")
    for headers in (
        {},
        {"authorization": "Bearer s3cre"},
        {"authorization": "Basic s3cret"},
        {"authorization": "s3cret"},
    ):
        assert not token_matches(headers, "s3cret")
        with pytest.raises(HttpError) as e:
            check_bearer(headers, "s3cret")
        assert e.value.status == 401 and e.value.headers["WWW-Authenticate"].startswith("Bearer")
    with pytest.raises(HttpError, match="ELASTIC_CTR_TOKEN") as e:
        check_bearer({"authorization": "Bearer s3cret"}, None)
    assert e.value.status == 403
    assert not token_matches({"authorization": "Bearer "}, "")


# ---- the JSON parser ------------------------------------------------------------------------------


def test_nesting_depth_ignores_brackets_inside_strings():
    assert nesting_depth(b'{"a": [1, {"b": "[[[[\\"]]"}]}') == 3
    assert nesting_depth(b'["\\\\", [[]]]') == 3
    assert nesting_depth(b'"[[["') == 0


@pytest.mark.parametrize(
    "body, words",
    [
        (b"[" * 65 + b"]" * 65, "nested deeper"),
        (b"\xff", "UTF-8"),
        (b"[" + b"1" * 41 + b"]", "digits"),
        (b'{"x": "' + b"1 0 12:3 " * 3000 + b'", "n": -' + b"7" * 45 + b"}", "digits"),  # far into a large body
        (b"NaN", "not valid JSON"),
        (b'{"a": Infinity}', "not valid JSON"),
        (b"{", "malformed"),
        (b'{"a": 1} x', "malformed"),
    ],
)
def test_parse_json_refuses_with_a_400_and_a_reason(body, words):
    with pytest.raises(HttpError, match=words) as e:
        parse_json(body)
    assert e.value.status == 400


def test_parse_json_accepts_plain_json():
    assert parse_json(b"[" * 64 + b"]" * 64) == parse_json(b"[" * 64 + b"]" * 64)
    assert parse_json(b'{"k": [18446744073709551615, "x[{"], "f": 1.5}') == {
        "k": [2**64 - 1, "x[{"],
        "f": 1.5,
    }
    assert parse_json(b'{"s": "' + b"9" * 100 + b'"}') == {"s": "9" * 100}  # long digit runs in strings are fine
    assert parse_json(b"[-" + b"9" * 40 + b", 1e5]") == [-int("9" * 40), 1e5]  # 40 digits: the limit itself


@pytest.mark.parametrize(
    "body",
    [
        b"18446744073709551616",  # 2**64: orjson gives a float, json the int
        b"[-9223372036854775809, 9223372036854775808]",  # below -2**63 (a float in orjson) and within uint64
        b'{"a": [1, {"b": ' + b"9" * 25 + b"}]}",
        b'{"s": "\\ud800"}',  # a lone surrogate escape: orjson refuses it, json takes it
        b"1e400",  # orjson refuses the infinity, json gives inf
        b'{"x": [1.5, -0.0, 1e-7, "\\u00e9"], "y": null, "z": true}',
        b"[" * 64 + b"]" * 64,
    ],
)
def test_parse_json_gives_what_the_standard_library_gives(body):
    """orjson decodes first; where its answer could differ (integers beyond 64 bits, what it refuses) the
    standard library's is taken, so the result is json's, type for type."""
    got = parse_json(body)
    want = json.loads(body)
    assert got == want and repr(got) == repr(want)


@pytest.mark.parametrize("keep_alive, head_only", [(True, False), (False, False), (True, True)])
def test_a_prebuilt_json_answer_is_what_response_encodes(keep_alive, head_only):
    body = b'{"predictions": [0.5]}\n'
    want = b"".join(Response(200, body).encode(keep_alive, head_only))
    assert ok_json_bytes(body, Slot(keep_alive, head_only)) == want


def test_parse_json_nesting_is_checked_on_orjson_answers_too():
    deep = b'{"instances": [], "x": ' + b"[" * 70 + b"]" * 70 + b"}"  # 71 levels, few enough for orjson
    with pytest.raises(HttpError, match="nested deeper than 64") as e:
        parse_json(deep)
    assert e.value.status == 400
    assert parse_json(deep, max_depth=80)["x"] == json.loads(deep)["x"]


def test_downstream_errors_keep_their_meaning():
    class Err(ComponentError):
        def __init__(self, status):
            super().__init__("x")
            self.status = status

    assert downstream_status(Err(409)) == 409
    assert downstream_status(Err(422)) == 422
    assert downstream_status(Err(401)) == 502  # our token was refused downstream, not the caller's
    assert downstream_status(Err(503)) == 502
    assert downstream_status(ComponentError("unreachable")) == 502


# ---- a real server with short limits --------------------------------------------------------------


class App:
    """Routes exercising each mode; /later answers from another thread after a delay (like merged lookups)."""

    def __init__(self):
        self.uploaded = 0
        self.max_waiting = 0

    def route(self, req):
        if req.path == "/loop":
            return Route(lambda r, slot, deliver: Response.json({"n": r.query.get("n")}), LOOP, max_body=1 << 20)
        if req.path == "/later":

            def later(r, slot, deliver):
                loop = server_loop[0]
                delay = float(r.query.get("d", "0"))
                threading.Timer(
                    delay, lambda: loop.call_soon_threadsafe(deliver, slot, Response.json({"n": r.query["n"]}))
                ).start()

            return Route(later, LOOP)
        if req.path == "/thread":
            return Route(lambda r: Response.json({"len": len(r.body)}), THREAD, max_body=1 << 20)
        if req.path == "/big":
            return Route(lambda r: Response(200, b"z" * (32 << 20), "application/octet-stream"), THREAD)
        if req.path == "/upload":

            def upload(r):
                n = 0
                for piece in r.stream:
                    n += len(piece)
                    self.max_waiting = max(self.max_waiting, r.stream._buffered)
                    time.sleep(0.002)  # a slow disk: the socket must stop being read, not the memory grow
                self.uploaded = n
                return Response.json({"size": n}, 201)

            return Route(upload, STREAM, token=True, max_body=256 << 20)
        raise HttpError(404, "no such path")


server_loop: list = []


@contextlib.contextmanager
def running(limits: HttpLimits, app=None, protocol_factory=HttpProtocol):
    server = HttpServer(
        app or App(), port=0, token="tok", name="test", limits=limits, protocol_factory=protocol_factory
    )
    server.start_in_thread(on_started=lambda s: server_loop.__setitem__(slice(None), [s.loop]))
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


FAST = HttpLimits(header_timeout=0.5, idle_timeout=0.8, body_timeout=0.5, write_timeout=1.0, max_connections=8)


def _closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    sock.settimeout(seconds)
    data = b""
    try:
        while True:
            piece = sock.recv(65536)
            if not piece:
                return True, data
            data += piece
    except TimeoutError:
        return False, data
    except ConnectionResetError:
        return True, data


def test_header_idle_and_body_timeouts():
    with running(FAST) as server:
        partial = socket.create_connection(("127.0.0.1", server.port))
        partial.sendall(b"GET /loop HTTP/1.1\r\nHost: x\r\n")
        silent = socket.create_connection(("127.0.0.1", server.port))
        idle = socket.create_connection(("127.0.0.1", server.port))
        idle.sendall(request("GET", "/loop?n=1"))
        body = socket.create_connection(("127.0.0.1", server.port))
        body.sendall(request("POST", "/loop", {"Content-Length": "100"}) + b"x" * 10)
        t0 = time.monotonic()
        closed, data = _closed_within(partial, 3)
        assert closed and data.startswith(b"HTTP/1.1 408 ") and time.monotonic() - t0 < 2
        assert _closed_within(silent, 3) == (True, b"")
        closed, data = _closed_within(idle, 3)
        assert closed and [a.status for a in parse_answers(data)] == [200]
        closed, data = _closed_within(body, 3)
        assert closed and data.startswith(b"HTTP/1.1 408 ")
        # a slow but steady client is not cut off: one byte every 0.2 s of a body is progress
        steady = socket.create_connection(("127.0.0.1", server.port))
        steady.sendall(request("POST", "/thread", {"Content-Length": "8"}))
        for _ in range(8):
            time.sleep(0.2)
            steady.sendall(b"x")
        closed, data = _closed_within(steady, 0.5)
        assert parse_answers(data)[0].status == 200


def test_connection_cap_answers_503_at_once_and_recovers():
    """Over the cap with every connection waiting for an answer (none idle to evict): 503 at once."""
    with running(FAST) as server:
        held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(8)]
        for s in held:
            s.sendall(request("GET", "/later?n=0&d=1"))
        time.sleep(0.2)
        t0 = time.monotonic()
        reply = exchange(server.port, request("GET", "/loop?n=1"), timeout=3)
        assert parse_answers(reply)[0].status == 503 and time.monotonic() - t0 < 1
        for s in held:
            s.settimeout(5)
            assert s.recv(4096).startswith(b"HTTP/1.1 200 ")
            s.close()
        time.sleep(0.2)
        assert parse_answers(exchange(server.port, request("GET", "/loop?n=2")))[0].status == 200


def test_a_client_that_never_reads_is_dropped_and_memory_is_bounded():
    with running(FAST) as server:
        s = socket.create_connection(("127.0.0.1", server.port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        s.sendall(request("GET", "/big") * 20)  # 20 answers of 32 MiB, never read
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any(c._write_paused for c in list(server.connections)):
            time.sleep(0.02)
        [conn] = list(server.connections)
        assert conn._write_paused and conn.requests == 1  # it stopped parsing the other 19 requests
        assert conn.transport.get_write_buffer_size() <= (32 << 20)
        closed, _ = _closed_within(s, 5)  # dropped after write_timeout (1 s here)
        deadline = time.monotonic() + 2
        while server.connections and time.monotonic() < deadline:
            time.sleep(0.02)
        assert closed and not server.connections


def test_pipelined_answers_come_back_in_request_order():
    with running(HttpLimits()) as server:
        reqs = b"".join(request("GET", f"/later?n={i}&d={0.3 - i * 0.05:.2f}") for i in range(6))
        reqs += request("GET", "/loop?n=last", {"Connection": "close"})
        answers = parse_answers(exchange(server.port, reqs))
        assert [json.loads(a.body)["n"] for a in answers] == ["0", "1", "2", "3", "4", "5", "last"]


def test_head_answers_carry_no_body_and_get_bodies_are_refused():
    with running(HttpLimits()) as server:
        reply = exchange(server.port, request("HEAD", "/thread") + request("GET", "/loop?n=1"))
        assert reply.count(b"HTTP/1.1 200") == 2 and reply.split(b"\r\n\r\n")[1].startswith(b"HTTP/1.1 200")
        smuggle = request("GET", "/loop?n=2")
        answers = parse_answers(
            exchange(server.port, request("GET", "/loop?n=1", {"Content-Length": str(len(smuggle))}) + smuggle)
        )
        assert [a.status for a in answers] == [400]


def test_streamed_uploads_are_read_as_they_arrive_with_bounded_buffers():
    app = App()
    with running(HttpLimits(stream_buffer=1 << 20), app) as server:
        total = 64 << 20
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(request("PUT", "/upload", {"Authorization": "Bearer tok", "Content-Length": str(total)}))
        piece = b"u" * (1 << 20)
        for _ in range(total // len(piece)):
            s.sendall(piece)
        _, early = _closed_within(s, 0.1)
        s.shutdown(socket.SHUT_WR)
        closed, data = _closed_within(s, 30)
        assert closed and parse_answers(early + data)[0].status == 201 and app.uploaded == total
        # the socket is not read while 1 MiB waits for the handler (plus at most a read or two)
        assert app.max_waiting <= (1 << 20) + (512 << 10), f"{app.max_waiting} bytes waited for the handler"


def test_expect_continue_is_sent_only_after_the_token_was_checked():
    with running(HttpLimits()) as server:
        head = b"PUT /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nExpect: 100-continue\r\n"
        refused = exchange(server.port, head + b"\r\n")
        assert [a.status for a in parse_answers(refused)] == [401]
        s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        s.sendall(head + b"Authorization: Bearer tok\r\n\r\n")
        assert s.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(b"abc")
        s.shutdown(socket.SHUT_WR)
        _, data = _closed_within(s, 5)
        assert [a.status for a in parse_answers(data)] == [201]


def test_json_services_route_and_refuse():
    routes = {
        ("GET", "/v1/status"): JsonRoute(lambda b: (200, {"ok": True})),
        ("POST", "/v1/do"): JsonRoute(lambda b: (200, b), write=True, max_body=100),
    }
    server = make_json_server(host="127.0.0.1", port=0, routes=routes, token="tok", name="svc")
    server.start_in_thread()
    try:

        def ask(raw):
            return parse_answers(exchange(server.port, raw))[0]

        assert ask(request("GET", "/v1/status")).status == 200
        assert parse_answers(exchange(server.port, request("HEAD", "/v1/status")), head_request=True)[0].status == 200
        assert ask(request("DELETE", "/v1/status")).headers["allow"] == "GET"
        assert ask(request("GET", "/v1/nope")).status == 404
        assert ask(request("POST", "/v1/do", {}, b"{}")).status == 401
        auth = {"Authorization": "Bearer tok"}
        assert json.loads(ask(request("POST", "/v1/do", auth, b'{"a": [1]}')).body) == {"a": [1]}
        assert ask(request("POST", "/v1/do", auth, b"[1]")).status == 400
        assert ask(request("POST", "/v1/do", auth, b"x" * 101)).status == 413
    finally:
        server.shutdown()
        server.server_close()


# ---- whole-head limit, bare line ends, media types, slow-body floods ------------------------------


def test_media_types_compare_case_insensitively_and_ignore_parameters():
    assert media_type({"content-type": "APPLICATION/JSON"}) == "application/json"
    assert media_type({"content-type": " application/json ; charset=utf-8"}) == "application/json"
    assert media_type({"content-type": "Application/Octet-Stream"}) == "application/octet-stream"
    assert media_type({}) == "" and media_type({"content-type": ""}) == ""


@pytest.mark.parametrize("split", ["whole", "two pieces", "after a request"])
def test_a_head_over_the_limit_is_431_however_it_arrives(split):
    """The limit holds for a head that arrives complete in one read, not only for one still arriving."""
    big = request("GET", "/loop?n=1", {"X-Big": "a" * 20_000})
    with running(HttpLimits(max_header_bytes=16 * 1024)) as server:
        if split == "whole":
            reply = exchange(server.port, big)
        elif split == "two pieces":
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
                s.sendall(big[:10_000])
                time.sleep(0.2)
                s.sendall(big[10_000:])
                _, reply = _closed_within(s, 5)
        else:
            reply = exchange(server.port, request("GET", "/loop?n=0") + big)
        statuses = [a.status for a in parse_answers(reply)]
        assert statuses[-1] == 431, statuses
        assert statuses == ([200, 431] if split == "after a request" else [431])
        # a head just under the limit is still served
        fits = request("GET", "/loop?n=2", {"X-Big": "a" * 15_000})
        assert [a.status for a in parse_answers(exchange(server.port, fits))] == [200]


@pytest.mark.parametrize(
    "raw",
    [b"GET /loop HTTP/1.1\nHost: x\n\n", b"GET /loop HTTP/1.1\r\nHost: x\n\n", b"GET /loop HTTP/1.1\rHost: x\r\r"],
    ids=["bare LF", "bare LF after CRLF", "bare CR"],
)
def test_heads_with_bare_line_ends_are_400_at_once(raw):
    """A head that can never end with CRLF CRLF is refused at once, not with a 408 after the header time-out."""
    with (
        running(HttpLimits(header_timeout=10.0)) as server,
        socket.create_connection(("127.0.0.1", server.port), timeout=5) as s,
    ):
        t0 = time.monotonic()
        s.sendall(raw)  # no half-close: the client waits for its answer
        closed, data = _closed_within(s, 5)
        assert closed and time.monotonic() - t0 < 2, data
        [answer] = parse_answers(data)
        assert answer.status == 400 and "bare" in json.loads(answer.body)["error"]


def _slow_bodies(port: int, n: int, stop: threading.Event, path: str = "/loop") -> list[socket.socket]:
    """``n`` connections that announce a 1 MB body and then send one byte every 0.3 s until ``stop``."""
    socks = []
    for _ in range(n):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n".encode())
            socks.append(s)
        except OSError:
            pass  # refused at once: fine, the flood goes on with the others

    def drip():
        while not stop.wait(0.3):
            for s in socks:
                with contextlib.suppress(OSError):
                    s.send(b"x")

    threading.Thread(target=drip, daemon=True).start()
    return socks


class FastProtocol(HttpProtocol):
    """A protocol with a fast path (as cube-server's binary lookups): ``POST /fast`` heads skip the parser."""

    fast_prefix = b"POST /fast "
    fast_max_body = 1 << 20

    @staticmethod
    def fast_head(data, start, end):
        length = re.search(rb"\r\nContent-Length: ([0-9]+)", data[start:end])
        return None if length is None else (None, int(length.group(1)), True)

    def fast_dispatch(self, arg, body, keep_alive):
        slot = Slot(keep_alive)
        self.pending.append(slot)
        self._deliver(slot, Response.json({"len": len(body)}))


@pytest.mark.parametrize("path", ["/loop", "/fast"])
def test_a_slow_body_flood_leaves_room_for_other_clients(path):
    """300 connections each dripping a 1 MB body, against a cap of 64 connections: a fresh client is still
    answered (the unfinished-body cap refuses most of them at their head, the minimum body rate drops the
    rest, and a new connection over the cap evicts an idle one instead of being refused)."""
    limits = HttpLimits(
        max_connections=64, max_unfinished_bodies=8, body_grace=1.0, body_min_rate=1000, body_timeout=60.0
    )
    stop = threading.Event()
    with running(limits, protocol_factory=FastProtocol) as server:
        socks = _slow_bodies(server.port, 300, stop, path)
        try:
            statuses, slow = [], []
            deadline = time.monotonic() + 4
            while time.monotonic() < deadline:
                t0 = time.monotonic()
                reply = exchange(server.port, request("GET", "/loop?n=1"), timeout=5)
                slow.append(time.monotonic() - t0)
                statuses.append(parse_answers(reply)[0].status)
                time.sleep(0.05)
            assert set(statuses) == {200}, {c: statuses.count(c) for c in set(statuses)}
            assert max(slow) < 1.0, max(slow)
            assert server.unfinished_bodies <= 8
            # the bodies still dripping after the grace period arrive far below the minimum rate: dropped
            assert server.unfinished_bodies == 0, server.unfinished_bodies
        finally:
            stop.set()
            for s in socks:
                s.close()


def _fast_bodies(port: int, n: int, stop: threading.Event) -> list[socket.socket]:
    """``n`` connections each sending a 1 MB body at about 3 KB/s: above any minimum rate, never displaced."""
    socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(n)]
    for s in socks:
        s.sendall(b"POST /loop HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n")

    def drip():
        while not stop.wait(0.1):
            for s in socks:
                with contextlib.suppress(OSError):
                    s.send(b"x" * 300)

    threading.Thread(target=drip, daemon=True).start()
    return socks


def test_a_small_body_after_its_head_is_answered_while_large_bodies_hold_every_place():
    """Most clients write a request's head and its body in two writes. With every unfinished-body place held by
    large bodies that keep their pace (none can be displaced), a small announced body still gets its answer;
    one that then stalls is closed after ``small_body_timeout`` (408), not after the 60 s of a large one."""
    limits = HttpLimits(max_unfinished_bodies=2, body_min_rate=1000, body_grace=0.5, small_body_timeout=0.5)
    stop = threading.Event()
    with running(limits) as server:
        socks = _fast_bodies(server.port, 2, stop)
        try:
            time.sleep(0.6)
            assert server.unfinished_bodies == 2
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
                for _ in range(5):
                    s.sendall(b"POST /thread HTTP/1.1\r\nHost: x\r\nContent-Length: 11\r\n\r\n")
                    time.sleep(0.05)
                    s.sendall(b"hello world")
                    data = b""
                    while b"}" not in data:
                        data += s.recv(4096)
                    [answer] = parse_answers(data)
                    assert answer.status == 200 and json.loads(answer.body) == {"len": 11}, answer
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
                t0 = time.monotonic()
                s.sendall(b"POST /thread HTTP/1.1\r\nHost: x\r\nContent-Length: 11\r\n\r\nhel")
                closed, data = _closed_within(s, 10)
                [answer] = parse_answers(data)
                assert closed and answer.status == 408 and "not complete within 0.5s" in answer.body.decode()
                assert time.monotonic() - t0 < 3
            assert server.unfinished_bodies == 2  # the large ones still arriving, untouched
        finally:
            stop.set()
            for s in socks:
                s.close()


def test_eviction_spares_a_fresh_connection_and_takes_a_closing_one_first():
    """Over the cap, a connection that has just been accepted and has sent nothing yet is not evicted (under a
    flood of new connections each would close the one before it before its request arrived); one closing after
    an error answer goes before an idle one, however old."""
    with running(HttpLimits(max_connections=2)) as server:
        fresh = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        time.sleep(0.05)
        idle = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        idle.sendall(request("GET", "/loop?n=idle"))
        assert parse_answers(idle.recv(4096))[0].status == 200
        newcomer = socket.create_connection(("127.0.0.1", server.port), timeout=5)  # over the cap
        assert _closed_within(idle, 2) == (True, b"")  # the idle one went, though younger than the fresh one
        fresh.sendall(request("GET", "/loop?n=fresh"))
        assert parse_answers(fresh.recv(4096))[0].status == 200
        newcomer.close()
        fresh.close()
    with running(HttpLimits(max_connections=3)) as server:
        old_idle = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        old_idle.sendall(request("GET", "/loop?n=old"))
        assert parse_answers(old_idle.recv(4096))[0].status == 200
        bad = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        bad.sendall(b"GET / HTTP/1.1\r\nHost: a\x00\r\n\r\n")  # 400, then the server lingers
        assert parse_answers(bad.recv(4096))[0].status == 400
        third = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        third.sendall(request("GET", "/loop?n=3"))
        assert parse_answers(third.recv(4096))[0].status == 200
        newcomer = socket.create_connection(("127.0.0.1", server.port), timeout=5)  # over the cap
        newcomer.sendall(request("GET", "/loop?n=new"))
        assert parse_answers(newcomer.recv(4096))[0].status == 200
        assert _closed_within(bad, 2)[0]  # the lingering one went first ...
        old_idle.sendall(request("GET", "/loop?n=again"))  # ... the oldest idle one is still served
        assert parse_answers(old_idle.recv(4096))[0].status == 200
        for s in (old_idle, bad, third, newcomer):
            s.close()


def test_a_new_connection_over_the_cap_evicts_an_idle_one_not_a_busy_one():
    with running(HttpLimits(max_connections=4)) as server:
        busy = []
        for i in range(3):  # waiting for answers: never evicted
            s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            s.sendall(request("GET", f"/later?n={i}&d=1.5"))
            busy.append(s)
        idle = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        time.sleep(0.2)
        assert [a.status for a in parse_answers(exchange(server.port, request("GET", "/loop?n=x")))] == [200]
        assert _closed_within(idle, 2) == (True, b"")
        for i, s in enumerate(busy):
            s.settimeout(5)
            data = s.recv(4096)
            assert data.startswith(b"HTTP/1.1 200 ") and f'"n": "{i}"'.encode() in data
            s.close()
