"""Cube vs Redis: keys/s and latency of batched lookups on the same keys and values.

    .venv/bin/python bench/bench_cube.py            # 10M keys, 9 floats each
    .venv/bin/python bench/bench_cube.py --quick    # 1M keys

Both servers hold the same keys (uint64) and values (9 float32); queries have
10% missing keys. Cube: one cube-server process with --workers 2 (one per
core) answering POST /v1/lookup with binary bodies. Redis: Debian's
redis-server (single-threaded, default settings, persistence off) answering
MGET of 8-byte keys holding 36-byte values. Both on loopback, on free ports.

Load generator (the same for both): bench/loadgen.c, compiled with the
system C compiler at start: a closed loop over C keep-alive TCP connections
(epoll, one thread). Every request is pre-encoded and the exact length of
its answer is learned once beforehand (each request is asked once), so per
request the generator only sends and counts received bytes: a couple of
system calls, identical for both peers whatever their protocol, and cheap
enough not to be the bottleneck of either (a Python generator spent more
CPU per request than Redis does, and shares the same 2 cores). Latency is
per request, measured by the generator. Without a C compiler (or with
--generator python) the older single-process Python `selectors` generator is
used instead and says so. Each peer's server CPU time per request (user +
system, all its processes) is printed too: it is less sensitive than
wall-clock figures to what else runs on the machine (though not immune:
contention for caches inflates it too). Redis runs with default settings
(no io-threads), as Debian ships it; cube uses both cores (--workers 2).
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow  # noqa: F401

import numpy as np
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench_support import free_port  # noqa: E402

from cube.shard_format import write_shard  # noqa: E402

DIM = 9
MISS_FRACTION = 0.10


def make_data(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(1, 2**64 - 1, size=int(n * 1.001) + 10, dtype=np.uint64))[:n]
    rng.shuffle(keys)
    keys = np.sort(keys)
    values = rng.standard_normal((len(keys), DIM)).astype(np.float32)
    return keys, values


def make_queries(keys: np.ndarray, batch: int, count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    q = keys[rng.integers(0, len(keys), size=(count, batch))]
    miss = rng.random((count, batch)) < MISS_FRACTION
    q[miss] = rng.integers(1, 2**64 - 1, size=int(miss.sum()), dtype=np.uint64) | np.uint64(1)  # ~never present
    return list(q)


def is_present(sorted_keys: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Membership without np.isin (which re-sorts all keys on every call)."""
    pos = np.minimum(np.searchsorted(sorted_keys, q), len(sorted_keys) - 1)
    return sorted_keys[pos] == q


# ---- servers ----------------------------------------------------------------------------------


def start_cube(data_dir: Path, workers: int) -> tuple[subprocess.Popen, int]:
    ready = data_dir / "ready.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cube.server",
            "--port",
            "0",
            "--host",
            "127.0.0.1",
            "--shard",
            "0",
            "--data",
            str(data_dir / "v1"),
            "--workers",
            str(workers),
            "--ready-file",
            str(ready),
            "--state-dir",
            str(data_dir / "state"),
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    while not ready.exists():
        if proc.poll() is not None:
            raise SystemExit("cube-server failed to start")
        time.sleep(0.1)
    return proc, json.loads(ready.read_text())["port"]


def start_redis(port: int, workdir: Path) -> subprocess.Popen:
    exe = shutil.which("redis-server")
    if not exe:
        raise SystemExit("redis-server is not installed (apt-get install redis-server); it is the benchmark's peer")
    proc = subprocess.Popen(
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
            "--protected-mode",
            "no",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.05)
    raise SystemExit("redis-server did not start")


def load_redis(port: int, keys: np.ndarray, values: np.ndarray, chunk: int = 50_000) -> None:
    """MSET every key (8 raw bytes) -> value (36 raw bytes) with pre-built RESP, vectorised."""
    rec = np.dtype([("a", "S4"), ("k", "S8"), ("b", "S7"), ("v", f"V{4 * DIM}"), ("c", "S2")])
    with socket.create_connection(("127.0.0.1", port)) as s:
        for start in range(0, len(keys), chunk):
            k, v = keys[start : start + chunk], values[start : start + chunk]
            arr = np.empty(len(k), dtype=rec)
            arr["a"] = b"$8\r\n"
            arr["k"] = k.view("S8") if False else np.frombuffer(k.astype("<u8").tobytes(), "V8").view("S8")
            arr["b"] = b"\r\n$36\r\n"
            arr["v"] = np.frombuffer(np.ascontiguousarray(v, "<f4").tobytes(), f"V{4 * DIM}")
            arr["c"] = b"\r\n"
            s.sendall(f"*{2 * len(k) + 1}\r\n$4\r\nMSET\r\n".encode() + arr.tobytes())
            got = b""
            while not got.endswith(b"\r\n"):
                got += s.recv(64)
            if got != b"+OK\r\n":
                raise SystemExit(f"redis MSET failed: {got!r}")
    # Note: S8 views drop trailing NUL bytes, so keys are written from raw V8 bytes above.


# ---- request encodings ------------------------------------------------------------------------


def cube_request(port: int, q: np.ndarray) -> bytes:
    body = q.astype("<u8").tobytes()
    return (
        f"POST /v1/lookup HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/octet-stream\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def redis_request(q: np.ndarray) -> bytes:
    parts = [f"*{len(q) + 1}\r\n$4\r\nMGET\r\n".encode()]
    raw = q.astype("<u8").tobytes()
    for i in range(len(q)):
        parts.append(b"$8\r\n" + raw[8 * i : 8 * i + 8] + b"\r\n")
    return b"".join(parts)


def redis_answer_length(q: np.ndarray, present: np.ndarray) -> int:
    hits = int(present.sum())
    return len(f"*{len(q)}\r\n") + hits * (len(f"${4 * DIM}\r\n") + 4 * DIM + 2) + (len(q) - hits) * 5


# ---- the load generator -----------------------------------------------------------------------


class Conn:
    __slots__ = ("sock", "buf", "want", "t0", "i")

    def __init__(self, sock):
        self.sock, self.buf, self.want, self.t0, self.i = sock, bytearray(), None, 0.0, 0


def run_load(
    port: int, requests: list[bytes], expect: list[int] | None, clients: int, seconds: float, batch: int
) -> dict:
    """Closed loop: each of ``clients`` connections sends the next request when its answer is complete."""
    sel = selectors.DefaultSelector()
    conns = []
    for c in range(clients):
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.setblocking(False)
        conn = Conn(s)
        conn.i = c * 7919
        conns.append(conn)
        sel.register(s, selectors.EVENT_READ, conn)
    lat = []
    n_req = len(requests)
    done = 0

    def send(conn):
        idx = conn.i % n_req
        conn.i += clients
        conn.want = expect[idx] if expect is not None else None
        conn.buf.clear()
        conn.t0 = time.perf_counter()
        conn.sock.sendall(requests[idx])

    start = time.perf_counter()
    end = start + seconds
    for conn in conns:
        send(conn)
    while True:
        events = sel.select(timeout=10.0)
        if not events:
            raise SystemExit(
                f"no answer for 10 s (port {port}); partial buffers: {[(len(c.buf), c.want) for c in conns][:4]}"
            )
        for key, _ in events:
            conn = key.data
            chunk = conn.sock.recv(1 << 20)
            if not chunk:
                raise SystemExit("the server closed a connection")
            conn.buf += chunk
            if conn.want is None:  # HTTP: learn the length from the head
                head_end = conn.buf.find(b"\r\n\r\n")
                if head_end < 0:
                    continue
                head = bytes(conn.buf[:head_end]).lower()
                if not head.startswith(b"http/1.1 200"):
                    raise SystemExit(f"cube answered: {bytes(conn.buf[:200])!r}")
                cl = head.index(b"content-length:") + 15
                conn.want = head_end + 4 + int(head[cl : head.index(b"\r\n", cl) if b"\r\n" in head[cl:] else None])
            if len(conn.buf) >= conn.want:
                now = time.perf_counter()
                lat.append(now - conn.t0)
                done += 1
                if now < end:
                    if expect is None:
                        conn.want = None
                    send(conn)
                else:
                    sel.unregister(conn.sock)
                    conn.sock.close()
                    conns.remove(conn)
                    if expect is None:
                        conn.want = None
        if not conns:
            break
    elapsed = time.perf_counter() - start
    lat = np.array(lat)
    return {
        "keys_per_s": done * batch / elapsed,
        "requests_per_s": done / elapsed,
        "p50_ms": float(np.percentile(lat, 50) * 1e3),
        "p99_ms": float(np.percentile(lat, 99) * 1e3),
        "requests": done,
    }


# ---- the compiled load generator --------------------------------------------------------------


def build_loadgen(work: Path) -> str | None:
    """Compile bench/loadgen.c into ``work``; None if there is no C compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None
    exe = work / "loadgen"
    r = subprocess.run([cc, "-O2", "-o", str(exe), str(REPO / "bench" / "loadgen.c")], capture_output=True, text=True)
    if r.returncode != 0:
        print(f"loadgen.c did not compile, using the Python generator: {r.stderr.strip()[:300]}", flush=True)
        return None
    return str(exe)


def http_answer_lengths(port: int, requests: list[bytes]) -> list[int]:
    """Ask every request once on one keep-alive connection; the byte length of each whole answer."""
    lengths = []
    with socket.create_connection(("127.0.0.1", port)) as s:
        buf = b""
        for req in requests:
            s.sendall(req)
            while b"\r\n\r\n" not in buf:
                buf += s.recv(1 << 16)
            head_end = buf.index(b"\r\n\r\n") + 4
            head = buf[:head_end].lower()
            if not head.startswith(b"http/1.1 200"):
                raise SystemExit(f"cube answered: {buf[:200]!r}")
            at = head.index(b"content-length:") + 15
            total = head_end + int(head[at : head.index(b"\r\n", at)])
            while len(buf) < total:
                buf += s.recv(1 << 16)
            lengths.append(total)
            buf = buf[total:]
    return lengths


def write_request_file(path: Path, requests: list[bytes], answers: list[int]) -> Path:
    parts = [np.uint32(len(requests)).tobytes()]
    for req, ans in zip(requests, answers, strict=True):
        parts += [np.array([len(req), ans], "<u4").tobytes(), req]
    path.write_bytes(b"".join(parts))
    return path


def run_loadgen(exe: str, port: int, request_file: Path, clients: int, seconds: float, batch: int) -> dict:
    lat_file = request_file.with_suffix(".lat")
    r = subprocess.run(
        [exe, "127.0.0.1", str(port), str(clients), str(seconds), str(request_file), str(lat_file)],
        capture_output=True,
        text=True,
        timeout=seconds + 60,
    )
    if r.returncode != 0:
        raise SystemExit(f"loadgen failed: {r.stderr.strip()}")
    done, elapsed = r.stdout.split()
    done, elapsed = int(done), float(elapsed)
    lat = np.fromfile(lat_file, "<u4").astype(np.float64) / 1e9
    return {
        "keys_per_s": done * batch / elapsed,
        "requests_per_s": done / elapsed,
        "p50_ms": float(np.percentile(lat, 50) * 1e3),
        "p99_ms": float(np.percentile(lat, 99) * 1e3),
        "requests": done,
    }


def cpu_seconds(proc: subprocess.Popen) -> float:
    """User + system CPU of a server and all its worker processes so far."""
    total = 0.0
    try:
        root = psutil.Process(proc.pid)
        for p in [root, *root.children(recursive=True)]:
            t = p.cpu_times()
            total += t.user + t.system
    except psutil.NoSuchProcess:
        pass
    return total


def measured(run, proc: subprocess.Popen) -> dict:
    """Run one load, adding the server's CPU microseconds per request."""
    c0 = cpu_seconds(proc)
    res = run()
    res["server_cpu_us"] = (cpu_seconds(proc) - c0) / max(res["requests"], 1) * 1e6
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1M keys and shorter runs")
    ap.add_argument("--keys", type=int, default=None, help="number of keys (default 10M, --quick 1M)")
    ap.add_argument("--seconds", type=float, default=None, help="seconds per measurement (default 6, --quick 3)")
    ap.add_argument("--workers", type=int, default=2, help="cube-server worker processes")
    ap.add_argument(
        "--generator",
        choices=("c", "python"),
        default="c",
        help="load generator: the compiled bench/loadgen.c (default) or the Python selectors loop",
    )
    ap.add_argument("--batches", default="26,1000", help="comma-separated batch sizes to measure")
    ap.add_argument("--clients", default="1,16", help="comma-separated client counts to measure")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    client_counts = [int(c) for c in args.clients.split(",")]
    n = args.keys or (1_000_000 if args.quick else 10_000_000)
    seconds = args.seconds or (3.0 if args.quick else 6.0)
    work = Path(tempfile.mkdtemp(prefix="bench-cube-"))
    load_at_start = os.getloadavg()[0]
    procs = []
    try:
        t = time.time()
        keys, values = make_data(n)
        (work / "v1").mkdir()
        write_shard(work / "v1" / "shard-0.arrow", keys, values, version="bench", shard=0, shards=1)
        from cube.shard_format import sha256_file

        f = work / "v1" / "shard-0.arrow"
        (work / "v1" / "manifest.json").write_text(
            json.dumps(
                {
                    "version": "bench",
                    "shards": 1,
                    "dim": DIM,
                    "rows": len(keys),
                    "files": {
                        "shard-0.arrow": {
                            "shard": 0,
                            "rows": len(keys),
                            "size": f.stat().st_size,
                            "sha256": sha256_file(f),
                        }
                    },
                }
            )
        )
        print(
            f"data: {len(keys):,} keys x {DIM} float32, {MISS_FRACTION:.0%} misses per batch "
            f"(built in {time.time() - t:.1f}s)",
            flush=True,
        )
        cube_proc, cube_port = start_cube(work, args.workers)
        procs.append(cube_proc)
        redis_port = free_port()
        procs.append(start_redis(redis_port, work))
        t = time.time()
        load_redis(redis_port, keys, values)
        print(
            f"servers: cube-server --workers {args.workers} on :{cube_port}; redis-server on :{redis_port} "
            f"(loaded in {time.time() - t:.1f}s)",
            flush=True,
        )
        # Spot-check both answer the same vectors.
        q = make_queries(keys, 50, 1, seed=99)[0]
        import requests as rq

        r = rq.post(f"http://127.0.0.1:{cube_port}/v1/lookup", data=q.astype("<u8").tobytes(), timeout=10)
        cube_vals = np.frombuffer(r.content[: 50 * DIM * 4], "<f4").reshape(50, DIM)
        present = is_present(keys, q)
        pos = np.searchsorted(keys, q[present])
        assert np.array_equal(cube_vals[present], values[pos]) and not cube_vals[~present].any()

        exe = build_loadgen(work) if args.generator == "c" else None
        generator = (
            "bench/loadgen.c (compiled, epoll, one thread)"
            if exe
            else "the Python selectors loop in the benchmark process"
        )
        print(f"load generator: {generator}", flush=True)
        rows = []
        redis_proc = procs[1]
        for batch in batches:
            queries = make_queries(keys, batch, 4000 if batch <= 100 else 800, seed=batch)
            cube_reqs = [cube_request(cube_port, q) for q in queries]
            redis_reqs = [redis_request(q) for q in queries]
            expect = [redis_answer_length(q, is_present(keys, q)) for q in queries]
            if exe:
                cube_file = write_request_file(
                    work / f"cube-{batch}.req", cube_reqs, http_answer_lengths(cube_port, cube_reqs)
                )
                redis_file = write_request_file(work / f"redis-{batch}.req", redis_reqs, expect)
            for clients in client_counts:
                if exe:
                    res_c = measured(
                        lambda f=cube_file, c=clients, b=batch: run_loadgen(exe, cube_port, f, c, seconds, b), cube_proc
                    )
                    res_r = measured(
                        lambda f=redis_file, c=clients, b=batch: run_loadgen(exe, redis_port, f, c, seconds, b),
                        redis_proc,
                    )
                else:
                    res_c = measured(
                        lambda r=cube_reqs, c=clients, b=batch: run_load(cube_port, r, None, c, seconds, b), cube_proc
                    )
                    res_r = measured(
                        lambda r=redis_reqs, e=expect, c=clients, b=batch: run_load(redis_port, r, e, c, seconds, b),
                        redis_proc,
                    )
                rows.append((batch, clients, res_c, res_r))
                print(
                    f"batch {batch:5d}  clients {clients:2d} | cube {res_c['keys_per_s'] / 1e6:6.2f} Mkeys/s "
                    f"p50 {res_c['p50_ms']:6.2f} ms p99 {res_c['p99_ms']:6.2f} ms"
                    f" cpu {res_c['server_cpu_us']:5.0f} us/req"
                    f" | redis {res_r['keys_per_s'] / 1e6:6.2f} Mkeys/s p50 {res_r['p50_ms']:6.2f} ms p99 "
                    f"{res_r['p99_ms']:6.2f} ms cpu {res_r['server_cpu_us']:5.0f} us/req"
                    f" | cube/redis {res_c['keys_per_s'] / res_r['keys_per_s']:5.2f}x",
                    flush=True,
                )
        print("\nsummary (keys/s ratio cube/Redis):")
        for batch, clients, c, r in rows:
            print(f"  batch {batch:4d}, {clients:2d} clients: {c['keys_per_s'] / r['keys_per_s']:.2f}x")
        print(
            f"load generator: {generator}, on the same {os.cpu_count()} cores as both servers; "
            f"load average now {os.getloadavg()[0]:.1f} (at start {load_at_start:.1f})"
        )
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
