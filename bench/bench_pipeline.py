"""Stage timings of the whole local pipeline (the main job), printed.

Runs `elastic-control demo` (library call, --keep) and then reads back what
the pipeline recorded: data generation, -r and -a, training per pass, cube
build and rollout per pass, freshness (donefile line -> serving answers with
the pass), and predictions/s through the client. The peer for predictions is
offline scoring of the same lines with the same pass in this process (sparse
table in memory + the dense inference model, elastic_control.inference.scoring): the
ratio says what the HTTP/cube path costs.

    .venv/bin/python bench/bench_pipeline.py            # 3 hours x 20000 lines, 2 trainers, 1 pserver, 2 shards
    .venv/bin/python bench/bench_pipeline.py --quick    # 2 hours x 3000 lines, 1 trainer
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow  # noqa: F401  (before paddle, which elastic_control.inference.scoring imports)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (a couple of minutes)")
    ap.add_argument("--workdir", default=None, help="where to run (default: a temporary folder)")
    ap.add_argument("--criteo", default=None, help="raw Criteo file instead of synthetic data")
    args = ap.parse_args()
    size = (
        dict(hours=2, lines_per_hour=3000, trainers=1, pservers=1, shards=2)
        if args.quick
        else dict(hours=3, lines_per_hour=20000, trainers=2, pservers=1, shards=2)
    )
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-pipeline-"))

    from ctr_foundation.records import read_donefile
    from elastic_control import api
    from elastic_control.demo.run import predict_through_client, run_demo

    print(f"pipeline benchmark: {size} in {workdir}", flush=True)
    report = run_demo(workdir=str(workdir), keep=True, criteo=args.criteo, timeout=1500, **size)
    state = Path(report.state_dir)
    try:
        job = api.attach(state_dir=str(state)).status(probe=False).training
        entries = read_donefile(workdir / "models")
        rows = []
        previous = job.get("started_at")
        for e in entries:
            t = e.epoch
            rows.append((e.pass_name, None if t is None or previous is None else t - previous))
            previous = t if t is not None else previous
        rollouts = {r["version"]: r for r in report.rollouts}

        heldout = workdir / "data"
        hour_dirs = sorted(p for p in heldout.glob("*/*") if p.is_dir())
        lines = [ln for p in sorted(hour_dirs[-1].glob("part-*")) for ln in p.read_text().splitlines() if ln.strip()]
        n = min(len(lines), 5000)
        lines = lines[:n]

        # Predictions through the client: batches of 256, and one line per request (latency).
        _, _, secs_batched = predict_through_client(state, lines, batch_size=256)
        single = lines[:300]
        from client.api import ServingClient, resolve_client_settings

        client = ServingClient(resolve_client_settings(state_dir=state).serving_url)
        lat = []
        for line in single:
            t0 = time.perf_counter()
            client.predict_instances([{"line": line}])
            lat.append(time.perf_counter() - t0)

        # The peer: offline scoring of the same lines with the same pass, in this process.
        from ctr_foundation.pass_format import load_pass
        from elastic_control.inference.scoring import DenseModel, InMemoryTable, score_lines

        info = load_pass(workdir / "models" / report.served_version)
        table, model = InMemoryTable.from_pass(info), DenseModel.from_pass(info)
        t0 = time.perf_counter()
        for i in range(0, n, 256):
            score_lines(lines[i : i + 256], info, table.lookup, model)
        secs_offline = time.perf_counter() - t0
    finally:
        api.delete(state_dir=str(state))

    t = report.timings
    print()
    print("stage                               seconds")
    print(f"  data                               {t.get('data', 0):8.1f}")
    print(f"  -r render                          {t.get('render', 0):8.1f}")
    print(f"  -a start every component           {t.get('startup', 0):8.1f}")
    print(
        f"  training, all passes               {t.get('training', 0):8.1f}   (job restarts: {job.get('restarts', 0)})"
    )
    for name, secs in rows:
        r = rollouts.get(name, {})

        def fmt(v):
            return f"{v:8.1f}" if isinstance(v, (int, float)) else "       -"

        print(
            f"  {name}: train {fmt(secs)}  cube build {fmt(r.get('build_s'))}  rollout {fmt(r.get('total_s'))}"
            f"  freshness {fmt(r.get('freshness_s'))}"
        )
    print(f"  predictions ({n} lines, batches of 256) {secs_batched:8.2f}")
    print(f"  total (demo)                       {t.get('total', 0):8.1f}")
    print()
    client_rate = n / secs_batched
    offline_rate = n / secs_offline
    print(f"predictions/s through the client (batch 256): {client_rate:10.0f}")
    print(f"predictions/s offline scoring, same pass (peer): {offline_rate:7.0f}")
    print(f"ratio client/offline: {client_rate / offline_rate:.2f}x")
    lat_ms = sorted(x * 1000 for x in lat)
    print(
        f"one-line requests: p50 {statistics.median(lat_ms):.2f} ms, "
        f"p99 {lat_ms[int(0.99 * (len(lat_ms) - 1))]:.2f} ms, "
        f"{len(lat_ms) / (sum(lat_ms) / 1000):.0f} req/s"
    )
    print(
        f"AUC {report.auc:.4f}"
        + (f" (Bayes-optimal {report.bayes_auc:.4f})" if report.bayes_auc else "")
        + f"; train/serve max |diff| {report.golden_max_diff:.1e}"
    )


if __name__ == "__main__":
    main()
