"""Real cube-server processes: round trip of a real Paddle table, bad requests, version switches."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
import requests
from helpers_cube import TOKEN, cube_server, write_synthetic_pass

from ctr_foundation.pass_format import load_pass, read_sparse_table
from cube.builder import build_version
from cube.client import CubeClient, CubeUnavailableError, CubeVersionError

pytestmark = pytest.mark.e2e
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _metric(url: str, name: str) -> float:
    for line in requests.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.fixture(scope="module")
def real_pass(synth_world):
    """A pass `elastic-control train` wrote (full 64-bit feasigns, half of them above 2**63)."""
    return synth_world.passes[0]


def test_every_key_of_a_real_paddle_table_comes_back_exactly(real_pass, tmp_path):
    info = load_pass(real_pass)
    build_version(pass_dir=real_pass, shards=2, output=tmp_path / "cube")
    keys, values = read_sparse_table(real_pass, info.layout)
    assert (keys > np.uint64(2**63)).any(), "the pass must exercise keys above 2**63"
    vdir = tmp_path / "cube" / info.name
    with cube_server(vdir, 0, tmp_path, workers=2) as (u0, _), cube_server(tmp_path / "cube", 1, tmp_path) as (u1, _):
        with CubeClient([u0, u1]) as client:
            perm = np.random.default_rng(0).permutation(len(keys))
            got, found, version = client.lookup(keys[perm])
            assert version == info.name and found.all()
            np.testing.assert_array_equal(got, values[perm])  # bit-exact, in input order
            for shard in (0, 1):  # keys of one shard only: the calling thread asks that shard itself
                mine = perm[keys[perm] % np.uint64(2) == shard][:50]
                got, found, _ = client.lookup(keys[mine])
                assert found.all()
                np.testing.assert_array_equal(got, values[mine])
            missing = np.array([1, 2, 3, 2**64 - 1], dtype=np.uint64)
            missing = missing[~np.isin(missing, keys)]
            before = _metric(u0, "cube_lookup_misses_total") + _metric(u1, "cube_lookup_misses_total")
            mixed = np.concatenate([keys[:5], missing])
            got, found, _ = client.lookup(mixed)
            assert found[:5].all() and not found[5:].any() and not got[5:].any()
            time.sleep(1.2)  # the other worker's counters are snapshotted once a second
            after = _metric(u0, "cube_lookup_misses_total") + _metric(u1, "cube_lookup_misses_total")
            assert after - before == len(missing)
        # the JSON debugging variant gives the same vector
        r = requests.post(f"{u1}/v1/lookup", json={"keys": [str(keys[keys % np.uint64(2) == 1][0])]}, timeout=5)
        k1 = keys[keys % np.uint64(2) == 1][0]
        assert r.json()["found"] == [True]
        np.testing.assert_array_equal(np.array(r.json()["values"][0], np.float32), values[keys == k1][0])
        st = requests.get(f"{u0}/v1/status", timeout=5).json()
        assert st["active"] == info.name and st["workers"] == 2


def _raw(url: str, payload: bytes) -> bytes:
    host, port = url.rsplit("/", 1)[-1].split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(payload)
        return s.recv(65536)


def test_bad_requests_get_4xx_and_the_server_keeps_serving(tmp_path):
    keys = np.arange(1, 2001, dtype=np.uint64)
    p = write_synthetic_pass(tmp_path / "pass-20240101-00", keys, np.ones((2000, 4), np.float32))
    build_version(pass_dir=p, shards=1, output=tmp_path / "cube")
    with cube_server(tmp_path / "cube", 0, tmp_path, extra=["--max-batch", "100"]) as (url, proc):
        s = requests.Session()
        assert s.post(f"{url}/v1/lookup", data=b"\x01" * 13, timeout=5).status_code == 400
        r = s.post(f"{url}/v1/lookup?version=pass-20990101-00", data=keys[:2].tobytes(), timeout=5)
        assert r.status_code == 404 and "unknown version" in r.json()["error"]
        assert s.post(f"{url}/v1/lookup", data=keys[:101].tobytes(), timeout=5).status_code == 413
        assert s.post(f"{url}/v1/lookup", json={"keys": ["x"]}, timeout=5).status_code == 400
        assert s.get(f"{url}/v1/nothing", timeout=5).status_code == 404
        assert s.get(f"{url}/v1/lookup", timeout=5).status_code == 405
        assert _raw(url, b"GARBAGE\r\n\r\n").startswith(b"HTTP/1.1 400")
        assert _raw(url, b"POST /v1/lookup HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n").startswith(b"HTTP/1.1 413")
        # control calls: token required, bad bodies and files refused
        assert s.post(f"{url}/v1/activate", json={"version": "pass-20240101-00"}, timeout=5).status_code == 401
        r = s.post(f"{url}/v1/load", json={"version": "nope"}, headers=AUTH, timeout=5)
        assert r.status_code == 422 and "does not exist" in r.json()["error"]
        r = s.post(f"{url}/v1/load", json={"version": "x", "path": "../../etc/passwd"}, headers=AUTH, timeout=5)
        assert r.status_code == 422 and "outside" in r.json()["error"]
        assert s.post(f"{url}/v1/activate", json={"version": "ghost"}, headers=AUTH, timeout=5).status_code == 409
        # ... and it still answers, with the same connection pool
        r = s.post(f"{url}/v1/lookup", data=keys[:3].tobytes(), timeout=5)
        assert r.status_code == 200 and r.headers["X-Cube-Version"] == "pass-20240101-00"
        assert len(r.content) == 3 * 4 * 4 + 1 and r.content[-1] == 0b111
        assert proc.poll() is None
        assert _metric(url, "cube_requests_total") >= 1


def _two_versions(tmp_path, shards: int):
    """Two versions whose every vector says which version it came from (value = version number)."""
    keys = np.random.default_rng(5).integers(1, 2**63, 4000, dtype=np.uint64)
    keys = np.unique(keys)
    for n, name in ((1.0, "pass-20240101-00"), (2.0, "pass-20240101-01")):
        p = write_synthetic_pass(tmp_path / "passes" / name, keys, np.full((len(keys), 4), n, np.float32))
        build_version(pass_dir=p, shards=shards, output=tmp_path / "cube")
    return keys


def test_lookups_during_switches_never_mix_versions(tmp_path):
    keys = _two_versions(tmp_path, shards=2)
    root = tmp_path / "cube"
    # Start each server on version 00 only: a root holding just that version.
    import shutil

    for i in range(2):
        (tmp_path / f"d{i}").mkdir()
        shutil.copytree(root / "pass-20240101-00", tmp_path / f"d{i}" / "pass-20240101-00")
        shutil.copytree(root / "pass-20240101-01", tmp_path / f"d{i}" / ".staged-01")
    with (
        cube_server(tmp_path / "d0", 0, tmp_path, workers=2) as (u0, _),
        cube_server(tmp_path / "d1", 1, tmp_path) as (u1, _),
    ):
        urls = [u0, u1]
        for i, u in enumerate(urls):
            r = requests.post(
                f"{u}/v1/load",
                json={"version": "pass-20240101-01", "path": f".staged-01/shard-{i}.arrow"},
                headers=AUTH,
                timeout=30,
            )
            assert r.status_code == 200, r.text
            assert r.json()["prepared"] == "pass-20240101-01"
        # pinned lookups reach the prepared version before it is active
        with CubeClient(urls) as c:
            assert set(np.unique(c.lookup(keys[:50], "pass-20240101-01")[0])) == {2.0}
        stop, problems, counts = threading.Event(), [], {"server": 0, "client": 0}

        def raw_requests():  # one server with 2 workers, un-pinned: header and body must agree
            s = requests.Session()
            while not stop.is_set():
                r = s.post(f"{u0}/v1/lookup", data=keys[keys % np.uint64(2) == 0][:500].tobytes(), timeout=5)
                v = np.frombuffer(r.content[: 500 * 16], np.float32)
                want = {"pass-20240101-00": 1.0, "pass-20240101-01": 2.0}[r.headers["X-Cube-Version"]]
                if not np.all(v == want):
                    problems.append(f"server answer mixes versions: {np.unique(v)} under {want}")
                counts["server"] += 1

        def client_requests():  # across both shards
            with CubeClient(urls) as c:
                while not stop.is_set():
                    v, f, version = c.lookup(keys[:800])
                    want = {"pass-20240101-00": 1.0, "pass-20240101-01": 2.0}[version]
                    if not (f.all() and np.all(v == want)):
                        problems.append(f"client lookup mixes versions: {np.unique(v)} under {version}")
                    counts["client"] += 1

        threads = [threading.Thread(target=raw_requests), threading.Thread(target=client_requests)]
        for t in threads:
            t.start()
        try:
            for flip in range(6):  # back and forth: active <-> previous, both kept loaded
                target = "pass-20240101-01" if flip % 2 == 0 else "pass-20240101-00"
                for u in urls:
                    r = requests.post(f"{u}/v1/activate", json={"version": target}, headers=AUTH, timeout=30)
                    assert r.status_code == 200, r.text
                    time.sleep(0.05)  # widen the window where the shards disagree
                time.sleep(0.2)
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert not problems, problems[:3]
        assert counts["server"] > 5 and counts["client"] > 5
        st = requests.get(f"{u0}/v1/status", timeout=5).json()
        assert (st["active"], st["previous"]) == ("pass-20240101-00", "pass-20240101-01")


def test_restarted_server_comes_back_on_the_recorded_version(tmp_path):
    keys = _two_versions(tmp_path, shards=1)
    root = tmp_path / "cube"
    with cube_server(root, 0, tmp_path) as (url, _):
        assert requests.get(f"{url}/v1/status", timeout=5).json()["active"] == "pass-20240101-01"  # newest
        for step in ("load", "activate"):
            r = requests.post(f"{url}/v1/{step}", json={"version": "pass-20240101-00"}, headers=AUTH, timeout=30)
            assert r.status_code == 200, r.text
    with cube_server(root, 0, tmp_path, workers=2, name="server-again") as (url, _):
        st = requests.get(f"{url}/v1/status", timeout=5).json()
        assert st["active"] == "pass-20240101-00"
        with CubeClient([url]) as c:
            v, f, version = c.lookup(keys[:10])
            assert version == "pass-20240101-00" and np.all(v == 1.0)


def test_client_errors_are_clear_and_bounded_in_time(tmp_path):
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(5)
        port = silent.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(CubeUnavailableError, match="timed out"):
            CubeClient([f"http://127.0.0.1:{port}"], timeout=0.5).lookup(np.arange(3, dtype=np.uint64))
        assert time.monotonic() - t0 < 5
    with pytest.raises(CubeUnavailableError, match="unreachable"):
        CubeClient([f"http://127.0.0.1:{port}"], timeout=0.5).lookup(np.arange(3, dtype=np.uint64))
    # two shards, both unreachable: whichever the calling thread or the pool asks, the lookup fails clearly
    with pytest.raises(CubeUnavailableError, match="unreachable"):
        CubeClient([f"http://127.0.0.1:{port}"] * 2, timeout=0.5).lookup(np.arange(4, dtype=np.uint64))
    assert issubclass(CubeVersionError, CubeUnavailableError)


def _one_answer_server(answers: list[bytes]):
    """A TCP server answering the i-th request it reads (one per connection) with ``answers[i]``, then closing."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)

    def run():
        for answer in answers:
            conn, _ = srv.accept()
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, body = data.partition(b"\r\n\r\n")
                length = int(
                    next(
                        v
                        for k, v in (ln.split(b":", 1) for ln in head.split(b"\r\n")[1:])
                        if k.lower() == b"content-length"
                    )
                )
                while len(body) < length:
                    body += conn.recv(65536)
                conn.sendall(answer)
        srv.close()

    threading.Thread(target=run, daemon=True).start()
    return f"http://127.0.0.1:{srv.getsockname()[1]}"


def test_the_lookup_client_retries_a_closed_keep_alive_connection_and_refuses_unframed_answers():
    from cube.client import _ShardConnections

    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Cube-Dim: 4\r\n\r\nhi"
    shard = _ShardConnections(_one_answer_server([ok, ok]), timeout=2)
    status, head, body = shard.request("POST", "/v1/lookup", b"12345678")
    assert (status, head["x-cube-dim"], body) == (200, "4", b"hi")
    # the server closed that kept-alive connection: the next request goes out again on a fresh one
    assert shard.request("POST", "/v1/lookup", b"12345678")[2] == b"hi"
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n"
    shard = _ShardConnections(_one_answer_server([chunked]), timeout=2)
    with pytest.raises(CubeUnavailableError, match="Content-Length"):
        shard.request("POST", "/v1/lookup", b"12345678")
