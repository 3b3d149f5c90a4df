"""Serving throughput and latency beside the same model served by ``mlflow models serve``.

    .venv/bin/python bench/bench_serving.py [--quick] [--pass PASS_DIR]

ElasticCTR side (as deployed): a serving process following the file server's
cube/current.json, looking embeddings up in 2 cube-server processes.
Peer: the same pass as an MLflow pyfunc model (bench/mlflow_ctr_model.py:
dense model + the pass's sparse table in-process) behind ``mlflow models
serve --env-manager local`` (1 uvicorn worker). Both are first checked to give
the same probabilities. Then, for single-instance and 32-instance requests
at concurrency 1, 8 and 32 (keep-alive client threads in this process), it
prints requests/s, p50 and p99 and the ratios ElasticCTR / MLflow.

Without --pass it first trains a pass with the product pipeline
(`elastic-control data criteo` + `elastic-control train`, the 400-400-400
model) on 20k real Criteo lines (5k with --quick), which takes about a minute.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
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
    cube_servers,
    fileserver_in_thread,
    free_port,
    golden,
    process,
    publish_version,
    wait_healthy,
)


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


def load(port: int, path: str, bodies: list[bytes], concurrency: int, seconds: float) -> dict:
    """Closed-loop load: ``concurrency`` keep-alive clients for ``seconds``; requests/s, p50, p99 (ms)."""
    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    stop = time.perf_counter() + seconds
    errors = []

    def client(i):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        k = i
        try:
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                post(conn, path, bodies[k % len(bodies)])
                latencies[i].append(time.perf_counter() - t0)
                k += concurrency
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            conn.close()

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"{len(errors)} client errors, first: {errors[0]}")
    lat = np.concatenate([np.array(ln) for ln in latencies]) * 1000
    return {
        "rps": len(lat) / elapsed,
        "p50": float(np.percentile(lat, 50)),
        "p99": float(np.percentile(lat, 99)),
        "n": len(lat),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short runs (1.5 s per point instead of 6 s)")
    ap.add_argument("--pass", dest="pass_dir", default=None, help="a pass folder (default: train a small one)")
    ap.add_argument("--shards", type=int, default=2)
    args = ap.parse_args()
    seconds = 1.5 if args.quick else 6.0
    work = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    print(f"work folder {work}", file=sys.stderr)
    if args.pass_dir:
        pass_dir = Path(args.pass_dir)
    else:
        pass_dir = criteo_pass(work / "train", lines=5000 if args.quick else 20000)
    lines, probs = golden(pass_dir)
    fs_root = work / "fs"
    publish_version(fs_root, pass_dir, shards=args.shards)

    from mlflow_ctr_model import save

    model_path = save(str(pass_dir), str(work / "mlflow-model"))
    # mlflow starts uvicorn by name: the venv's bin folder must be on PATH.
    env = {
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "bench")]),
        "OMP_NUM_THREADS": "1",
        "PATH": os.pathsep.join([str(Path(PYTHON).parent), os.environ.get("PATH", "")]),
    }
    s_port, m_port = free_port(), free_port()
    with contextlib.ExitStack() as stack:
        urls = stack.enter_context(cube_servers(fs_root / "cube", args.shards, work))
        fs_url = stack.enter_context(fileserver_in_thread(fs_root))
        serving = stack.enter_context(
            process(
                [
                    PYTHON,
                    "-m",
                    "elastic_control",
                    "serve",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(s_port),
                    "--fileserver",
                    fs_url,
                    "--cube-servers",
                    ",".join(urls),
                    "--cache-dir",
                    str(work / "cache"),
                ],
                env_extra=env,
                log_path=work / "serving.log",
            )
        )
        peer = stack.enter_context(
            process(
                [
                    str(Path(PYTHON).parent / "mlflow"),
                    "models",
                    "serve",
                    "-m",
                    model_path,
                    "--env-manager",
                    "local",
                    "-h",
                    "127.0.0.1",
                    "-p",
                    str(m_port),
                    "-w",
                    "1",
                ],
                env_extra=env,
                log_path=work / "mlflow.log",
            )
        )
        wait_healthy(f"http://127.0.0.1:{s_port}", serving, timeout=120)
        deadline = time.monotonic() + 120
        while True:  # MLflow's scoring server answers /ping once the model is loaded
            with contextlib.suppress(OSError, http.client.HTTPException):
                c = http.client.HTTPConnection("127.0.0.1", m_port, timeout=2)
                c.request("GET", "/ping")
                if c.getresponse().status == 200:
                    break
            if peer.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"mlflow models serve did not come up; see {work / 'mlflow.log'}")
            time.sleep(0.3)
        # Both must compute the same thing before their speed means anything.
        conn_s = http.client.HTTPConnection("127.0.0.1", s_port, timeout=60)
        conn_m = http.client.HTTPConnection("127.0.0.1", m_port, timeout=60)
        for _ in range(100):
            with contextlib.suppress(RuntimeError):
                got_s = post(conn_s, "/v1/predict", serving_body(lines[:32]))["predictions"]
                break
            time.sleep(0.2)
        got_m = post(conn_m, "/invocations", mlflow_body(lines[:32]))["predictions"]
        diff_s = float(np.max(np.abs(np.array(got_s) - np.array(probs[:32]))))
        diff_m = float(np.max(np.abs(np.array(got_m) - np.array(probs[:32]))))
        print(f"max |prediction - golden| over 32 lines: ElasticCTR {diff_s:.2e}, MLflow {diff_m:.2e}")
        assert diff_s < 1e-5 and diff_m < 1e-5

        print(
            f"\n{'instances':>9} {'conc':>4} | {'ElasticCTR req/s':>16} {'p50 ms':>7} {'p99 ms':>7} | "
            f"{'MLflow req/s':>12} {'p50 ms':>7} {'p99 ms':>7} | {'req/s x':>7} {'p50 x':>6} {'p99 x':>6}"
        )
        for size in (1, 32):
            groups = [lines[i : i + size] for i in range(0, len(lines) - size + 1, max(size, 1))]
            sb = [serving_body(g) for g in groups]
            mb = [mlflow_body(g) for g in groups]
            for conc in (1, 8, 32):
                s = load(s_port, "/v1/predict", sb, conc, seconds)
                m = load(m_port, "/invocations", mb, conc, seconds)
                print(
                    f"{size:>9} {conc:>4} | {s['rps']:>16.0f} {s['p50']:>7.2f} {s['p99']:>7.2f} | "
                    f"{m['rps']:>12.0f} {m['p50']:>7.2f} {m['p99']:>7.2f} | {s['rps'] / m['rps']:>6.1f}x "
                    f"{m['p50'] / s['p50']:>5.1f}x {m['p99'] / s['p99']:>5.1f}x",
                    flush=True,
                )
        print(
            "\nratios: req/s = ElasticCTR / MLflow (higher is better for ElasticCTR); "
            "p50/p99 = MLflow latency / ElasticCTR latency"
        )
        conn_s.request("GET", "/v1/status")
        stats = json.loads(conn_s.getresponse().read())["metrics"]
        ok = stats["requests"].get("200", 0)
        print(
            f"ElasticCTR merged {ok} requests into {stats['batches']} batches "
            f"({ok / max(stats['batches'], 1):.1f} requests, "
            f"{stats['batch_instances'] / max(stats['batches'], 1):.1f} instances per batch on average)"
        )


if __name__ == "__main__":
    main()
