"""Serving keeps requests apart: an instance's probability does not depend on the batch it lands in, a
stalled cube shard delays only the requests that need one of its keys, and a client sending large
requests does not starve the clients of small ones."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import threading
import time

import pyarrow  # noqa: F401  (before paddle)

import numpy as np
import requests
from helpers_common import PYTHON, free_port, process, wait_healthy
from helpers_cube import cube_processes, server_args
from helpers_serving import golden, publish_version, serving_in_thread

from ctr_foundation.pass_format import load_pass
from elastic_control.serving.versions import CubeRootSource, ModelDirSource

TOKEN = "t0ken"  # cube's write token in helpers_serving


# ---- the same bits whatever the batch ---------------------------------------------------------------------


def test_a_row_scores_the_same_bits_alone_and_anywhere_in_batches_of_any_size(synth_world):
    from elastic_control.inference.scoring import DENSE_BLOCK_ROWS, DenseModel

    info = load_pass(synth_world.latest)
    width = len(info.slots) * info.embedding_dim + len(info.dense_slots)
    model = DenseModel(info.path / "dense" / "inference", onednn=False, block_rows=DENSE_BLOCK_ROWS)
    rng = np.random.default_rng(7)
    rows = rng.normal(0, 0.5, (48, width)).astype(np.float32)
    alone = np.array([model.predict(rows[i : i + 1])[0] for i in range(len(rows))], np.float32)
    differ = []
    for size in (2, 3, 7, 8, 31, 32, 33, 63, 64, 65, 100, 128, 250, 1000, 2048):
        for trial in range(3):
            batch = rng.normal(0, 0.5, (size, width)).astype(np.float32)
            at = rng.choice(size, min(size, len(rows)), replace=False)  # rows at random places among others
            batch[at] = rows[: len(at)]
            got = model.predict(batch)[at]
            bad = np.flatnonzero(got.view(np.uint32) != alone[: len(at)].view(np.uint32))
            differ += [(size, trial, int(at[i])) for i in bad]
    assert differ == [], f"(batch size, trial, position) where a row's bits changed: {differ[:20]}"


def test_an_instance_gets_the_same_bits_alone_and_inside_merged_requests(synth_world):
    lines, _ = golden(synth_world.latest)
    lines = lines[:40]
    with serving_in_thread(ModelDirSource(synth_world.models), workers=2) as srv:
        s = requests.Session()
        alone = [s.post(srv.url + "/v1/predict", json={"instances": [{"line": ln}]}).json() for ln in lines]
        alone = [a["predictions"][0] for a in alone]
        # the same lines inside requests of several sizes, sent by concurrent clients so batches merge
        got: dict[int, set[float]] = {i: set() for i in range(len(lines))}
        sizes = (3, 17, 64, 200, 700)

        def client(c):
            cs = requests.Session()
            for k in range(6):
                size = sizes[(c + k) % len(sizes)]
                order = np.random.default_rng(c * 100 + k).integers(0, len(lines), size)
                r = cs.post(srv.url + "/v1/predict", json={"instances": [{"line": lines[j]} for j in order]})
                assert r.status_code == 200, r.text
                for j, p in zip(order.tolist(), r.json()["predictions"], strict=True):
                    got[j].add(p)

        threads = [threading.Thread(target=client, args=(c,)) for c in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    differ = {i: sorted(v) for i, v in got.items() if v and v != {alone[i]}}
    assert differ == {}, {i: (alone[i], v) for i, v in list(differ.items())[:5]}


# ---- a stalled shard ------------------------------------------------------------------------------------


def _line_on_shard(rng, shard: int, shards: int = 2) -> str:
    """A line of four never-seen feasigns, all held by ``shard`` (key % shards): a cache miss there alone."""
    feasigns = (rng.integers(1 << 40, 1 << 60, 4, dtype=np.uint64) // shards) * shards + shard
    return "0 0 " + " ".join(f"{int(f)}:{slot}" for f, slot in zip(feasigns, (1, 2, 3, 4), strict=True))


def test_a_stalled_shard_delays_only_the_requests_that_need_it(synth_world, tmp_path):
    """SIGSTOP of one cube-server: requests answered from serving's cache, and requests whose missing keys
    are on the other shard, keep their latency; each request that needs the stalled shard is a 503 naming
    it after at most about the lookup timeout; and once it runs again, so do they."""
    fs_root = tmp_path / "fs"
    publish_version(fs_root, synth_world.latest, shards=2)
    cube_root = fs_root / "cube"
    lines, _ = golden(synth_world.latest)
    cached = lines[:64]
    rng = np.random.default_rng(5)
    timeout = 1.0
    specs = [("server", server_args(cube_root, i), f"cube-{i}") for i in range(2)]
    with cube_processes(specs, tmp_path, env_extra={"ELASTIC_CTR_TOKEN": TOKEN}) as started:
        urls = [u for u, _ in started]
        stalled = started[1][1]
        source = CubeRootSource(cube_root, urls, lookup_timeout=timeout)
        # A cache large enough that no three of the test's keys share one of its two-way sets (at 1 << 16 the
        # other requests' keys evicted a 'cached' key now and then, which then needed the stalled shard).
        with serving_in_thread(source, probe_interval=0.5, cache_entries=1 << 21) as srv:
            s = requests.Session()
            predict = srv.url + "/v1/predict"
            r = s.post(predict, json={"instances": [{"line": ln} for ln in cached]})  # the cache holds them now
            assert r.status_code == 200, r.text
            warm = r.json()["predictions"]
            results: dict[str, list] = {"cached": [], "other shard": [], "stalled shard": []}
            stop = threading.Event()

            def client(kind):
                cs = requests.Session()
                k = 0
                while not stop.is_set():
                    if kind == "cached":
                        body = {"instances": [{"line": cached[(k * 7 + j) % len(cached)]} for j in range(4)]}
                    else:
                        body = {"instances": [{"line": _line_on_shard(rng, 0 if kind == "other shard" else 1)}]}
                    t = time.perf_counter()
                    r = cs.post(predict, json=body, timeout=30)
                    results[kind].append((time.perf_counter() - t, r.status_code, r.text, k))
                    k += 1

            stalled.send_signal(signal.SIGSTOP)
            try:
                threads = [threading.Thread(target=client, args=(kind,)) for kind in results for _ in range(2)]
                for t in threads:
                    t.start()
                time.sleep(6)
                stop.set()
                for t in threads:
                    t.join()
            finally:
                stalled.send_signal(signal.SIGCONT)
            deadline = time.monotonic() + 10  # running again: its keys are answered again
            while (r := s.post(predict, json={"instances": [{"line": _line_on_shard(rng, 1)}]})).status_code != 200:
                assert time.monotonic() < deadline, r.text
                time.sleep(0.2)
            again = s.post(predict, json={"instances": [{"line": ln} for ln in cached]}).json()["predictions"]
    for kind in ("cached", "other shard"):
        got = results[kind]
        assert len(got) > 20 and {c for _, c, _, _ in got} == {200}, (kind, [t for _, c, t, _ in got if c != 200][:3])
        slowest = max(d for d, _, _, _ in got)
        assert slowest < 0.5, f"{kind}: the slowest request took {slowest:.2f}s while a shard was stalled"
    got = results["stalled shard"]
    assert got and {c for _, c, _, _ in got} == {503}, {c for _, c, _, _ in got}
    assert all(urls[1] in json.loads(t)["error"] for _, _, t, _ in got), got[0][2]
    assert max(d for d, _, _, _ in got) < timeout + 1.0, max(d for d, _, _, _ in got)
    assert again == warm


# ---- large requests do not starve small ones ------------------------------------------------------------


def _post_bytes(sock: socket.socket, body: bytes) -> bytes:
    sock.sendall(
        b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += sock.recv(65536)
    head, _, rest = buf.partition(b"\r\n\r\n")
    length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")).split(b":")[1])
    while len(rest) < length:
        rest += sock.recv(max(65536, length - len(rest)))
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    return rest


def _small_latencies(port: int, lines: list[str], clients: int, requests_each: int) -> list[float]:
    out: list[float] = []

    def client(c):
        with socket.create_connection(("127.0.0.1", port)) as sock:
            for k in range(requests_each):
                body = json.dumps({"instances": [{"line": lines[(c * 31 + k) % len(lines)]}]}).encode()
                t = time.perf_counter()
                _post_bytes(sock, body)
                out.append(time.perf_counter() - t)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@contextlib.contextmanager
def _large_client(port: int, lines: list[str], instances: int):
    body = json.dumps({"instances": [{"line": lines[j % len(lines)]} for j in range(instances)]}).encode()
    stop, done = threading.Event(), []

    def loop():
        with socket.create_connection(("127.0.0.1", port)) as sock:
            while not stop.is_set() and len(done) < 500:
                t = time.perf_counter()
                _post_bytes(sock, body)
                done.append(time.perf_counter() - t)

    t = threading.Thread(target=loop)
    t.start()
    try:
        while not done:  # the large requests are flowing
            time.sleep(0.05)
        yield done
    finally:
        stop.set()
        t.join()


def test_small_requests_keep_their_latency_while_a_client_loops_large_requests(synth_world, tmp_path):
    """8 clients of one-line requests, quiet and then beside a client looping 10,000-instance requests:
    the small requests' p99 stays within 3x its quiet value (or 100 ms: a loaded 2-core machine)."""
    lines, _ = golden(synth_world.latest)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [PYTHON, "-m", "elastic_control", "serve", "--host", "127.0.0.1", "--port", str(port), "--no-grpc"]
    argv += ["--model-dir", str(synth_world.models)]
    with process(argv, log_path=tmp_path / "serving.log") as proc:
        wait_healthy(url, proc, 120)
        deadline = time.monotonic() + 60
        while requests.get(url + "/readyz", timeout=5).status_code != 200:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        _small_latencies(port, lines, 8, 20)  # warm up
        quiet = np.percentile(_small_latencies(port, lines, 8, 100), 99)
        with _large_client(port, lines, 10_000) as large:
            loaded = np.percentile(_small_latencies(port, lines, 8, 100), 99)
        assert large, "no large request was answered"
    assert loaded <= max(3 * quiet, 0.1), f"p99 {loaded * 1000:.1f} ms beside large requests, {quiet * 1000:.1f} quiet"
