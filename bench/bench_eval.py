"""Evaluation throughput: metric computation and pass scoring, single process vs parallel, beside scikit-learn.

    .venv/bin/python bench/bench_eval.py            # metrics over 10M scored examples, scoring 1M lines
    .venv/bin/python bench/bench_eval.py --quick    # metrics over 1M, scoring 100k lines

Metrics part: N scored examples (float32 scores from a beta distribution,
clicks drawn from them, about 20 examples per group) stored once as .npy.
Ours computes AUC, log loss, calibration and the reliability table (exact
score-count tables) plus grouped AUC and NDCG@10 (group buckets), in one
process, then in W processes over W slices with the exact merge (the pool is
started before timing; the slices are memory-mapped, as workers would stream
their own files). scikit-learn computes the same numbers in the same run:
``roc_auc_score`` and ``log_loss`` over all N; grouped AUC / NDCG@10 as a
per-group loop of ``roc_auc_score``/``ndcg_score`` (scikit-learn has no grouped
form), timed on the first groups and extrapolated per example (said so in the
output). The results are checked equal.

Scoring part: a real pass (short parameter-server run, MLP 400-400-400,
embedding 9, 4 slots) scores M slot-format lines in the hourly layout with
``evaluate`` (load the pass, read, parse, look up, pool, dense model,
metrics, merge), one worker vs all cores; the peer is the shared per-line
path (scoring.batch_from_lines + score_batch, as serving's reference) on
the same lines (up to 100,000 of them, extrapolated), its pass loaded
before timing. The first evaluation of each configuration is shown apart:
it also pays paddle's import (1 worker, in this process) or the worker
processes' start (they then stay up for the next evaluation, as in a
search); the ratios are the medians of three further rounds in turn.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pyarrow  # noqa: F401  (before paddle)

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from elastic_control.evaluation.grouped import GroupTotals, group_bucket, group_totals  # noqa: E402
from elastic_control.metrics import CountsBuilder, merge_counts, summarize  # noqa: E402

K = 10
CHUNK = 1_000_000


def make_examples(n: int, folder: Path, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    scores = rng.beta(1.2, 4, n).astype(np.float32)
    labels = (rng.random(n) < scores).astype(np.int8)
    groups = rng.integers(0, max(1, n // 20), n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15 >> 8)
    paths = {}
    for name, arr in (("scores", scores), ("labels", labels), ("groups", groups)):
        paths[name] = str(folder / f"{name}.npy")
        np.save(paths[name], arr)
    return paths


def _load(paths, lo=0, hi=None):
    return tuple(np.load(paths[k], mmap_mode="r")[lo:hi] for k in ("labels", "scores", "groups"))


def ours_slice(args):
    """One worker: the score-count table of its slice, and its rows bucketed by group on disk (a partial)."""
    paths, lo, hi, buckets, out = args
    y, s, g = (np.asarray(a) for a in _load(paths, lo, hi))
    table = _counts(y, s)
    bucket = group_bucket(g, buckets)
    files = []
    for j in range(buckets):
        m = bucket == j
        f = f"{out}-b{j}.npz"
        np.savez(f, g=g[m], y=y[m], s=s[m])
        files.append(f)
    return table, files


def bucket_totals(files):
    """One complete bucket of groups (the same bucket from every worker's partial)."""
    parts = [np.load(f) for f in files]
    g, y, s = (np.concatenate([p[c] for p in parts]) for c in ("g", "y", "s"))
    return group_totals(g, y, s, K)


def _counts(y, s):
    """The score-count table of labels ``y`` and scores ``s``, in chunks (every metric of ours starts from it)."""
    b = CountsBuilder()
    for i in range(0, len(y), CHUNK):
        b.add(y[i : i + CHUNK], s[i : i + CHUNK])
    return b.result()


def ours_single(paths, n):
    """All our metrics in this process; ``t_flat`` times AUC + log loss + calibration (and the reliability
    table) on the examples already in memory, as ``sklearn_metrics`` times scikit-learn's."""
    y, s, g = (np.asarray(a) for a in _load(paths, 0, n))
    t0 = time.perf_counter()
    m = summarize(_counts(y, s))
    m["t_flat"] = time.perf_counter() - t0
    m.update(group_totals(g, y, s, K).summary(K))
    return m


def ours_parallel(pool, paths, n, workers, tmp):
    bounds = np.linspace(0, n, workers + 1).astype(int)
    results = pool.map(
        ours_slice, [(paths, bounds[i], bounds[i + 1], workers, f"{tmp}/part{i}") for i in range(workers)]
    )
    m = summarize(merge_counts([r[0] for r in results]))
    totals = pool.map(bucket_totals, [[r[1][j] for r in results] for j in range(workers)])
    t = GroupTotals()
    for x in totals:
        t = t.add(x)
    m.update(t.summary(K))
    return m


def sklearn_metrics(paths, n, group_budget_s: float):
    from sklearn.metrics import log_loss, ndcg_score, roc_auc_score

    y, s, g = (np.asarray(a) for a in _load(paths))
    t0 = time.perf_counter()
    auc = roc_auc_score(y, s)
    ll = log_loss(y, s)
    cal = float(s.astype(np.float64).mean() / y.mean())
    t_flat = time.perf_counter() - t0
    # Grouped: per-group loop on the first groups until the budget is spent.
    t0 = time.perf_counter()
    order = np.argsort(g, kind="stable")
    gs, ys, ss = g[order], y[order], s[order]
    starts = np.flatnonzero(np.concatenate([[True], gs[1:] != gs[:-1]]))
    ends = np.append(starts[1:], len(gs))
    t_sort = time.perf_counter() - t0
    done_examples, weighted, weight, ndcgs = 0, 0.0, 0, []
    t0 = time.perf_counter()
    for a, b in zip(starts, ends, strict=True):
        yy, sc = ys[a:b], ss[a:b]
        if 0 < yy.sum() < len(yy):
            weighted += len(yy) * roc_auc_score(yy, sc)
            weight += len(yy)
        if yy.sum() > 0:
            ndcgs.append(ndcg_score([yy], [sc], k=K) if len(yy) > 1 else 1.0)
        done_examples += b - a
        if time.perf_counter() - t0 > group_budget_s:
            break
    t_loop = time.perf_counter() - t0
    t_group = t_sort + t_loop * (n / done_examples)
    return {
        "auc": auc,
        "logloss": ll,
        "calibration": cal,
        "t_flat": t_flat,
        "t_group_extrapolated": t_group,
        "group_fraction_measured": done_examples / n,
        "gauc_prefix": weighted / weight if weight else None,
        "prefix_groups": (starts, ends, done_examples),
    }


FLAT_ROUNDS = 3
SCORING_ROUNDS = 3


def flat_in_turns(paths) -> dict[str, tuple[float, float]]:
    """AUC + log loss + calibration, ours (with the reliability table) and scikit-learn's, taking turns:
    (median seconds, median CPU seconds) of each. On a shared machine a load that comes and goes moves
    figures measured minutes apart; turns and CPU time keep the comparison to the work itself."""
    from sklearn.metrics import log_loss, roc_auc_score

    y, s, _ = (np.asarray(a) for a in _load(paths))

    def ours():
        return summarize(_counts(y, s))

    def sklearn():
        return roc_auc_score(y, s), log_loss(y, s), float(s.astype(np.float64).mean() / y.mean())

    runs: dict[str, list[tuple[float, float]]] = {"ours": [], "sklearn": []}
    for _ in range(FLAT_ROUNDS):
        for name, fn in (("ours", ours), ("sklearn", sklearn)):
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            runs[name].append((time.perf_counter() - t0, time.process_time() - c0))
    return {k: (float(np.median([r[0] for r in v])), float(np.median([r[1] for r in v]))) for k, v in runs.items()}


def check_prefix_equal(paths, sk: dict) -> bool:
    """Our grouped AUC on exactly the groups scikit-learn measured equals its value."""
    y, s, g = (np.asarray(a) for a in _load(paths))
    order = np.argsort(g, kind="stable")
    starts, ends, done = sk["prefix_groups"]
    upto = order[:done]
    t = group_totals(g[upto], y[upto], s[upto], K)
    return t.summary(K)["gauc"] is None or abs(t.summary(K)["gauc"] - sk["gauc_prefix"]) < 1e-9


def bench_metrics(n: int, workers: int) -> None:
    print(f"== metric computation over {n:,} scored examples ({workers} workers for parallel)")
    with tempfile.TemporaryDirectory(prefix="bench-eval-") as tmp:
        paths = make_examples(n, Path(tmp))
        ctx = mp.get_context("fork")
        with ctx.Pool(workers) as pool:
            pool.map(abs, range(workers))  # workers started before timing
            t0 = time.perf_counter()
            single = ours_single(paths, n)
            t_single = time.perf_counter() - t0
            t0 = time.perf_counter()
            par = ours_parallel(pool, paths, n, workers, tmp)
            t_par = time.perf_counter() - t0
        sk = sklearn_metrics(paths, n, group_budget_s=20 if n >= 5_000_000 else 8)
        same = (
            single["auc"] == par["auc"]
            and single["logloss"] == par["logloss"]
            and abs(single["gauc"] - par["gauc"]) < 1e-12
        )
        assert abs(single["auc"] - sk["auc"]) < 1e-9, (single["auc"], sk["auc"])
        assert abs(single["logloss"] - sk["logloss"]) / sk["logloss"] < 1e-6
        prefix_ok = check_prefix_equal(paths, sk)
        flat = flat_in_turns(paths)
        t_sk_total = sk["t_flat"] + sk["t_group_extrapolated"]
        print(
            f"AUC {single['auc']:.6f} (sklearn {sk['auc']:.6f}), logloss {single['logloss']:.6f} "
            f"(sklearn {sk['logloss']:.6f}), GAUC {single['gauc']:.6f}, NDCG@{K} {single[f'ndcg@{K}']:.6f}"
        )
        print(f"parallel == single: {same}; grouped AUC equals sklearn's on the measured groups: {prefix_ok}")
        print(f"{'':38s}{'seconds':>10s}{'examples/s':>14s}")
        rows = [
            ("ours, 1 process (all metrics)", t_single),
            (f"ours, {workers} processes (all metrics)", t_par),
            ("sklearn auc+logloss+calibration", sk["t_flat"]),
            (f"sklearn grouped (extrapolated from {sk['group_fraction_measured']:.1%})", sk["t_group_extrapolated"]),
            ("sklearn all metrics (sum)", t_sk_total),
        ]
        for name, t in rows:
            print(f"{name:38s}{t:10.2f}{n / t:14,.0f}")
        print(f"ratio ours 1 process vs sklearn (all metrics): {t_sk_total / t_single:.1f}x")
        print(f"ratio ours {workers} processes vs sklearn (all metrics): {t_sk_total / t_par:.1f}x")
        print(
            f"ratio ours 1 process vs sklearn on AUC + logloss + calibration (ours with the reliability table, "
            f"the examples in memory), in turns, medians of {FLAT_ROUNDS}: ours {flat['ours'][0]:.2f}s "
            f"({flat['ours'][1]:.2f}s CPU), sklearn {flat['sklearn'][0]:.2f}s ({flat['sklearn'][1]:.2f}s CPU): "
            f"{flat['sklearn'][0] / flat['ours'][0]:.2f}x ({flat['sklearn'][1] / flat['ours'][1]:.2f}x in CPU time); "
            f"the first run of each: ours {single['t_flat']:.2f}s, sklearn {sk['t_flat']:.2f}s, "
            f"{sk['t_flat'] / single['t_flat']:.2f}x"
        )
        print(f"parallel speed-up: {t_single / t_par:.2f}x")


def bench_scoring(lines: int, workers: int) -> None:
    from bench_support import START, train, write_job

    from elastic_control.data.hourly_writer import hour_dir
    from elastic_control.data.synth import generate, read_truth
    from elastic_control.evaluation.parallel import evaluate
    from elastic_control.evaluation.shares import EvalSpec

    print(f"\n== scoring {lines:,} slot-format lines with a real pass (MLP 400-400-400), 1 vs {workers} workers")
    with tempfile.TemporaryDirectory(prefix="bench-eval-score-") as tmp:
        tmp = Path(tmp)
        slots = (1, 2, 3, 4)
        generate(tmp / "synth", slots=slots, hours=2, lines_per_hour=max(4000, min(lines, 50_000)), seed=1, start=START)
        t0 = time.perf_counter()
        pass_dir = train(*write_job(tmp / "job", data=tmp / "synth", slots=slots, start=START, hours=1))[-1]
        print(f"(pass trained by elastic-control train in {time.perf_counter() - t0:.0f}s)")
        block, _truth = read_truth(hour_dir(tmp / "synth", START + dt.timedelta(hours=1)))
        files, per_file = 4, lines // 4
        d = hour_dir(tmp / "data", START + dt.timedelta(hours=1))
        d.mkdir(parents=True)
        for i in range(files):
            with open(d / f"part-{i:05d}", "w") as f:
                written = 0
                while written < per_file:
                    take = block[: per_file - written]
                    f.write("\n".join(take) + "\n")
                    written += len(take)
        (d / "donefile").write_text("")
        hour = f"{START + dt.timedelta(hours=1):%Y%m%d/%H}"
        cfg = tmp / "data.config"
        cfg.write_text(
            f'export START_DATE_HR="{hour}"\nexport END_DATE_HR="{hour}"\nexport DATASET_PATH="{tmp / "data"}"\n'
        )
        from elastic_control.evaluation.pass_scorer import PassScorer
        from elastic_control.inference.scoring import score_lines

        cpu: dict = {}

        def run(w: int) -> tuple[float, dict]:
            spec = EvalSpec.create(model=pass_dir, data_config=cfg, shares=w)
            partials = Path(tempfile.mkdtemp(dir=tmp))
            t0 = time.perf_counter()
            r = evaluate(spec, workers=w, partials=partials)
            took = time.perf_counter() - t0
            # The shares' CPU seconds (each worker's own): how the work split, whatever the machine's load.
            cpu.setdefault(w, []).append(
                [json.loads(p.read_text())["cpu_seconds"] for p in sorted(partials.glob("share-*/share.json"))]
            )
            shutil.rmtree(partials)
            return took, r.metrics["model"]

        def peer() -> float:
            # The shared per-line path on the same lines, its pass loaded before the clock starts.
            scorer = PassScorer(pass_dir)
            t0, c0 = time.perf_counter(), time.process_time()
            for i in range(0, peer_n, 2048):
                score_lines(block[i : i + 2048], scorer.info, scorer.table.lookup, scorer.model)
            peer_cpu.append((time.process_time() - c0) * lines / peer_n)
            return (time.perf_counter() - t0) * lines / peer_n

        peer_cpu: list[float] = []

        peer_n = min(100_000, lines, len(block))
        # First runs: what the first evaluation in a process pays on top (paddle's import here, the worker
        # processes' start and imports); then the configurations take turns, SCORING_ROUNDS times, each figure
        # the median of its runs: what each further evaluation costs (a search's candidates), beside the
        # per-line path.
        first = {w: run(w) for w in (1, workers)}
        runs: dict = {1: [], workers: [], "peer": []}
        for _ in range(SCORING_ROUNDS):
            for w in (1, workers):
                runs[w].append(run(w))
            runs["peer"].append(peer())
        for w in (1, workers):
            assert all(m == first[1][1] for _, m in runs[w] + [first[w]]), "every run and split must agree"
        t1 = float(np.median([t for t, _ in runs[1]]))
        tw = float(np.median([t for t, _ in runs[workers]]))
        t_peer = float(np.median(runs["peer"]))
        n = first[1][1]["examples"]
        print(f"{'':48s}{'seconds':>10s}{'predictions/s':>16s}")
        rows = [
            ("evaluate, 1 worker (read+parse+score+metrics)", t1),
            (f"evaluate, {workers} workers", tw),
            (f"per-line scoring.score_lines ({peer_n:,} lines)", t_peer),
            ("first evaluate in the process, 1 worker", first[1][0]),
            (f"first evaluate, {workers} workers (starts them)", first[workers][0]),
        ]
        for name, t in rows:
            print(f"{name:48s}{t:10.2f}{n / t:16,.0f}")
        print(
            f"CPU seconds of the shares (last run): 1 worker {' + '.join(map(str, cpu[1][-1]))}; {workers} workers "
            f"{' + '.join(map(str, cpu[workers][-1]))}; the per-line path's, on one core: {peer_cpu[-1]:.2f}"
        )
        print(
            f"ratio evaluate 1 worker vs per-line path: {t_peer / t1:.2f}x; {workers} workers vs 1: {t1 / tw:.2f}x "
            f"(first runs: 1 worker {t_peer / first[1][0]:.2f}x of the per-line path, paying paddle's import; "
            f"{workers} workers {first[1][0] / first[workers][0]:.2f}x of 1, paying the workers' start)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1M examples for metrics, 100k lines for scoring")
    ap.add_argument("--examples", type=int, help="scored examples for the metric part")
    ap.add_argument("--lines", type=int, help="lines for the scoring part")
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--skip-scoring", action="store_true")
    args = ap.parse_args()
    n = args.examples or (1_000_000 if args.quick else 10_000_000)
    lines = args.lines or (100_000 if args.quick else 1_000_000)
    print(
        f"cores available: {len(os.sched_getaffinity(0))}; load average {os.getloadavg()[0]:.1f} "
        f"(other work on the machine slows every figure alike)"
    )
    try:
        autogroup = Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        autogroup = False
    if autogroup:
        print(
            "the kernel shares the CPU between sessions (sched_autogroup): while other sessions are busy, this "
            "run's workers split one session's share, and N workers vs 1 measures their load, not evaluation"
        )
    bench_metrics(n, args.workers)
    if not args.skip_scoring:
        bench_scoring(lines, args.workers)


if __name__ == "__main__":
    main()
