"""Run an evaluation's shares in worker processes and merge their partials exactly.

``evaluate`` is the local coordinator: W shares over a process pool (all
cores by default), shares already complete in the partials folder (same spec
fingerprint) are reused, a share whose worker dies is run again (alone), then
``merge_partials`` adds the partial tables. The Kubernetes backend runs the
same ``run_share`` as task i of a Volcano job and the same ``merge_partials``
afterwards (see docs/contracts.md, "Evaluation").
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ctr_foundation.errors import DataError, ElasticControlError
from elastic_control.evaluation.grouped import GroupTotals, group_totals
from elastic_control.evaluation.shares import EvalSpec, read_share, run_share, share_dir
from elastic_control.metrics import ScoreCounts, merge_counts, summarize

RETRIES_PER_SHARE = 2


@dataclass
class EvalResult:
    spec: EvalSpec
    metrics: dict  # {"model": {...}, "baseline": {...}?, "comparison": {...}?, "data": {...}}
    counts: dict[str, ScoreCounts]  # merged tables (for the ROC curve)
    partials: Path
    scored_files: list[Path] = field(default_factory=list)
    temporary: bool = False  # partials live in a temp folder: cleanup() removes it

    def cleanup(self) -> None:
        if self.temporary:
            shutil.rmtree(self.partials, ignore_errors=True)


def _share_worker(spec_json: dict, index: int, partials: str) -> dict:
    return run_share(EvalSpec.from_json(spec_json), index, partials)


def _start_worker() -> None:
    """A worker's imports, done as it starts: pyarrow before paddle (paddle's import is most of a worker's
    start, about two seconds), so that a share's time is the share's."""
    import pyarrow  # noqa: F401
    import pyarrow.parquet  # noqa: F401

    from paddle import inference  # noqa: F401


# The worker processes stay up from one evaluation to the next (a search scores candidate after candidate):
# a fresh pool pays each worker's start (a spawned Python, then pyarrow and paddle's imports) again for
# every evaluation, more than scoring 100,000 lines costs. Passes are loaded per share, never kept.
_pool: tuple[cf.ProcessPoolExecutor, int] | None = None
_pool_lock = threading.Lock()


def _worker_pool(workers: int) -> cf.ProcessPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is not None and (_pool[1] != workers or getattr(_pool[0], "_broken", False)):
            _pool[0].shutdown(wait=False, cancel_futures=True)
            _pool = None
        if _pool is None:
            ctx = multiprocessing.get_context("spawn")  # paddle is not fork-safe
            _pool = (cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_start_worker), workers)
        return _pool[0]


def shutdown_workers() -> None:
    """Stop the worker processes kept between evaluations (they also stop when this process exits)."""
    global _pool
    with _pool_lock:
        if _pool is not None:
            _pool[0].shutdown(wait=True, cancel_futures=True)
            _pool = None


def _discard_pool(pool: cf.ProcessPoolExecutor) -> None:
    """Drop a pool one of whose workers died, so that the retries start fresh workers."""
    global _pool
    with _pool_lock:
        if _pool is not None and _pool[0] is pool:
            _pool = None
    pool.shutdown(wait=False, cancel_futures=True)


def default_workers() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


def run_missing_shares(
    spec: EvalSpec, partials: Path, workers: int, progress: Callable[[str], None] | None = None
) -> list[int]:
    """Run every share without a complete partial of this spec; returns the indexes run."""
    todo = [i for i in range(spec.shares) if not _complete(spec, partials, i)]
    if not todo:
        return []
    if workers <= 1 or len(todo) == 1:
        for i in todo:
            _with_retries(lambda i=i: run_share(spec, i, partials), i, progress)
        return todo
    attempts = {i: 0 for i in todo}
    pending = list(todo)
    while pending:
        failed: list[tuple[int, BaseException]] = []
        pool = _worker_pool(workers)
        futures = {pool.submit(_share_worker, spec.to_json(), i, str(partials)): i for i in pending}
        try:
            for fut in cf.as_completed(futures):
                i = futures[fut]
                try:
                    info = fut.result()
                    if progress:
                        progress(f"share {i + 1}/{spec.shares}: {info['examples']} examples in {info['seconds']}s")
                except ElasticControlError:
                    raise  # bad input: running it again gives the same answer
                except BaseException as e:  # noqa: BLE001 - a crashed or killed worker: redo only its share
                    failed.append((i, e))
        except BaseException:
            for fut in futures:
                fut.cancel()
            raise
        if any(isinstance(e, BrokenProcessPool) for _, e in failed):
            _discard_pool(pool)
        pending = []
        for i, e in failed:
            attempts[i] += 1
            if attempts[i] > RETRIES_PER_SHARE:
                raise DataError(f"evaluation share {i}/{spec.shares} failed {attempts[i]} times: {e}") from e
            if progress:
                progress(f"share {i + 1}/{spec.shares} lost ({type(e).__name__}: {e}); running it again")
            pending.append(i)
    return todo


def _with_retries(fn, index: int, progress) -> None:
    for attempt in range(RETRIES_PER_SHARE + 1):
        try:
            info = fn()
            if progress:
                progress(f"share {index + 1}: {info['examples']} examples in {info['seconds']}s")
            return
        except ElasticControlError:
            raise
        except Exception as e:  # noqa: BLE001 - same policy as a lost worker process
            if attempt == RETRIES_PER_SHARE:
                raise DataError(f"evaluation share {index} failed {attempt + 1} times: {e}") from e


def _complete(spec: EvalSpec, partials: Path, index: int) -> bool:
    info = read_share(partials, index, spec.shares)
    return bool(info) and info["spec"]["fingerprint"] == spec.fingerprint()


def merge_partials(partials: str | os.PathLike, spec: EvalSpec | None = None) -> EvalResult:
    """Merge the W share partials in ``partials``; DataError naming the missing shares."""
    partials = Path(partials)
    if spec is None:
        spec = _spec_from_folder(partials)
    infos = [read_share(partials, i, spec.shares) for i in range(spec.shares)]
    missing = [i for i, info in enumerate(infos) if info is None]
    if missing:
        raise DataError(
            f"{partials}: shares {', '.join(f'{i}/{spec.shares}' for i in missing)} have no complete "
            f"partial; run them (elastic-control eval ... --shard I/W --partial-out {partials}) and merge again"
        )
    stale = [i for i, info in enumerate(infos) if info["spec"]["fingerprint"] != spec.fingerprint()]
    if stale:
        raise DataError(
            f"{partials}: shares {stale} belong to a different evaluation (model, window or options differ)"
        )
    buckets = {info["buckets"] for info in infos}
    if len(buckets) != 1:
        raise DataError(f"{partials}: shares disagree on the group buckets {sorted(buckets)} (did the data change?)")
    names = ["model"] + (["baseline"] if spec.baseline else [])
    counts = {}
    for name in names:
        merged = None
        for i in range(spec.shares):  # folded one share at a time: at most two tables in memory
            with np.load(share_dir(partials, i, spec.shares) / f"{name}.npz") as a:
                table = ScoreCounts.from_arrays(a)
            merged = table if merged is None else merge_counts([merged, table])
        counts[name] = merged
    metrics = {name: summarize(counts[name]) for name in names}
    metrics["model"]["pass"] = infos[0]["model_pass"]
    if spec.baseline:
        metrics["baseline"]["pass"] = infos[0]["baseline_pass"]
    scored = sorted(partials.glob("share-*-of-*/scored-b*.parquet"))
    if spec.group_slot is not None:
        _add_group_metrics(spec, partials, buckets.pop(), metrics)
    if spec.baseline:
        metrics["comparison"] = compare(metrics["model"], metrics["baseline"])
    metrics["data"] = {
        "window": {"start": spec.start, "end": spec.end},
        "shares": spec.shares,
        "hours": infos[0]["hours"],
        "lines": sum(i["lines"] for i in infos),
        "bad_lines": sum(i["bad_lines"] for i in infos),
        "grouped_examples": sum(i["grouped_examples"] for i in infos),
        "share_examples": [i["examples"] for i in infos],
    }
    return EvalResult(spec, metrics, counts, partials, scored)


def _spec_from_folder(partials: Path) -> EvalSpec:
    found = sorted(partials.glob("share-*-of-*/share.json"))
    if not found:
        raise DataError(f"{partials}: no share partials found (nothing has run there yet)")
    info = read_share(partials, *(int(x) for x in found[0].parent.name[len("share-") :].split("-of-")))
    return EvalSpec.from_json(info["spec"])


def _add_group_metrics(spec: EvalSpec, partials: Path, buckets: int, metrics: dict) -> None:
    """Grouped AUC and NDCG@k, one bucket (the same bucket of every share) in memory at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    names = ["model"] + (["baseline"] if spec.baseline else [])
    columns = {"model": "score", "baseline": "baseline_score"}
    totals = {n: GroupTotals() for n in names}
    for b in range(buckets):
        files = sorted(partials.glob(f"share-*-of-*/scored-b{b:04d}.parquet"))
        if not files:
            continue
        t = pa.concat_tables([pq.read_table(f) for f in files])
        t = t.filter(t.column("group").is_valid())
        g = t.column("group").to_numpy()
        y = t.column("label").to_numpy()
        for n in names:
            totals[n] = totals[n].add(group_totals(g, y, t.column(columns[n]).to_numpy(), spec.ndcg_k))
    for n in names:
        metrics[n].update(totals[n].summary(spec.ndcg_k))
        metrics[n]["group_slot"] = spec.group_slot


def compare(model: dict, baseline: dict) -> dict:
    """Candidate minus baseline for the headline metrics (positive auc_delta = candidate better)."""
    out = {}
    for key in ("auc", "logloss", "calibration", "gauc") + tuple(k for k in model if k.startswith("ndcg@")):
        a, b = model.get(key), baseline.get(key)
        out[f"{key}_delta"] = (a - b) if a is not None and b is not None else None
    return out


def evaluate(
    spec: EvalSpec,
    *,
    workers: int | None = None,
    partials: str | os.PathLike | None = None,
    progress: Callable[[str], None] | None = None,
) -> EvalResult:
    """Run (or finish) all shares of ``spec`` and merge them.

    With ``partials`` the share folders persist there (a rerun reuses the
    complete ones); without, they live in a temporary folder removed at the end
    unless scored rows are kept (the caller copies them out first).
    """
    workers = workers or default_workers()
    own_tmp = partials is None
    folder = Path(partials) if partials else Path(tempfile.mkdtemp(prefix="elastic-ctr-eval-"))
    try:
        run_missing_shares(spec, folder, workers, progress)
        result = merge_partials(folder, spec)
    except BaseException:
        if own_tmp:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    result.temporary = own_tmp
    if own_tmp and not spec.keep_scored:
        result.cleanup()
    return result
