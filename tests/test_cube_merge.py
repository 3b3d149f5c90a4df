"""cube-server's fast lookup path: merged lookups answer every request with its own keys and version."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest
import requests
from helpers_cube import TOKEN, cube_server, write_synthetic_pass

from cube.builder import build_version
from cube.lookup_protocol import parse_lookup_head

OLD, NEW = "pass-20240101-00", "pass-20240101-01"
DIM = 4


def _head(raw: bytes):
    end = raw.index(b"\r\n\r\n")
    return parse_lookup_head(raw, 0, end)


def test_fast_head_parser_takes_plain_lookups_and_passes_the_rest_on():
    assert _head(b"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nContent-Length: 16\r\n\r\n") == (None, 16, True)
    assert _head(b"POST /v1/lookup?version=pass-1 HTTP/1.1\r\ncontent-length: 8\r\nCONNECTION: Close\r\n\r\n") == (
        "pass-1",
        8,
        False,
    )
    assert _head(
        b"POST /v1/lookup HTTP/1.1\r\nContent-Type: application/octet-stream\r\n"
        b"Connection: keep-alive\r\nContent-Length: 0\r\n\r\n"
    ) == (None, 0, True)
    # Everything unusual goes to the generic parser (None), which answers or refuses it.
    for raw in (
        b"POST /v1/lookup HTTP/1.0\r\nContent-Length: 8\r\n\r\n",
        b"POST /v1/lookup?version=a%2Fb HTTP/1.1\r\nContent-Length: 8\r\n\r\n",
        b"POST /v1/lookup?version=a&x=1 HTTP/1.1\r\nContent-Length: 8\r\n\r\n",
        b"POST /v1/lookupx HTTP/1.1\r\nContent-Length: 8\r\n\r\n",
        b"POST /v1/lookup HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: 8\r\n\r\n",
        b"POST /v1/lookup HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"POST /v1/lookup HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 8\r\n\r\n",
        b"POST /v1/lookup HTTP/1.1\r\nContent-Length : 8\r\n\r\n",
        b"POST /v1/lookup HTTP/1.1\r\nContent-Length: -8\r\n\r\n",
        b"POST /v1/lookup HTTP/1.1\r\nHost: x\r\n\r\n",
    ):
        assert _head(raw) is None, raw


def _read_answers(sock: socket.socket, count: int, timeout: float = 10.0) -> list[tuple[int, dict, bytes]]:
    """Read ``count`` HTTP answers off one connection, in order: (status, headers, body)."""
    sock.settimeout(timeout)
    buf, out = b"", []
    while len(out) < count:
        while b"\r\n\r\n" not in buf:
            chunk = sock.recv(1 << 16)
            assert chunk, f"connection closed after {len(out)} of {count} answers"
            buf += chunk
        end = buf.index(b"\r\n\r\n")
        lines = buf[:end].decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        total = end + 4 + int(headers["content-length"])
        while len(buf) < total:
            chunk = sock.recv(1 << 16)
            assert chunk, "connection closed mid-answer"
            buf += chunk
        out.append((int(lines[0].split(" ")[1]), headers, buf[end + 4 : total]))
        buf = buf[total:]
    return out


def _lookup(keys: np.ndarray, version: str | None = None, extra: str = "") -> bytes:
    body = keys.astype("<u8").tobytes()
    target = "/v1/lookup" + (f"?version={version}" if version else "")
    return (f"POST {target} HTTP/1.1\r\nHost: cube\r\n{extra}Content-Length: {len(body)}\r\n\r\n").encode() + body


def _metric(url: str, name: str) -> float:
    for line in requests.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.fixture(params=["auto", "asyncio"])
def two_version_server(tmp_path, request):
    """One server: OLD active (every value 1.0 + key index), NEW previous (2.0 + key index).

    Run on both event loops: uvloop (the default when installed) and asyncio's own.
    """
    keys = np.unique(np.random.default_rng(11).integers(1, 2**64 - 1, 3000, dtype=np.uint64))
    for base, name in ((1.0, OLD), (2.0, NEW)):
        values = base + np.arange(len(keys), dtype=np.float32)[:, None] * 10 + np.arange(DIM, dtype=np.float32)
        p = write_synthetic_pass(tmp_path / "passes" / name, keys, values.astype(np.float32))
        build_version(pass_dir=p, shards=1, output=tmp_path / "cube")
    with cube_server(tmp_path / "cube", 0, tmp_path, extra=["--event-loop", request.param]) as (url, proc):
        r = requests.post(
            f"{url}/v1/load", json={"version": OLD}, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30
        )
        assert r.status_code == 200, r.text
        r = requests.post(
            f"{url}/v1/activate", json={"version": OLD}, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30
        )
        assert r.status_code == 200 and r.json()["previous"] == NEW, r.text  # NEW stays held
        yield url, keys


def _expected(keys_all: np.ndarray, query: np.ndarray, base: float) -> tuple[np.ndarray, np.ndarray]:
    pos = np.searchsorted(keys_all, query)
    found = (pos < len(keys_all)) & (keys_all[np.minimum(pos, len(keys_all) - 1)] == query)
    values = base + pos[:, None].astype(np.float32) * 10 + np.arange(DIM, dtype=np.float32)
    values[~found] = 0.0
    return values.astype(np.float32), found


def _check_binary(answer, keys_all, query, version):
    status, headers, body = answer
    assert status == 200, body
    assert headers["x-cube-version"] == version
    want, found = _expected(keys_all, query, 1.0 if version == OLD else 2.0)
    n = len(query)
    got = np.frombuffer(body[: n * DIM * 4], "<f4").reshape(n, DIM)
    np.testing.assert_array_equal(got, want)
    bits = np.unpackbits(np.frombuffer(body[n * DIM * 4 :], np.uint8), bitorder="little")[:n].astype(bool)
    np.testing.assert_array_equal(bits, found)
    assert len(body) == n * DIM * 4 + (n + 7) // 8
    assert int(headers["x-cube-misses"]) == int((~found).sum())


def test_pipelined_requests_are_merged_and_each_gets_its_own_keys_and_version(two_version_server):
    url, keys = two_version_server
    host, port = url.rsplit("/", 1)[-1].split(":")
    rng = np.random.default_rng(3)
    plan = []  # (request bytes, kind, query, version)
    for i in range(40):
        n = int(rng.choice([1, 7, 26, 26, 64, 200]))
        query = keys[rng.integers(0, len(keys), n)]
        query[rng.random(n) < 0.2] = np.uint64(12345)  # some misses
        version = [None, NEW, OLD][i % 3]
        extra = (
            "Connection: keep-alive\r\n"
            if i % 5 == 0
            else ("CONTENT-TYPE: application/octet-stream\r\n" if i % 7 == 0 else "")
        )
        plan.append((_lookup(query, version, extra), "binary", query, version or OLD))
        if i == 10:
            plan.append((_lookup(keys[:0]), "empty", None, OLD))
        if i == 20:  # the generic path in the middle of merged fast-path requests
            body = b'{"keys": ["%d", "12345"]}' % int(keys[5])
            plan.append(
                (
                    b"POST /v1/lookup?version=%s HTTP/1.1\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n" % (NEW.encode(), len(body)) + body,
                    "json",
                    None,
                    NEW,
                )
            )
        if i == 25:
            plan.append((b"POST /v1/lookup HTTP/1.1\r\nContent-Length: 5\r\n\r\n12345", "status", 400, None))
            plan.append((_lookup(keys[:3], "pass-20990101-00"), "status", 404, None))
            plan.append((b"GET /healthz HTTP/1.1\r\n\r\n", "status", 200, None))
    before = _metric(url, "cube_lookup_batches_total")
    stream = b"".join(p[0] for p in plan)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        cut = len(stream) // 3 + 5  # one send holding most requests, then the rest split mid-request
        s.sendall(stream[:cut])
        time.sleep(0.05)
        s.sendall(stream[cut : cut + 7])
        time.sleep(0.05)
        s.sendall(stream[cut + 7 :])
        answers = _read_answers(s, len(plan))
    for (_, kind, query, version), answer in zip(plan, answers, strict=True):
        if kind == "binary":
            _check_binary(answer, keys, query, version)
        elif kind == "empty":
            assert answer[0] == 200 and answer[2] == b"" and answer[1]["x-cube-misses"] == "0"
        elif kind == "json":
            doc = answer[2].decode()
            assert answer[0] == 200 and NEW in doc and '"found": [true, false]' in doc
        else:
            assert answer[0] == query, answer
    binary = sum(1 for p in plan if p[1] in ("binary", "empty"))
    merged_batches = _metric(url, "cube_lookup_batches_total") - before
    # Requests that arrived together shared passes (a pass per version per loop turn).
    assert 1 <= merged_batches < binary / 2, (merged_batches, binary)
    keys_counted = _metric(url, "cube_lookup_keys_total")
    assert keys_counted >= sum(len(p[2]) for p in plan if p[1] == "binary")


def test_concurrent_connections_with_mixed_versions_never_cross(two_version_server):
    url, keys = two_version_server
    host, port = url.rsplit("/", 1)[-1].split(":")
    rng = np.random.default_rng(4)
    socks = [socket.create_connection((host, int(port)), timeout=10) for _ in range(12)]
    try:
        for round_ in range(15):
            sent = []
            for i, s in enumerate(socks):
                query = keys[rng.integers(0, len(keys), 26)]
                query[::9] = np.uint64(777)
                version = NEW if (i + round_) % 4 == 0 else (OLD if i % 2 else None)
                s.sendall(_lookup(query, version))
                sent.append((query, version or OLD))
            for s, (query, version) in zip(socks, sent, strict=True):
                _check_binary(_read_answers(s, 1)[0], keys, query, version)
    finally:
        for s in socks:
            s.close()
    assert _metric(url, "cube_requests_total") > 0


def test_lookups_pipelined_before_a_broken_request_are_still_answered(two_version_server):
    url, keys = two_version_server
    host, port = url.rsplit("/", 1)[-1].split(":")
    queries = [keys[i : i + 26] for i in (0, 100, 200)]
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"".join(_lookup(q) for q in queries) + b"GARBAGE\r\n\r\n")
        answers = _read_answers(s, 4)
        assert s.recv(100) == b""  # closed after the 400: the stream is out of sync
    for q, answer in zip(queries, answers[:3], strict=True):
        _check_binary(answer, keys, q, OLD)
    assert answers[3][0] == 400
