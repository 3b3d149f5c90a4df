"""Malformed, oversized and stalled HTTP requests, sent to the real server processes.

Every server runs as its own process, started as the pipeline starts it; each
test sends the exact bytes of the reproduction (tests/helpers_http.py) and
checks the answer, that nothing was stored or executed that should not have
been, that memory stayed bounded, and that the server still answers.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import numpy as np
import pytest
import requests
from helpers_cube import TOKEN, agent_args, cube_process, server_args, write_synthetic_pass
from helpers_http import chunked, exchange, parse_answers, port_of, request, rss_mb, status_of
from helpers_serving import PYTHON, free_port, process, wait_healthy

from cube.builder import build_version

pytestmark = pytest.mark.e2e
AUTH = {"Authorization": f"Bearer {TOKEN}"}
VERSION = "pass-20240101-00"
DIM = 8


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A file server, a cube-server with one version, its agent, cube-transfer and serving, as processes."""
    tmp = tmp_path_factory.mktemp("http-hardening")
    keys = np.arange(1, 5001, dtype=np.uint64) * np.uint64(7919)
    values = np.arange(len(keys) * DIM, dtype=np.float32).reshape(-1, DIM)
    p = write_synthetic_pass(tmp / "passes" / VERSION, keys, values)
    build_version(pass_dir=p, shards=1, output=tmp / "cube")
    (tmp / "files" / "cube").mkdir(parents=True)
    (tmp / "files" / "cube" / "good.bin").write_bytes(b"good bytes")
    (tmp / "files" / "config").mkdir()
    (tmp / "files" / "config" / "data.config").write_text('export HDFS_UGI="user,password"\n')
    (tmp / "models").mkdir()
    env = {"ELASTIC_CTR_TOKEN": TOKEN}
    fs_port, serving_port = free_port(), free_port()
    fs_args = ["--root", str(tmp / "files"), "--host", "127.0.0.1", "--port", str(fs_port), "--max-bytes", str(4 << 20)]
    serve_args = ["--model-dir", str(tmp / "models"), "--host", "127.0.0.1", "--port", str(serving_port)]
    with (
        process([PYTHON, "-m", "elastic_control", "fileserver", *fs_args], env, tmp / "fs.log") as fs_proc,
        process([PYTHON, "-m", "elastic_control", "serve", *serve_args], env, tmp / "serving.log") as serving_proc,
        cube_process("server", server_args(tmp / "cube", 0), tmp, "server") as (cube_url, cube_proc),
    ):
        fs_url, serving_url = f"http://127.0.0.1:{fs_port}", f"http://127.0.0.1:{serving_port}"
        with cube_process("agent", agent_args(tmp / "agent-data", 0, cube_url), tmp, "agent") as (
            agent_url,
            agent_proc,
        ):
            transfer_args = [
                "--model-path",
                str(tmp / "models"),
                "--cube-root",
                str(tmp / "transfer-cube"),
                "--fileserver",
                fs_url,
                "--agents",
                agent_url,
                "--port",
                "0",
                "--host",
                "127.0.0.1",
                "--poll-interval",
                "60",
            ]
            with cube_process("transfer", transfer_args, tmp, "transfer") as (transfer_url, transfer_proc):
                wait_healthy(fs_url, fs_proc)
                wait_healthy(serving_url, serving_proc)
                yield {
                    "tmp": tmp,
                    "keys": keys,
                    "values": values,
                    "fileserver": (fs_url, fs_proc),
                    "cube": (cube_url, cube_proc),
                    "agent": (agent_url, agent_proc),
                    "transfer": (transfer_url, transfer_proc),
                    "serving": (serving_url, serving_proc),
                }


TOKEN_SERVERS = {  # a call on each server that needs the token, with a small valid JSON body
    "fileserver": ("PUT", "/files/cube/upload.bin"),
    "cube": ("POST", "/v1/activate"),
    "agent": ("POST", "/v1/activate"),
    "transfer": ("POST", "/v1/poll"),
}
ALL_SERVERS = ("fileserver", "cube", "agent", "transfer", "serving")
HEALTH = {name: "/healthz" for name in ALL_SERVERS}


def _alive(stack, name: str) -> None:
    url, proc = stack[name]
    assert proc.poll() is None, f"{name} died"
    assert requests.get(url + HEALTH[name], timeout=10).status_code == 200


# ---- item 6: memory exhaustion -----------------------------------------------------------------


def test_cube_server_stops_reading_while_its_answers_are_not_read(stack):
    """12 pipelined 1M-key lookups whose answers are never read: memory must not grow by their answers."""
    url, proc = stack["cube"]
    keys = np.resize(stack["keys"], 1_000_000).astype("<u8").tobytes()
    one = request("POST", "/v1/lookup", {"Content-Type": "application/octet-stream"}, keys)
    before = rss_mb(proc.pid)
    s = socket.create_connection(("127.0.0.1", port_of(url)))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)

    def send():
        try:
            s.sendall(one * 12)
        except OSError:
            pass  # the server stopped reading (or dropped us): the point of the test

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    peak = before
    for _ in range(30):  # 3 s: long enough for the server to answer all 12 if it read them
        time.sleep(0.1)
        peak = max(peak, rss_mb(proc.pid))
    s.close()
    answer_mb = 1_000_000 * DIM * 4 / (1 << 20)
    # Unbounded, the 12 answers alone would add 12 x 30.5 MiB; bounded, about one answer plus one request.
    assert peak - before < 4 * answer_mb, f"cube-server grew {peak - before:.0f} MiB ({before:.0f} -> {peak:.0f})"
    _alive(stack, "cube")


@pytest.mark.parametrize("name", sorted(TOKEN_SERVERS))
def test_the_token_is_checked_before_a_body_is_read(stack, name):
    """A 200 MB unauthenticated body: answered 401 at once, never read into memory."""
    url, proc = stack[name]
    method, path = TOKEN_SERVERS[name]
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {200 << 20}\r\n\r\n"
    )
    before = rss_mb(proc.pid)
    s = socket.create_connection(("127.0.0.1", port_of(url)), timeout=5)
    s.sendall(head.encode())
    sent = 0
    got = b""
    s.setblocking(False)
    deadline = time.monotonic() + 5
    while b"\r\n\r\n" not in got and time.monotonic() < deadline:
        try:
            sent += s.send(b"x" * (1 << 16))
        except (BlockingIOError, BrokenPipeError, ConnectionResetError):
            time.sleep(0.01)
        try:
            got += s.recv(1 << 16)
        except BlockingIOError:
            pass
        except ConnectionResetError:
            break
    s.close()
    assert b"\r\n\r\n" in got, f"{name}: no answer within 5 s after {sent >> 20} MiB of an unauthenticated body"
    assert got.startswith(b"HTTP/1.1 401 "), got[:200]
    assert sent < 100 << 20, f"{name} read {sent >> 20} MiB before refusing"
    assert rss_mb(proc.pid) - before < 40
    _alive(stack, name)


def test_fileserver_refuses_bad_chunk_sizes_and_holds_max_bytes_for_chunked(stack):
    url, _ = stack["fileserver"]
    root = stack["tmp"] / "files"
    head = request("PUT", "/files/cube/neg.bin", {**AUTH, "Transfer-Encoding": "chunked"})
    for size_line in (b"-1", b"zz", b"0x10", b" 10", b"+10", b"10 ", b"1" * 30):
        reply = exchange(port_of(url), head + size_line + b"\r\n" + b"y" * 5000 + b"\r\n0\r\n\r\n")
        assert status_of(reply) == 400, (size_line, reply[:200])
    # -1 used to mean "to the end of the stream" and ignored --max-bytes (4 MiB here)
    reply = exchange(port_of(url), head + b"-1\r\n" + b"z" * (5 << 20))
    assert status_of(reply) == 400
    reply = exchange(port_of(url), head + chunked(b"w" * ((4 << 20) + 1), size=1 << 20))
    assert status_of(reply) == 413
    assert not (root / "cube" / "neg.bin").exists()
    assert list((root / ".fileserver-staging").iterdir()) == []
    reply = exchange(port_of(url), head + chunked(b"ok" * 3000, size=777))
    assert status_of(reply) == 201 and (root / "cube" / "neg.bin").read_bytes() == b"ok" * 3000


# ---- item 10: requests that never get an answer, or the wrong one -------------------------------

CONTROL_CALLS = {  # server -> a call that takes a JSON body (with the token)
    "cube": ("POST", "/v1/load"),
    "agent": ("POST", "/v1/prepare"),
    "transfer": ("POST", "/v1/poll"),
}
BAD_JSON_BODIES = {
    "invalid UTF-8": b'{"version": "\xff\xfe"}',
    "deeply nested": b"[" * 30_000 + b"]" * 30_000,
    "nested object": b'{"a":' * 5000 + b"1" + b"}" * 5000,
    "huge integer": b'{"version": ' + b"9" * 5000 + b"}",
    "NaN": b'{"version": NaN}',
}


@pytest.mark.parametrize("what", sorted(BAD_JSON_BODIES))
@pytest.mark.parametrize("name", sorted(CONTROL_CALLS))
def test_control_calls_with_bad_json_get_a_400_with_a_message(stack, name, what):
    url, _ = stack[name]
    method, path = CONTROL_CALLS[name]
    reply = exchange(
        port_of(url), request(method, path, {**AUTH, "Content-Type": "application/json"}, BAD_JSON_BODIES[what])
    )
    [answer] = parse_answers(reply)
    assert answer.status == 400, (what, answer)
    assert json.loads(answer.body)["error"]
    _alive(stack, name)


@pytest.mark.parametrize("name", ALL_SERVERS)
def test_nul_and_invalid_utf8_in_a_path_are_400(stack, name):
    url, _ = stack[name]
    for path in ("/v1/lo%00ad", "/files/cube/a%00b", "/v1/%ff%fe", "/files/%c3%28"):
        [answer] = parse_answers(exchange(port_of(url), request("POST", path, AUTH, b"{}")))
        assert answer.status == 400, (path, answer)
    _alive(stack, name)


@pytest.mark.parametrize("what", ["deeply nested", "huge integer", "invalid UTF-8", "NaN"])
def test_serving_and_cube_json_lookup_refuse_bad_json_with_400(stack, what):
    body = BAD_JSON_BODIES[what]
    for name, path in (("serving", "/v1/predict"), ("cube", "/v1/lookup")):
        url, _ = stack[name]
        [answer] = parse_answers(
            exchange(port_of(url), request("POST", path, {"Content-Type": "application/json"}, body))
        )
        assert answer.status == 400, (name, what, answer)
        _alive(stack, name)


@pytest.mark.parametrize(
    "keys",
    [[-1], [1.9], [True], "123", ["-1"], ["+5"], ["1e3"], [2**64], ["18446744073709551616"], [None], [[1]], ["\u0661"]],
)
def test_cube_json_lookup_refuses_keys_it_would_coerce(stack, keys):
    """-1 used to become 2^64-1, 1.9 -> 1, true -> 1, "123" -> the keys [1, 2, 3]."""
    url, _ = stack["cube"]
    r = requests.post(f"{url}/v1/lookup", json={"keys": keys}, timeout=10)
    assert r.status_code == 400 and "keys" in r.json()["error"], (keys, r.status_code, r.text[:200])
    good = [int(stack["keys"][0]), str(stack["keys"][1]), 2**64 - 1]
    r = requests.post(f"{url}/v1/lookup", json={"keys": good}, timeout=10)
    assert r.status_code == 200 and r.json()["found"] == [True, True, False]
    assert r.json()["values"][0] == stack["values"][0].tolist()


def test_serving_answers_413_for_too_many_instances(stack):
    url, _ = stack["serving"]
    body = json.dumps({"instances": [{"line": "1 0 1:1"}] * 10_001}).encode()
    r = requests.post(f"{url}/v1/predict", data=body, timeout=30)
    assert r.status_code == 413 and "at most 10000" in r.json()["error"]


@pytest.mark.parametrize("name", ALL_SERVERS)
def test_content_length_minus_one_is_400_at_once(stack, name):
    url, _ = stack[name]
    t0 = time.monotonic()
    reply = exchange(port_of(url), b"POST /v1/prepare HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n{}", timeout=5)
    assert status_of(reply) == 400 and time.monotonic() - t0 < 3
    _alive(stack, name)


@pytest.mark.parametrize("name", ALL_SERVERS)
def test_unknown_methods_get_a_json_405_not_501_html(stack, name):
    url, _ = stack[name]
    path = {"fileserver": "/files/cube/good.bin", "serving": "/v1/predict", "cube": "/v1/lookup"}.get(
        name, "/v1/status"
    )
    for method in ("BREW", "PATCH", "OPTIONS"):
        [answer] = parse_answers(exchange(port_of(url), request(method, path)))
        assert answer.status == 405 and answer.headers["content-type"] == "application/json", (method, answer)
        assert json.loads(answer.body)["error"]


def test_a_409_from_cube_server_stays_a_409_through_the_agent(stack):
    url, _ = stack["agent"]
    r = requests.post(f"{url}/v1/activate", json={"version": "pass-20990101-00"}, headers=AUTH, timeout=10)
    assert r.status_code == 409, r.text
    assert "pass-20990101-00" in r.json()["error"]


@pytest.mark.parametrize("name", sorted(TOKEN_SERVERS))
def test_missing_or_wrong_token_is_401_everywhere(stack, name):
    url, _ = stack[name]
    method, path = TOKEN_SERVERS[name]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}, {"Authorization": ""}):
        [answer] = parse_answers(exchange(port_of(url), request(method, path, headers, b"{}")))
        assert answer.status == 401, (headers, answer)
        assert answer.headers["www-authenticate"].startswith("Bearer")


def test_fileserver_reads_outside_cube_need_the_token(stack):
    """Item 8: data.config (with HDFS_UGI) is published under config/; it must not be readable without the token."""
    url, _ = stack["fileserver"]
    for path in ("/files/config/data.config", "/files/config/", "/files/", "/files/config"):
        r = requests.get(url + path, timeout=10)
        assert r.status_code == 401 and b"password" not in r.content, (path, r.text)
        assert requests.head(url + path, timeout=10).status_code == 401
    r = requests.get(url + "/files/config/data.config", headers={"Authorization": "Bearer wrong"}, timeout=10)
    assert r.status_code == 401
    assert "password" in requests.get(url + "/files/config/data.config", headers=AUTH, timeout=10).text
    assert requests.get(url + "/files/cube/good.bin", timeout=10).content == b"good bytes"  # agents, serving


def test_a_server_without_a_token_refuses_writes_with_403(tmp_path):
    port = free_port()
    args = [
        PYTHON,
        "-m",
        "elastic_control",
        "fileserver",
        "--root",
        str(tmp_path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    with process(args, {"ELASTIC_CTR_TOKEN": ""}, tmp_path / "fs.log") as proc:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        r = requests.put(f"{url}/files/cube/x", data=b"1", headers=AUTH, timeout=10)
        assert r.status_code == 403 and "ELASTIC_CTR_TOKEN" in r.json()["error"]
        assert requests.get(f"{url}/files/config/x", headers=AUTH, timeout=10).status_code == 403


# ---- item 11: loose framing ----------------------------------------------------------------------


def test_a_get_with_a_body_never_has_its_body_read_as_a_second_request(stack):
    url, _ = stack["fileserver"]
    root = stack["tmp"] / "files"
    (root / "cube" / "victim.bin").write_bytes(b"still here")
    smuggled = request("DELETE", "/files/cube/victim.bin", AUTH)
    reply = exchange(
        port_of(url), request("GET", "/files/cube/good.bin", {"Content-Length": str(len(smuggled))}) + smuggled
    )
    answers = parse_answers(reply)
    assert [a.status for a in answers] == [400], answers
    assert (root / "cube" / "victim.bin").read_bytes() == b"still here"


FRAMING = {
    "conflicting Content-Length": b"PUT /files/cube/f.bin HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
    b"Content-Length: 3\r\nContent-Length: 30\r\n\r\nabc",
    "Content-Length and chunked": b"PUT /files/cube/f.bin HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
    b"Content-Length: 10\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "two Transfer-Encodings": b"PUT /files/cube/f.bin HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
    b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "gzip coding": b"PUT /files/cube/f.bin HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
    b"Transfer-Encoding: gzip, chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "bare LF": b"PUT /files/cube/f.bin HTTP/1.1\nHost: x\r\nAuthorization: Bearer %s\r\nContent-Length: 3\r\n\r\nabc",
    "bare LF in a header": b"PUT /files/cube/f.bin HTTP/1.1\r\nHost: x\nAuthorization: Bearer %s\r\n"
    b"Content-Length: 3\r\n\r\nabc",
    "NUL in a header": b"PUT /files/cube/f.bin HTTP/1.1\r\nHost: x\x00y\r\nAuthorization: Bearer %s\r\n"
    b"Content-Length: 3\r\n\r\nabc",
    "folded header": b"PUT /files/cube/f.bin HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
    b"X-Note: a\r\n  folded\r\nContent-Length: 3\r\n\r\nabc",
    "space before colon": b"PUT /files/cube/f.bin HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
    b"Content-Length : 3\r\n\r\nabc",
    "negative length": b"PUT /files/cube/f.bin HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
    b"Content-Length: -3\r\n\r\nabc",
}


@pytest.mark.parametrize("what", sorted(FRAMING))
@pytest.mark.parametrize("name", ALL_SERVERS)
def test_loose_framing_is_400_and_nothing_is_stored(stack, name, what):
    url, _ = stack[name]
    root = stack["tmp"] / "files"
    data = FRAMING[what].replace(b"%s", TOKEN.encode())
    if name != "fileserver":  # the same framing on each server's own write endpoint
        method, path = TOKEN_SERVERS.get(name, ("POST", "/v1/predict"))
        data = data.replace(b"PUT /files/cube/f.bin", f"{method} {path}".encode())
    answers = parse_answers(exchange(port_of(url), data))
    assert [a.status for a in answers] == [400], (what, answers)
    assert not (root / "cube" / "f.bin").exists()
    _alive(stack, name)


def test_half_sent_requests_are_closed_after_the_header_timeout(stack):
    """Half-open connections (a partial head) used to stay open for minutes; now ~10 s (HttpLimits.header_timeout)."""
    url, proc = stack["serving"]
    socks = []
    for _ in range(200):
        s = socket.create_connection(("127.0.0.1", port_of(url)), timeout=20)
        s.sendall(b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Le")
        socks.append(s)
    assert requests.get(url + "/healthz", timeout=10).status_code == 200  # others are still served meanwhile
    t0 = time.monotonic()
    closed = 0
    for s in socks:
        try:
            data = s.recv(4096)  # the 408 answer, then EOF
            closed += data.startswith(b"HTTP/1.1 408") or data == b""
        except TimeoutError:
            pass
        s.close()
    assert closed == len(socks) and time.monotonic() - t0 < 16
    assert proc.poll() is None


@pytest.mark.parametrize("workers", [1, 2])
def test_cube_server_on_uvloop_exits_promptly_on_sigterm(stack, tmp_path, workers):
    """A SIGTERM used to wait for uvloop to give Python control back: killed after the grace period instead."""
    args = server_args(
        stack["tmp"] / "cube", 0, workers=workers, extra=["--event-loop", "uvloop", "--state-dir", str(tmp_path / "st")]
    )
    with cube_process("server", args, tmp_path, "uvloop-server") as (url, proc):
        idle = socket.create_connection(("127.0.0.1", port_of(url)))
        stop = threading.Event()
        lookup = request("POST", "/v1/lookup", {}, stack["keys"][:26].astype("<u8").tobytes())

        def busy():  # the signal must also stop a server that is answering lookups
            with contextlib.suppress(OSError):
                s = socket.create_connection(("127.0.0.1", port_of(url)), timeout=5)
                while not stop.is_set():
                    s.sendall(lookup * 20)
                    s.recv(1 << 20)

        threads = [threading.Thread(target=busy, daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        t0 = time.monotonic()
        proc.terminate()
        try:
            proc.wait(15)
        finally:
            stop.set()
            idle.close()
        # The bug waited past wait(15); a clean exit takes well under a second on a quiet machine, but a
        # shared 2-core machine at load 30+ took 7.8 s to reap two workers.
        assert time.monotonic() - t0 < 10 and proc.returncode in (0, -15), proc.returncode


# ---- admission: the whole head, bare line ends, media types -------------------------------------


@pytest.mark.parametrize("name", ALL_SERVERS)
def test_a_120000_byte_head_is_431_on_every_server(stack, name):
    """A head that arrives complete in one read (a read takes up to 256 KiB) is held to the 16 KiB limit too."""
    url, _ = stack[name]
    reply = exchange(port_of(url), request("GET", HEALTH[name], {"X-Big": "a" * 120_000}))
    assert [a.status for a in parse_answers(reply)] == [431]
    reply = exchange(port_of(url), request("GET", HEALTH[name], {"X-Big": "a" * 15_000}))
    assert [a.status for a in parse_answers(reply)] == [200]
    _alive(stack, name)


@pytest.mark.parametrize("name", ALL_SERVERS)
def test_a_bare_lf_head_is_400_at_once_on_every_server(stack, name):
    url, _ = stack[name]
    with socket.create_connection(("127.0.0.1", port_of(url)), timeout=5) as s:
        t0 = time.monotonic()
        s.sendall(f"GET {HEALTH[name]} HTTP/1.1\nHost: x\n\n".encode())
        data = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while piece := s.recv(4096):
                data += piece
    assert time.monotonic() - t0 < 3
    assert [a.status for a in parse_answers(data)] == [400]
    _alive(stack, name)


@pytest.mark.parametrize("content_type", ["APPLICATION/JSON", "application/json; charset=utf-8", "Application/Json"])
def test_cube_json_lookup_media_type_is_case_insensitive(stack, content_type):
    url, _ = stack["cube"]
    key = int(stack["keys"][0])
    body = json.dumps({"keys": [key]}).encode()
    [answer] = parse_answers(
        exchange(port_of(url), request("POST", "/v1/lookup", {"Content-Type": content_type}, body))
    )
    assert answer.status == 200 and answer.headers["content-type"] == "application/json", answer
    assert json.loads(answer.body)["values"][0] == stack["values"][0].tolist()
