"""Serving throughput and latency: HTTP and gRPC, hot-key cache on and off, the dense-only limit, and
the same model behind ``mlflow models serve``.

    .venv/bin/python bench/bench_serving.py [--quick] [--pass PASS_DIR] [--load-lines N]

ElasticCTR side (as deployed): a serving process following the file server's cube/current.json,
looking embeddings up in 2 cube-server processes, run twice: with its hot-key embedding cache (the
default) and with ``--cache-entries 0``. Peer: the same pass as an MLflow pyfunc model
(bench/mlflow_ctr_model.py: dense model + the pass's sparse table in-process) behind ``mlflow models
serve --env-manager local`` (1 uvicorn worker). All are first checked to give the golden
probabilities (HTTP and gRPC alike). Then, for single-instance and 32-instance requests at
concurrency 1, 8 and 32, it prints requests/s, predictions/s, p50 and p99 and the ratios ElasticCTR
/ MLflow. The request bodies are real Criteo lines the pass was not trained on (``--load-lines``,
default 20,000, cycled), so the cache sees a real key distribution.

Load generators: HTTP requests go through bench/loadgen.c (compiled here; a C epoll client with
keep-alive connections, the same for ElasticCTR and MLflow, so neither pays for a Python client on
the shared cores). gRPC is measured twice. First as a Python application calls it: a grpc.aio client
in its own process cycling over the same bodies (its CPU, about 1 ms per 32-line call, comes off the
same 2 cores). Then server against server: nghttp2's h2load (C, Debian's nghttp2-client; one stream in
flight per connection, as loadgen.c) sends one gRPC request over and over, and loadgen.c sends the
same lines as one HTTP request over and over at the same concurrency; "gRPC / HTTP" is the ratio of
those two (h2load sends a single body, so the HTTP side of that comparison repeats one body too).
Without h2load that comparison is skipped and says so. Each row also prints the CPU the load generator
took per request ("client CPU", ms; for the grpc.aio client with its start-up), which comes off the same
2 cores as serving's.

The dense-only limit is measured in the same run: the pass's dense program alone (paddle.inference,
what serving runs), batches of 2048 pooled rows, one predictor per core, both cores. "share of
limit" = serving's predictions/s / that limit.

Without --pass it first trains a pass with the product pipeline (`elastic-control data criteo` +
`elastic-control train`, the product's default model unless --train-args says otherwise, as the figures
in docs/benchmarks.md are) on 20k real Criteo lines (5k with
--quick), which takes about a minute.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

import mlflow  # noqa: E402,F401
import pyarrow  # noqa: E402,F401  (before paddle)

from bench_support import (  # noqa: E402
    PYTHON,
    criteo_pass,
    criteo_slot_lines,
    cube_servers,
    fileserver_in_thread,
    free_port,
    golden,
    process,
    publish_version,
)

TRAIN_LINES, TRAIN_LINES_QUICK = 20000, 5000


def serving_body(lines):
    return json.dumps({"instances": [{"line": ln} for ln in lines]}).encode()


def mlflow_body(lines):
    return json.dumps({"dataframe_split": {"columns": ["line"], "data": [[ln] for ln in lines]}}).encode()


def post(conn: http.client.HTTPConnection, path: str, body: bytes) -> dict:
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    if resp.status != 200:
        raise RuntimeError(f"{path}: HTTP {resp.status}: {data[:300]!r}")
    return json.loads(data)


# ---- load generators ----------------------------------------------------------------------------


def build_loadgen(work: Path) -> str:
    from bench_cube import build_loadgen as build

    exe = build(work)
    if exe is None:
        raise SystemExit("bench/loadgen.c did not compile (a C compiler is needed for the HTTP load generator)")
    return exe


def http_requests(path: str, bodies: list[bytes]) -> list[bytes]:
    return [
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(b)}\r\n\r\n".encode()
        + b
        for b in bodies
    ]


def http_load(exe: str, port: int, requests: list[bytes], work: Path, conc: int, seconds: float, pid=None) -> dict:
    """loadgen.c with ``concurrency`` keep-alive connections; answer length 0 = read its Content-Length."""
    from bench_cube import run_loadgen, write_request_file

    path = write_request_file(work / f"req-{port}-{conc}-{len(requests)}.bin", requests, [0] * len(requests))
    cpu0 = cpu_seconds(pid) if pid else None
    client0 = children_cpu_seconds()
    r = run_loadgen(exe, port, path, conc, seconds, 1)
    out = {"rps": r["requests_per_s"], "p50": r["p50_ms"], "p99": r["p99_ms"], "n": r["requests"]}
    out["client_cpu_ms_per_request"] = (children_cpu_seconds() - client0) * 1000 / max(r["requests"], 1)
    if pid:
        out["cpu_ms_per_request"] = (cpu_seconds(pid) - cpu0) * 1000 / max(r["requests"], 1)
    return out


def grpc_load(target: str, lines_groups: list[list[str]], concurrency: int, seconds: float, work: Path) -> dict:
    """Closed-loop gRPC load from a separate process (grpc.aio, ``concurrency`` calls in flight)."""
    spec = work / "grpc-load.json"
    spec.write_text(json.dumps({"target": target, "groups": lines_groups, "c": concurrency, "s": seconds}))
    client0 = children_cpu_seconds()
    r = subprocess.run(
        [PYTHON, __file__, "--grpc-load", str(spec)], capture_output=True, text=True, timeout=seconds + 120
    )
    if r.returncode != 0:
        raise SystemExit(f"gRPC load failed: {r.stderr[-2000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["client_cpu_ms_per_request"] = (children_cpu_seconds() - client0) * 1000 / max(out["n"], 1)  # with start-up
    return out


def grpc_h2load(exe: str, target: str, lines: list[str], concurrency: int, seconds: float, work: Path, pid=None):
    """gRPC from h2load (C, HTTP/2): ``concurrency`` connections, one call in flight on each, one request body."""
    from ctr_foundation.grpc_api import serving_pb2

    message = serving_pb2.PredictRequest(instances=[serving_pb2.Instance(line=ln) for ln in lines]).SerializeToString()
    body = work / "h2load-body.bin"
    body.write_bytes(b"\0" + struct.pack(">I", len(message)) + message)  # gRPC framing: uncompressed, length
    log = work / "h2load.log"
    log.unlink(missing_ok=True)  # h2load appends
    cpu0 = cpu_seconds(pid) if pid else None
    client0 = children_cpu_seconds()
    r = subprocess.run(
        [exe, "-D", str(max(1, round(seconds))), "-c", str(concurrency), "-m", "1", "-d", str(body)]
        + ["-H", "content-type: application/grpc", "-H", "te: trailers", "--log-file", str(log)]
        + [f"http://{target}/elasticctr.serving.v1.Prediction/Predict"],
        capture_output=True,
        text=True,
        timeout=seconds + 60,
    )
    rows = [ln.split("\t") for ln in log.read_text().splitlines() if ln.strip()]
    ok = [int(row[2]) / 1000 for row in rows if row[1] == "200"]
    if r.returncode != 0 or not ok or len(ok) < len(rows):
        raise SystemExit(f"h2load failed ({len(rows) - len(ok)} of {len(rows)} calls not 200): {r.stdout[-800:]}")
    starts = [int(row[0]) for row in rows]
    elapsed = max(1e-9, (max(s + int(row[2]) for s, row in zip(starts, rows, strict=True)) - min(starts)) / 1e6)
    out = {"rps": len(ok) / elapsed, "p50": float(np.percentile(ok, 50)), "p99": float(np.percentile(ok, 99))}
    out["n"] = len(ok)
    out["client_cpu_ms_per_request"] = (children_cpu_seconds() - client0) * 1000 / len(ok)
    if pid:
        out["cpu_ms_per_request"] = (cpu_seconds(pid) - cpu0) * 1000 / len(ok)
    return out


def _grpc_load_main(spec_path: str) -> None:
    import asyncio

    import grpc

    from ctr_foundation.grpc_api import serving_pb2, serving_pb2_grpc

    spec = json.loads(Path(spec_path).read_text())
    reqs = [serving_pb2.PredictRequest(instances=[serving_pb2.Instance(line=ln) for ln in g]) for g in spec["groups"]]

    async def main():
        async with grpc.aio.insecure_channel(spec["target"]) as ch:
            stub = serving_pb2_grpc.PredictionStub(ch)
            await stub.Predict(reqs[0])
            stop = time.perf_counter() + spec["s"]
            lat: list[float] = []

            async def client(i):
                k = i
                while time.perf_counter() < stop:
                    t0 = time.perf_counter()
                    await stub.Predict(reqs[k % len(reqs)])
                    lat.append(time.perf_counter() - t0)
                    k += spec["c"]

            t0 = time.perf_counter()
            await asyncio.gather(*(client(i) for i in range(spec["c"])))
            elapsed = time.perf_counter() - t0
        a = np.array(lat) * 1000
        print(
            json.dumps(
                {
                    "rps": len(a) / elapsed,
                    "p50": float(np.percentile(a, 50)),
                    "p99": float(np.percentile(a, 99)),
                    "n": len(a),
                }
            )
        )

    asyncio.run(main())


# ---- the dense-only limit ------------------------------------------------------------------------


def dense_limit(pass_dir: Path, seconds: float) -> dict:
    r = subprocess.run(
        [PYTHON, __file__, "--dense-only", str(pass_dir), "--seconds", str(seconds)],
        capture_output=True,
        text=True,
        timeout=seconds * 4 + 120,
    )
    if r.returncode != 0:
        raise SystemExit(f"dense-only measurement failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _dense_only_main(pass_dir: str, seconds: float) -> None:
    """Predictions/s of the dense program alone: batch 2048, one predictor per thread, 1 and 2 threads."""
    from ctr_foundation.pass_format import load_pass

    info = load_pass(pass_dir)
    width = len(info.slots) * info.embedding_dim
    x = np.random.default_rng(0).normal(0, 0.05, (2048, width)).astype(np.float32)
    out = {}
    for onednn in (False, True):
        for threads in (1, 2):
            out[f"onednn_{'on' if onednn else 'off'}_threads_{threads}"] = _dense_rate(
                Path(pass_dir) / "dense" / "inference", x, threads, seconds, onednn
            )
    out["threads_1"] = max(out["onednn_off_threads_1"], out["onednn_on_threads_1"])
    out["threads_2"] = max(out["onednn_off_threads_2"], out["onednn_on_threads_2"])
    print(json.dumps(out))


def _dense_rate(prefix: Path, x: np.ndarray, threads: int, seconds: float, onednn: bool) -> float:
    from elastic_control.inference.scoring import DenseModel, import_paddle

    import_paddle()  # what serving does: MKL's AVX2 kernels on AMD

    counts = [0] * threads
    barrier = threading.Barrier(threads + 1)
    stop = [float("inf")]

    def run(i):
        model = DenseModel(prefix, onednn=onednn, bind_thread=True)  # created in the thread that runs it
        model.predict(x)
        barrier.wait()
        while time.perf_counter() < stop[0]:
            model.predict(x)
            counts[i] += len(x)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    stop[0] = t0 + seconds
    for t in ts:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


# ---- setup ------------------------------------------------------------------------------------------


def held_out_lines(skip: int, count: int) -> list[str]:
    """Real Criteo lines after the first ``skip`` (not trained on), in the slot format."""
    return criteo_slot_lines(skip, count)


@contextlib.contextmanager
def serving_process(work: Path, fs_url: str, urls: list[str], env: dict, *, cache_entries: int, name: str):
    """serving on free ports, up to its readiness; started again on other ports if another process took them
    between the pick and the bind (the machine is shared)."""
    for attempt in range(3):
        port, gport = free_port(), free_port()
        args = [PYTHON, "-m", "elastic_control", "serve", "--host", "127.0.0.1", "--port", str(port)]
        args += ["--grpc-port", str(gport), "--fileserver", fs_url, "--cube-servers", ",".join(urls)]
        args += ["--cache-dir", str(work / f"cache-{name}"), "--cache-entries", str(cache_entries)]
        log = work / f"serving-{name}-{attempt}.log"
        with process(args, env_extra=env, log_path=log) as proc:
            if not _wait_ready(proc, port, log):
                continue
            yield proc, port, f"127.0.0.1:{gport}"
            return
    raise SystemExit(f"serving could not bind free ports three times; see {log}")


def _wait_ready(proc, port: int, log: Path) -> bool:
    """True once /readyz answers 200; False if serving exited because its port was taken; SystemExit otherwise."""
    deadline = time.monotonic() + 240
    while True:
        with contextlib.suppress(OSError, http.client.HTTPException):
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/readyz")
            if c.getresponse().status == 200:
                return True
        if proc.poll() is not None:
            if "Address already in use" in log.read_text(errors="replace"):
                return False
            raise SystemExit(f"serving exited with {proc.returncode}; see {log}")
        if time.monotonic() > deadline:
            raise SystemExit(f"serving did not get ready in 240 s; see {log}")
        time.sleep(0.2)


def cpu_seconds(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def children_cpu_seconds() -> float:
    """User + system CPU of this process's finished children: the load generators, which share the 2 cores."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def check_grpc(target: str, lines: list[str], http_port: int) -> float:
    """Max |gRPC - HTTP| over the same lines (and the versions must match)."""
    import grpc

    from ctr_foundation.grpc_api import serving_pb2, serving_pb2_grpc

    with grpc.insecure_channel(target) as ch:
        g = serving_pb2_grpc.PredictionStub(ch).Predict(
            serving_pb2.PredictRequest(instances=[serving_pb2.Instance(line=ln) for ln in lines]), timeout=30
        )
    conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=60)
    h = post(conn, "/v1/predict", serving_body(lines))
    assert (g.model_version, g.cube_version) == (h["model_version"], h["cube_version"]), (g, h)
    return float(np.max(np.abs(np.array(g.probabilities) - np.array(h["predictions"]))))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short runs (1.5 s per point instead of 6 s)")
    ap.add_argument("--pass", dest="pass_dir", default=None, help="a pass folder (default: train a small one)")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--load-lines", type=int, default=20000, help="held-out real Criteo lines the requests cycle over")
    ap.add_argument("--no-mlflow", action="store_true", help="skip the mlflow models serve peer")
    ap.add_argument(
        "--train-args",
        default="",
        help="options for `elastic-control train` when no --pass is given (default: the product's model, wide_deep "
        "128-64, as in docs/benchmarks.md; the original model: --train-args='--model dnn --hidden 400,400,400')",
    )
    ap.add_argument("--grpc-load", help=argparse.SUPPRESS)
    ap.add_argument("--dense-only", help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=3.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.grpc_load:
        return _grpc_load_main(args.grpc_load)
    if args.dense_only:
        return _dense_only_main(args.dense_only, args.seconds)
    seconds = 1.5 if args.quick else 6.0
    work = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    print(f"work folder {work}", file=sys.stderr)
    trained = TRAIN_LINES_QUICK if args.quick else TRAIN_LINES
    pass_dir = (
        Path(args.pass_dir)
        if args.pass_dir
        else criteo_pass(work / "train", lines=trained, train_args=shlex.split(args.train_args))
    )
    lines, probs = golden(pass_dir)
    load_lines = held_out_lines(TRAIN_LINES + 1000, args.load_lines)
    fs_root = work / "fs"
    publish_version(fs_root, pass_dir, shards=args.shards)
    exe = build_loadgen(work)
    h2load = shutil.which("h2load")
    if not h2load:
        print("h2load not found (apt-get install nghttp2-client): gRPC vs HTTP from C clients is skipped", flush=True)

    limit = dense_limit(pass_dir, 1.5 if args.quick else 4.0)
    print(
        f"dense-only limit (the pass's dense program, batch 2048): {limit['threads_1']:,.0f} predictions/s on one "
        f"core, {limit['threads_2']:,.0f} on both",
        flush=True,
    )
    print(
        "  oneDNN off / on (one predictor per thread, created in that thread): 1 thread "
        f"{limit['onednn_off_threads_1']:,.0f} / {limit['onednn_on_threads_1']:,.0f}, 2 threads "
        f"{limit['onednn_off_threads_2']:,.0f} / {limit['onednn_on_threads_2']:,.0f} predictions/s",
        flush=True,
    )
    dense_limit_2 = limit["threads_2"]

    # mlflow starts uvicorn by name: the venv's bin folder must be on PATH.
    env = {
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "bench")]),
        "OMP_NUM_THREADS": "1",
        "PATH": os.pathsep.join([str(Path(PYTHON).parent), os.environ.get("PATH", "")]),
    }
    sizes = (1, 32)
    groups = {s: [load_lines[i : i + s] for i in range(0, len(load_lines) - s + 1, s)] for s in sizes}
    results: dict = {}
    with contextlib.ExitStack() as stack:
        urls = stack.enter_context(cube_servers(fs_root / "cube", args.shards, work))
        fs_url = stack.enter_context(fileserver_in_thread(fs_root))
        for name, entries in (("cache", 1 << 20), ("nocache", 0)):
            with serving_process(work, fs_url, urls, env, cache_entries=entries, name=name) as (proc, port, target):
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                got = post(conn, "/v1/predict", serving_body(lines))["predictions"]
                diff = float(np.max(np.abs(np.array(got) - probs)))
                gdiff = check_grpc(target, lines, port)
                print(f"serving ({name}): max |HTTP - golden| {diff:.2e}, max |gRPC - HTTP| {gdiff:.2e}", flush=True)
                assert diff < 1e-5 and gdiff < 1e-6
                for size in sizes:
                    reqs = http_requests("/v1/predict", [serving_body(g) for g in groups[size]])
                    for conc in (1, 8, 32):
                        r = http_load(exe, port, reqs, work, conc, seconds, pid=proc.pid)
                        results[(name, "http", size, conc)] = r
                        print(f"  {name} http {size:>2} x c{conc:<2}: {_fmt(r, size)}", flush=True)
                        if name != "cache":
                            continue
                        g = grpc_load(target, groups[size][:2000], conc, seconds, work)
                        results[(name, "grpc", size, conc)] = g
                        print(f"  {name} grpc {size:>2} x c{conc:<2}: {_fmt(g, size)} (Python client)", flush=True)
                        if h2load:
                            one = groups[size][0]
                            h = http_load(exe, port, reqs[:1], work, conc, seconds, pid=proc.pid)
                            results[(name, "http-one", size, conc)] = h
                            print(f"  {name} http {size:>2} x c{conc:<2}: {_fmt(h, size)} (one body)", flush=True)
                            g = grpc_h2load(h2load, target, one, conc, seconds, work, pid=proc.pid)
                            results[(name, "grpc-one", size, conc)] = g
                            print(f"  {name} grpc {size:>2} x c{conc:<2}: {_fmt(g, size)} (one body)", flush=True)
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)  # serving closed the idle one
                conn.request("GET", "/v1/status")
                status = json.loads(conn.getresponse().read())
                results[(name, "status")] = status
        if not args.no_mlflow:
            _run_mlflow_peer(stack, work, env, pass_dir, lines, probs, exe, groups, seconds, results)
    _print_table(results, sizes, dense_limit_2, not args.no_mlflow)


def _run_mlflow_peer(stack, work, env, pass_dir, lines, probs, exe, groups, seconds, results) -> None:
    from mlflow_ctr_model import save

    model_path = save(str(pass_dir), str(work / "mlflow-model"))
    m_port = free_port()
    peer = stack.enter_context(
        process(
            [str(Path(PYTHON).parent / "mlflow"), "models", "serve", "-m", model_path, "--env-manager", "local"]
            + ["-h", "127.0.0.1", "-p", str(m_port), "-w", "1"],
            env_extra=env,
            log_path=work / "mlflow.log",
        )
    )
    deadline = time.monotonic() + 180
    while True:  # MLflow's scoring server answers /ping once the model is loaded
        with contextlib.suppress(OSError, http.client.HTTPException):
            c = http.client.HTTPConnection("127.0.0.1", m_port, timeout=2)
            c.request("GET", "/ping")
            if c.getresponse().status == 200:
                break
        if peer.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"mlflow models serve did not come up; see {work / 'mlflow.log'}")
        time.sleep(0.3)
    conn = http.client.HTTPConnection("127.0.0.1", m_port, timeout=60)
    got = post(conn, "/invocations", mlflow_body(lines))["predictions"]
    print(f"mlflow models serve: max |prediction - golden| {np.max(np.abs(np.array(got) - probs)):.2e}", flush=True)
    for size, gs in groups.items():
        reqs = http_requests("/invocations", [mlflow_body(g) for g in gs[:2000]])
        for conc in (1, 8, 32):
            r = http_load(exe, m_port, reqs, work, conc, seconds)
            results[("mlflow", "http", size, conc)] = r
            print(f"  mlflow http {size:>2} x c{conc:<2}: {_fmt(r, size)}", flush=True)


def _fmt(r: dict, size: int) -> str:
    cpu = f", serving CPU {r['cpu_ms_per_request']:.2f} ms/request" if "cpu_ms_per_request" in r else ""
    if "client_cpu_ms_per_request" in r:
        cpu += f", client CPU {r['client_cpu_ms_per_request']:.2f}"
    return f"{r['rps']:8.0f} req/s {r['rps'] * size:9.0f} pred/s  p50 {r['p50']:6.2f} ms  p99 {r['p99']:6.2f} ms{cpu}"


def _print_table(results: dict, sizes, dense_limit_2: float, with_mlflow: bool) -> None:
    print(
        f"\n{'inst':>4} {'conc':>4} | {'ElasticCTR HTTP cache':>30} | {'HTTP no cache':>22} | {'gRPC cache':>22} | "
        f"{'MLflow':>22} | {'vs MLflow':>9} | {'of dense limit':>14}"
    )

    def cell(r):
        return f"{r['rps']:6.0f}/s {r['p50']:6.2f} {r['p99']:6.2f}" if r else f"{'-':>22}"

    for size in sizes:
        for conc in (1, 8, 32):
            c = results.get(("cache", "http", size, conc))
            n = results.get(("nocache", "http", size, conc))
            g = results.get(("cache", "grpc", size, conc))
            m = results.get(("mlflow", "http", size, conc))
            pred = c["rps"] * size
            ratio = f"{c['rps'] / m['rps']:8.1f}x" if m else f"{'-':>9}"
            peer = cell(m) if with_mlflow else f"{'-':>22}"
            print(
                f"{size:>4} {conc:>4} | {cell(c)} {pred:7.0f}p/s | {cell(n)} | {cell(g)} | {peer} | "
                f"{ratio} | {pred / dense_limit_2:13.1%}"
            )
    print(
        "cells: requests/s, p50 ms, p99 ms; 'vs MLflow' = ElasticCTR HTTP (cache) req/s / MLflow req/s; "
        "gRPC cache: from a Python grpc.aio client"
    )
    if any(k[1] == "grpc-one" for k in results if isinstance(k, tuple) and len(k) == 4):
        print(
            f"\ngRPC vs HTTP, server against server (C clients, one body repeated, cache on)\n"
            f"{'inst':>4} {'conc':>4} | {'HTTP (loadgen.c)':>22} | {'gRPC (h2load)':>22} | {'gRPC / HTTP':>11}"
        )
        for size in sizes:
            for conc in (1, 8, 32):
                h = results.get(("cache", "http-one", size, conc))
                g = results.get(("cache", "grpc-one", size, conc))
                if h and g:
                    print(f"{size:>4} {conc:>4} | {cell(h)} | {cell(g)} | {g['rps'] / h['rps']:10.2f}x")
    for name in ("cache", "nocache"):
        st = results.get((name, "status"))
        if st:
            m = st["metrics"]
            ok = m["requests"].get("200", 0)
            cache = st.get("cache") or {}
            hit = f", cache hit rate {cache['hit_rate']:.1%}" if cache.get("hit_rate") is not None else ""
            print(
                f"serving ({name}): merged {ok} requests into {m['batches']} batches "
                f"({ok / max(m['batches'], 1):.1f} requests, {m['batch_instances'] / max(m['batches'], 1):.1f} "
                f"instances per batch){hit}"
            )


if __name__ == "__main__":
    main()
