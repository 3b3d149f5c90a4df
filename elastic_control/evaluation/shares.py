"""One share of an evaluation: score share i of W of a data window and write a partial.

A share is what one worker does, locally or as task i of a Volcano job. It
splits every hour the way training splits it between trainers
(``HourlyData.iter_batches(trainer_id=i, trainers=W)``), so the split is a
pure function of the window's files and W. Its partial is a folder written
atomically and idempotently (re-running share i replaces it with the same
content), so a lost worker's share is redone alone::

    PARTIALS/share-0003-of-0008/
      share.json            spec + fingerprint, counts, bad lines, buckets (written last: the completion mark)
      model.npz             ScoreCounts of the candidate (metrics.py)
      baseline.npz          ScoreCounts of the baseline, when there is one
      scored-b0000.parquet  label, score[, baseline_score][, group] rows, bucketed by hash(group)
                            (only when a group slot or scored output is asked for)
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ctr_foundation.atomic import atomic_write_json, staged_directory
from ctr_foundation.errors import DataError, UsageError
from ctr_foundation.pass_format import load_pass
from elastic_control.config.data_config import load_data_config, parse_slot
from elastic_control.data.readers import BadLineCounter, HourlyData
from elastic_control.evaluation.grouped import group_bucket
from elastic_control.evaluation.pass_scorer import ChunkedScoring, PassScorer, group_keys
from elastic_control.metrics import CountsBuilder

SHARE_JSON = "share.json"
BYTES_PER_BUCKET = 2 << 30  # text bytes per group bucket: bounds the merge step's memory
CHUNK_LINES = 8192


@dataclass(frozen=True)
class EvalSpec:
    """Everything that determines an evaluation's result; every share of it must agree."""

    model: str
    data_config: str
    start: str  # YYYYMMDD/HH
    end: str
    shares: int
    baseline: str | None = None
    group_slot: int | None = None
    ndcg_k: int = 10
    keep_scored: bool = False  # write scored rows (for --output's Parquet)

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    @property
    def needs_rows(self) -> bool:
        return self.keep_scored or self.group_slot is not None

    @classmethod
    def create(
        cls,
        *,
        model,
        data_config,
        shares,
        baseline=None,
        start=None,
        end=None,
        group_slot=None,
        ndcg_k=10,
        keep_scored=False,
    ) -> EvalSpec:
        """Validate paths and the window; the window defaults to data.config's START..END."""
        load_pass(model)  # fails clearly if it is not a pass folder
        if baseline:
            load_pass(baseline)
        config = load_data_config(data_config)
        s = parse_slot(start, key="--start") if start else config.start
        e = window_end(end, config) if end else config.end
        if e < s:
            raise UsageError(f"--end {config.format_slot(e)} is before --start {config.format_slot(s)}")
        if shares < 1:
            raise UsageError(f"the number of shares must be at least 1, got {shares}")
        if ndcg_k < 1:
            raise UsageError(f"--ndcg-k must be at least 1, got {ndcg_k}")
        return cls(
            str(Path(model).resolve()),
            str(Path(data_config).resolve()),
            config.format_slot(s),
            config.format_slot(e),
            shares,
            str(Path(baseline).resolve()) if baseline else None,
            group_slot,
            ndcg_k,
            keep_scored,
        )

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "fingerprint": self.fingerprint()}

    @classmethod
    def from_json(cls, d: dict) -> EvalSpec:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in fields})


def window_end(text: str, config) -> dt.datetime:
    """The last slot of an evaluation window: ``YYYYMMDD/HH`` names a whole hour (its last PASS_MINUTES
    slot when the data has sub-hour folders), ``YYYYMMDD/HHMM`` one slot."""
    end = parse_slot(text, key="--end")
    if config.pass_minutes and len(text) == len("YYYYMMDD/HH"):
        end += dt.timedelta(hours=1) - config.step
    return end


def share_dir(partials: str | os.PathLike, index: int, shares: int) -> Path:
    return Path(partials) / f"share-{index:04d}-of-{shares:04d}"


def parse_shard(text: str) -> tuple[int, int]:
    """'i/W' -> (i, W) with 0 <= i < W."""
    try:
        i, w = (int(x) for x in text.split("/"))
        if not 0 <= i < w:
            raise ValueError
    except ValueError:
        raise UsageError(f"--shard {text!r} must be I/W with 0 <= I < W (e.g. 0/4)") from None
    return i, w


def _window_data(spec: EvalSpec):
    config = load_data_config(spec.data_config)
    config = config.with_window(parse_slot(spec.start), parse_slot(spec.end))
    if config.online:
        config = dataclasses.replace(config, online=False)  # an evaluation window is closed
    return HourlyData(config)


def bucket_count(data, parts) -> int:
    """Group buckets for the window: enough that one bucket's rows fit comfortably in memory."""
    total = 0
    for part in parts:
        for name in part.files:
            try:
                total += int(data.root.fs.size(f"{part.location.path}/{name}"))
            except (OSError, TypeError):
                pass
    return max(1, math.ceil(total / BYTES_PER_BUCKET))


def run_share(spec: EvalSpec, index: int, partials: str | os.PathLike) -> dict:
    """Score share ``index`` of ``spec`` and write its partial folder; returns its share.json content."""
    import pyarrow as pa  # noqa: F401  (before paddle, which PassScorer imports)
    import pyarrow.parquet as pq

    if not 0 <= index < spec.shares:
        raise UsageError(f"share {index} does not exist: the evaluation has {spec.shares} shares")
    started, cpu_started = time.time(), time.process_time()
    data = _window_data(spec)
    parts = list(data.partitions())
    if not parts:
        raise DataError(f"no complete hour in {spec.start}..{spec.end} under {data.config.dataset_root}")
    buckets = bucket_count(data, parts) if spec.needs_rows else 0
    model = PassScorer(spec.model)
    baseline = PassScorer(spec.baseline) if spec.baseline else None
    counts = {"model": CountsBuilder()}
    if baseline:
        counts["baseline"] = CountsBuilder()
    counter = BadLineCounter(data.config.max_bad_line_fraction)
    grouped_examples = 0
    final = share_dir(partials, index, spec.shares)
    with staged_directory(final) as tmp:
        writers: dict[int, pq.ParquetWriter] = {}
        schema = _row_schema(spec)
        try:
            scoring = ChunkedScoring([model] + ([baseline] if baseline else []))

            def take(done) -> None:
                nonlocal grouped_examples
                for (labels, groups, has), scored in done:
                    counts["model"].add(labels, scored[0])
                    base_scores = None
                    if baseline:
                        base_scores = scored[1]
                        counts["baseline"].add(labels, base_scores)
                    if spec.needs_rows:
                        grouped_examples += int(has.sum())
                        _write_rows(writers, tmp, schema, buckets, labels, scored[0], base_scores, groups, has, spec)

            for part in parts:
                for batch in data.iter_batches(
                    part, trainer_id=index, trainers=spec.shares, counter=counter, chunk_lines=CHUNK_LINES
                ):
                    # What the rows need of the batch is kept; the batch itself is not, while its scores wait
                    # for the chunk they run in.
                    groups, has = group_keys(batch, spec.group_slot) if spec.needs_rows else (None, None)
                    take(scoring.add(batch, (batch.clicks.astype(np.int8), groups, has)))
            take(scoring.finish())
        finally:
            for w in writers.values():
                w.close()
        for name, builder in counts.items():
            with open(tmp / f"{name}.npz", "wb") as f:
                np.savez(f, **builder.result().to_arrays())
        info = {
            "spec": spec.to_json(),
            "index": index,
            "shares": spec.shares,
            "buckets": buckets,
            "model_pass": model.name,
            "baseline_pass": baseline.name if baseline else None,
            "examples": counts["model"].result().n,
            "grouped_examples": grouped_examples,
            "lines": counter.total,
            "bad_lines": counter.bad,
            "bad_examples": counter.examples,
            "hours": [p.name for p in parts],
            "seconds": round(time.time() - started, 3),
            # This process's CPU time for the share: on a busy machine, what the share cost beside how long it took.
            "cpu_seconds": round(time.process_time() - cpu_started, 3),
            "finished_at": time.time(),
        }
        atomic_write_json(tmp / SHARE_JSON, info)
    return info


def _row_schema(spec: EvalSpec):
    import pyarrow as pa

    fields = [pa.field("label", pa.int8()), pa.field("score", pa.float32())]
    if spec.baseline:
        fields.append(pa.field("baseline_score", pa.float32()))
    if spec.group_slot is not None:
        fields.append(pa.field("group", pa.uint64()))
    return pa.schema(fields)


def _write_rows(writers, folder: Path, schema, buckets: int, labels, scores, base_scores, groups, has, spec) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    b = group_bucket(groups, buckets) if spec.group_slot is not None else np.zeros(len(labels), np.int64)
    for bucket in np.unique(b):
        m = b == bucket
        cols = [pa.array(labels[m]), pa.array(scores[m])]
        if spec.baseline:
            cols.append(pa.array(base_scores[m]))
        if spec.group_slot is not None:
            cols.append(pa.array(groups[m], mask=~has[m]))
        table = pa.Table.from_arrays(cols, schema=schema)
        w = writers.get(int(bucket))
        if w is None:
            w = writers[int(bucket)] = pq.ParquetWriter(folder / f"scored-b{int(bucket):04d}.parquet", schema)
        w.write_table(table)


def read_share(partials: str | os.PathLike, index: int, shares: int) -> dict | None:
    """A share's share.json, or None when the share has not completed."""
    path = share_dir(partials, index, shares) / SHARE_JSON
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None
