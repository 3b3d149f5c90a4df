"""Scoring a pass outside the trainer: features -> one KeyBatch -> pooled embeddings -> dense model.

Serving (embeddings from cube) and offline evaluation (embeddings from the
pass's sparse table in memory) both go through here, so that they compute
exactly what the training program computed (golden.jsonl, within 1e-5).
A pass with dense slots appends their standardised values to the pooled rows
(``model_input``; ctr_foundation/dense_features.py).

``key_batch`` is the one KeyBatch builder: serving's request instances, the
evaluation reader's column batches and plain slot-format lines all arrive as
feature columns (line index, feasign, slot) and leave as keys sorted by
(row, slot position) with the training program's rules applied: features of
slots outside slot.conf are ignored, a slot with no feature gets the padding
feasign, and the key transform is ``feasign % sparse_dim`` when the version
has one. The dense program's input is the per-slot pooled rows concatenated
in slot.conf order, whatever the row width.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ctr_foundation.dense_features import DenseNorm, dense_matrix
from ctr_foundation.env_vars import MKL_DEBUG_CPU_TYPE
from ctr_foundation.pass_format import DENSE_DIR, DENSE_PREFIX, PassInfo
from ctr_foundation.sample import PADDING_FEASIGN, MalformedLine, transform_keys
from elastic_control.data.line_batch import parse_lines
from elastic_control.inference.key_kernel import one_key_cells


@dataclass(frozen=True)
class KeyBatch:
    """The keys of n instances, flattened and sorted by cell: key j is in cell ``cells[j]`` = row * num_slots +
    slot position (``rows[j]``, ``slot_pos[j]``).

    Keys of one (row, slot) cell are adjacent, cells in row-major order, so pooling is a segment sum
    (or, when every cell has exactly one key, a reshape).
    """

    keys: np.ndarray  # uint64 [m]
    cells: np.ndarray  # int64 [m], non-decreasing
    n: int
    num_slots: int
    # first key of each cell (n * num_slots starts), or None when every cell has exactly one key
    cell_starts: np.ndarray | None = field(default=None, compare=False)
    # the dense slots' raw values, float64 [n, dense slots], NaN where missing (None: no dense slots)
    dense: np.ndarray | None = field(default=None, compare=False)

    @functools.cached_property
    def rows(self) -> np.ndarray:
        return self.cells // max(self.num_slots, 1)

    @functools.cached_property
    def slot_pos(self) -> np.ndarray:
        return self.cells % max(self.num_slots, 1)


def key_batch(
    feature_row: np.ndarray,
    feasigns: np.ndarray,
    feature_slots: np.ndarray,
    n: int,
    slots: Sequence[int],
    sparse_dim: int | None,
    *,
    dense_slots: Sequence[int] = (),
    values: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> KeyBatch:
    """THE KeyBatch builder: feature columns of ``n`` instances -> keys sorted by (row, slot position).

    ``feature_row[j]`` is the instance of feature j (0..n-1), ``feasigns[j]`` its raw uint64 feasign,
    ``feature_slots[j]`` its slot id. Features of slots outside ``slots`` are dropped; every (row, slot)
    cell left without a feature gets the padding feasign; keys are ``feasign % sparse_dim`` when set.
    With ``dense_slots``, the batch also carries each row's dense values (``dense_features.dense_matrix``
    of ``values`` = (row, slot, value) of the value tokens, and of the integer features of dense slots).
    """
    dense = None
    if len(dense_slots):
        vr, vs, vv = values if values is not None else (None, None, None)
        dense = dense_matrix(n, dense_slots, vr, vs, vv, feature_row, feasigns, feature_slots)
    slots_arr = np.asarray(list(slots), dtype=np.int64)
    num_slots = len(slots_arr)
    feature_row = np.ascontiguousarray(feature_row, dtype=np.int64)
    feature_slots = np.ascontiguousarray(feature_slots, dtype=np.int64)
    feasigns = np.ascontiguousarray(feasigns, dtype=np.uint64)
    table = _slot_table(tuple(slots_arr.tolist())) if n * num_slots else None
    if table is not None:  # one compiled pass when every cell has one key at most (key_kernel.py)
        keys, cells = np.empty(n * num_slots, np.uint64), np.empty(n * num_slots, np.int64)
        if one_key_cells(feature_row, feasigns, feature_slots, table, n, np.uint64(sparse_dim or 0), keys, cells):
            return KeyBatch(keys, cells, n, num_slots, None, dense)
    return _sorted_key_batch(feature_row, feasigns, feature_slots, n, slots_arr, sparse_dim, dense)


def _sorted_key_batch(
    feature_row: np.ndarray,
    feasigns: np.ndarray,
    feature_slots: np.ndarray,
    n: int,
    slots_arr: np.ndarray,
    sparse_dim: int | None,
    dense: np.ndarray | None,
) -> KeyBatch:
    """key_batch's numpy passes, for every batch (a cell of several keys included)."""
    num_slots = len(slots_arr)
    pos = slot_positions(feature_slots, slots_arr)
    known = pos >= 0
    if not known.all():
        feature_row, feasigns, pos = feature_row[known], feasigns[known], pos[known]
    cells = n * num_slots
    cell = feature_row * num_slots + pos
    present = np.zeros(cells, bool)
    present[cell] = True
    missing = np.flatnonzero(~present)
    if len(missing):
        cell = np.concatenate([cell, missing])
        feasigns = np.concatenate([feasigns, np.full(len(missing), PADDING_FEASIGN, np.uint64)])
    # Stable: keys of a cell keep their order of appearance. Inputs are nearly sorted already
    # (features come line by line), which timsort handles in linear time.
    if len(cell) > 1 and (np.diff(cell) < 0).any():
        order = np.argsort(cell, kind="stable")
        cell, feasigns = cell[order], feasigns[order]
    keys = transform_keys(feasigns, sparse_dim)
    starts = None
    if len(cell) != cells:  # some cell has several keys: pooling sums segments
        starts = np.flatnonzero(np.r_[True, cell[1:] != cell[:-1]]) if len(cell) else np.zeros(0, np.int64)
    return KeyBatch(keys, cell, n, num_slots, starts, dense)


@functools.lru_cache(maxsize=64)
def _slot_table(slots: tuple[int, ...]) -> np.ndarray | None:
    """slot id -> position (and -1 past the end), for slot ids small enough to index a table."""
    if not slots or min(slots) < 0 or max(slots) > 1 << 20:
        return None
    table = np.full(max(slots) + 2, -1, np.int64)
    table[list(slots)] = np.arange(len(slots))
    return table


def slot_positions(feature_slots: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """Position of each feature's slot in ``slots`` (slot.conf order), -1 for slots not in it."""
    if len(slots) == 0:
        return np.full(len(feature_slots), -1, np.int64)
    table = _slot_table(tuple(int(x) for x in slots))
    if table is not None and (not len(feature_slots) or feature_slots.min() >= 0):
        return table.take(np.minimum(feature_slots, len(table) - 1))
    order = np.argsort(slots, kind="stable")
    sorted_slots = slots[order]
    at = np.minimum(np.searchsorted(sorted_slots, feature_slots), len(sorted_slots) - 1)
    return np.where(sorted_slots[at] == feature_slots, order[at], -1)


def concat_key_batches(batches: Sequence[KeyBatch]) -> tuple[KeyBatch, list[int]]:
    """One KeyBatch for several (rows renumbered, still sorted by cell) and each part's first row."""
    offsets, n = [], 0
    for b in batches:
        offsets.append(n)
        n += b.n
    if len(batches) == 1:
        return batches[0], offsets
    num_slots = batches[0].num_slots
    if any(b.num_slots != num_slots for b in batches):
        raise ValueError("cannot merge key batches of different slot lists")
    if all(b.cell_starts is None for b in batches):
        starts = None
    else:
        parts, at = [], 0
        for b in batches:
            parts.append((b.cell_starts if b.cell_starts is not None else np.arange(b.n * num_slots)) + at)
            at += len(b.keys)
        starts = np.concatenate(parts)
    if any((b.dense is None) != (batches[0].dense is None) for b in batches):
        raise ValueError("cannot merge key batches with and without dense slots")
    merged = KeyBatch(
        np.concatenate([b.keys for b in batches]),
        np.concatenate([b.cells + off * num_slots for b, off in zip(batches, offsets, strict=True)]),
        n,
        num_slots,
        starts,
        None if batches[0].dense is None else np.concatenate([b.dense for b in batches]),
    )
    return merged, offsets


def batch_from_lines(
    lines: Iterable[str], slots: Sequence[int], sparse_dim: int | None, dense_slots: Sequence[int] = ()
) -> KeyBatch:
    """The KeyBatch of slot-format lines (the training reader's parse); raise MalformedLine naming a bad line."""
    lines = list(lines)
    batch, bad = parse_lines(lines)
    if bad:
        raise MalformedLine(f"line {bad[0].index + 1}: {bad[0].reason}")
    return line_key_batch(batch, slots, sparse_dim, dense_slots)


def line_key_batch(batch, slots: Sequence[int], sparse_dim: int | None, dense_slots: Sequence[int] = ()) -> KeyBatch:
    """The KeyBatch of a parsed ``line_batch.LineBatch``."""
    return key_batch(
        batch.feature_line,
        batch.feasigns,
        batch.feature_slots,
        len(batch),
        slots,
        sparse_dim,
        dense_slots=dense_slots,
        values=(batch.value_line, batch.value_slots, batch.values),
    )


def pool(batch: KeyBatch, vectors: np.ndarray) -> np.ndarray:
    """Sum the key vectors per (row, slot): float32 [n, num_slots * width] in slot order."""
    width = vectors.shape[1]
    vectors = vectors.astype(np.float32, copy=False)
    if batch.cell_starts is None:  # one key per cell: the rows already are the pooled rows
        return np.ascontiguousarray(vectors).reshape(batch.n, batch.num_slots * width)
    if batch.n * batch.num_slots == 0:
        return np.zeros((batch.n, batch.num_slots * width), np.float32)
    return np.add.reduceat(vectors, batch.cell_starts, axis=0).reshape(batch.n, batch.num_slots * width)


def model_input(batch: KeyBatch, vectors: np.ndarray, dense_norm: DenseNorm | None = None) -> np.ndarray:
    """The dense program's input: the pooled rows, then the standardised dense slots (when the pass has any)."""
    pooled = pool(batch, vectors)
    if dense_norm is None:
        return pooled
    if batch.dense is None:
        raise ValueError(f"the pass has dense slots {list(dense_norm.slots)} but the batch carries none")
    return np.concatenate([pooled, dense_norm.apply(batch.dense)], axis=1)


class InMemoryTable:
    """A pass's sparse table held in memory (sorted keys), for offline scoring."""

    def __init__(self, keys: np.ndarray, values: np.ndarray):
        order = np.argsort(keys, kind="stable")
        self.keys = np.ascontiguousarray(keys[order], dtype=np.uint64)
        self.values = np.ascontiguousarray(values[order], dtype=np.float32)
        self.dim = self.values.shape[1]

    @classmethod
    def from_pass(cls, info: PassInfo) -> InMemoryTable:
        """The pass's whole table: a delta pass is assembled with its chain down to its base."""
        # function-level: imports pyarrow
        from elastic_control.inference.whole_table import read_whole_table

        return cls(*read_whole_table(info))

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(values float32 [n, dim], found bool [n]); missing keys give zero vectors."""
        keys = np.asarray(keys, dtype=np.uint64)
        idx = np.searchsorted(self.keys, keys)
        idx_c = np.minimum(idx, max(len(self.keys) - 1, 0))
        found = (idx < len(self.keys)) & (self.keys[idx_c] == keys) if len(self.keys) else np.zeros(len(keys), bool)
        out = np.zeros((len(keys), self.dim), np.float32)
        out[found] = self.values[idx_c[found]]
        return out, found


def prefer_fast_mkl() -> str | None:
    """Let Paddle's MKL (2019) use its AVX2 kernels on AMD CPUs; returns the value in force.

    MKL of that age dispatches non-Intel CPUs to its generic code path: on this project's AMD EPYC
    machines Paddle's dense layers ran 10-20x slower than with ``MKL_DEBUG_CPU_TYPE=5`` (measured in
    bench/bench_serving.py's dense-only line). MKL reads the variable at its first call, so this must
    run before the first predictor is created; a value the user set is kept.

    Serving opts in (``import_paddle``). Offline evaluation does not: with the AVX2 kernels a row's
    probability depends in its last bits on how many rows share the GEMM call, and evaluation promises
    bit-identical metrics whatever the number of workers.
    """
    current = MKL_DEBUG_CPU_TYPE.get()
    if current is not None:
        return current
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            amd = any(line.startswith("vendor_id") and "AuthenticAMD" in line for line in f)
    except OSError:
        return None
    if amd:
        os.environ[MKL_DEBUG_CPU_TYPE.name] = "5"
        return "5"
    return None


def import_paddle(*, keep_signals: bool = True) -> None:
    """Import Paddle now (pyarrow first, MKL's fast kernels chosen), without its C++ signal handlers.

    Paddle installs handlers for SIGTERM, SIGINT, SIGSEGV, ... when imported; its SIGTERM handler
    prints a C++ stack and aborts, which would turn a graceful shutdown (serving's drain) into a crash.
    Call this in the main thread before installing the process's own signal handlers.
    """
    import pyarrow  # noqa: F401  (must be imported before paddle)

    prefer_fast_mkl()
    import paddle

    if keep_signals:
        paddle.disable_signal_handler()


# Rows per dense-program run in serving (DenseModel ``block_rows``). MKL's GEMM picks its kernels by the
# number of rows, and rows in a kernel's remainder are computed in another order: run alone or among
# others, one instance came out one float32 ULP apart. Every run of exactly this many rows (padded with
# zero rows) computes each row the same way wherever it sits in the block; 64 was checked row by row on
# AVX2 (smaller blocks such as 8 and 32 were not: their last rows differ), and costs little over a run
# of a few rows, which the predictor's fixed overhead dominates.
DENSE_BLOCK_ROWS = 64


class DenseModel:
    """The pass's dense inference program, run with paddle.inference (CPU).

    A predictor is not safe to share between threads (oneDNN keeps per-thread state, and cloned
    predictors used from other threads crash under load). ``predict`` serialises its
    callers; serving goes further and creates one DenseModel per batch worker, in that worker's
    thread, with ``bind_thread=True`` so that any other thread's call is refused.

    ``block_rows``: run the program on blocks of exactly that many rows (the last one padded with zero
    rows), so that a row's probability does not depend on how many rows share the run
    (``DENSE_BLOCK_ROWS``); None runs every call's rows at once.
    """

    def __init__(
        self,
        model_prefix: str | Path,
        threads: int = 1,
        *,
        onednn: bool = True,
        bind_thread: bool = False,
        block_rows: int | None = None,
    ):
        import pyarrow  # noqa: F401  (must be imported before paddle)

        from paddle import inference

        prefix = str(model_prefix)
        self.prefix = prefix
        config = inference.Config(prefix + ".pdmodel", prefix + ".pdiparams")
        config.disable_gpu()
        config.set_cpu_math_library_num_threads(threads)
        config.disable_glog_info()
        if not onednn:
            config.disable_mkldnn()
        self._predictor = inference.create_predictor(config)
        self._input = self._predictor.get_input_handle(self._predictor.get_input_names()[0])
        self._output = self._predictor.get_output_handle(self._predictor.get_output_names()[0])
        self._thread = threading.get_ident() if bind_thread else None
        self._lock = threading.Lock()
        self.block_rows = block_rows
        self._block: np.ndarray | None = None  # the padded block, reused

    @classmethod
    def from_pass(cls, info: PassInfo, threads: int = 1) -> DenseModel:
        return cls(info.path / DENSE_DIR / DENSE_PREFIX, threads)

    def predict(self, emb_concat: np.ndarray) -> np.ndarray:
        """Click probabilities float32 [n] for pooled embeddings [n, slots*width]."""
        if self._thread is not None and threading.get_ident() != self._thread:
            raise RuntimeError("this DenseModel is bound to the thread that created it (one predictor per thread)")
        n = len(emb_concat)
        if n == 0:
            return np.zeros(0, np.float32)
        with self._lock:
            if self.block_rows is None:
                return self._run(np.ascontiguousarray(emb_concat, dtype=np.float32))
            b = self.block_rows
            out = np.empty(n, np.float32)
            for start in range(0, n, b):
                rows = emb_concat[start : start + b]
                if len(rows) == b:
                    out[start : start + b] = self._run(np.ascontiguousarray(rows, dtype=np.float32))
                    continue
                block = self._block
                if block is None or block.shape[1] != emb_concat.shape[1]:
                    block = self._block = np.zeros((b, emb_concat.shape[1]), np.float32)
                block[: len(rows)] = rows
                block[len(rows) :] = 0.0
                out[start:] = self._run(block)[: len(rows)]
            return out

    def _run(self, x: np.ndarray) -> np.ndarray:
        self._input.reshape(list(x.shape))
        self._input.copy_from_cpu(x)
        self._predictor.run()
        return self._output.copy_to_cpu().reshape(-1).copy()


Lookup = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]


def score_batch(batch: KeyBatch, lookup: Lookup, model: DenseModel, dense_norm: DenseNorm | None = None) -> np.ndarray:
    vectors, _found = lookup(batch.keys)
    return model.predict(model_input(batch, vectors, dense_norm))


def score_lines(lines: Sequence[str], info: PassInfo, lookup: Lookup, model: DenseModel) -> np.ndarray:
    """Probabilities for slot-format lines under pass ``info``."""
    batch = batch_from_lines(lines, info.slots, info.sparse_dim, info.dense_slots)
    return score_batch(batch, lookup, model, info.dense_norm)
