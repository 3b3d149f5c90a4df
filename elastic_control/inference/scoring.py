"""Scoring a pass outside the trainer: lines -> pooled embeddings -> dense model.

Serving (embeddings from cube) and offline evaluation (embeddings from the
pass's sparse table in memory) both go through here, so that they compute
exactly what the training program computed (golden.jsonl, within 1e-5).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ctr_foundation.pass_format import DENSE_DIR, DENSE_PREFIX, PassInfo
from ctr_foundation.sample import Sample, parse_sample_line, slot_keys


@dataclass(frozen=True)
class KeyBatch:
    """The keys of n instances, flattened: key j belongs to row rows[j], slot position slot_pos[j]."""

    keys: np.ndarray  # uint64 [m]
    rows: np.ndarray  # int64 [m]
    slot_pos: np.ndarray  # int64 [m]
    n: int
    num_slots: int


def batch_from_slot_keys(per_instance: Sequence[list[np.ndarray]], num_slots: int) -> KeyBatch:
    """Flatten per-instance, per-slot key arrays (as data.sample.slot_keys returns)."""
    keys, rows, pos = [], [], []
    for r, per_slot in enumerate(per_instance):
        for s, k in enumerate(per_slot):
            keys.append(k)
            rows.append(np.full(len(k), r, np.int64))
            pos.append(np.full(len(k), s, np.int64))
    if not keys:
        z = np.zeros(0, np.int64)
        return KeyBatch(np.zeros(0, np.uint64), z, z, 0, num_slots)
    return KeyBatch(
        np.concatenate(keys).astype(np.uint64), np.concatenate(rows), np.concatenate(pos), len(per_instance), num_slots
    )


def batch_from_samples(samples: Iterable[Sample], slots: Sequence[int], sparse_dim: int | None) -> KeyBatch:
    slots = tuple(slots)
    return batch_from_slot_keys([slot_keys(s, slots, sparse_dim) for s in samples], len(slots))


def batch_from_lines(lines: Iterable[str], slots: Sequence[int], sparse_dim: int | None) -> KeyBatch:
    return batch_from_samples((parse_sample_line(ln) for ln in lines), slots, sparse_dim)


def pool(batch: KeyBatch, vectors: np.ndarray) -> np.ndarray:
    """Sum the key vectors per (row, slot): float32 [n, num_slots * dim] in slot order."""
    dim = vectors.shape[1]
    out = np.zeros((batch.n * batch.num_slots, dim), np.float32)
    if len(batch.keys):
        np.add.at(out, batch.rows * batch.num_slots + batch.slot_pos, vectors.astype(np.float32, copy=False))
    return out.reshape(batch.n, batch.num_slots * dim)


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


class DenseModel:
    """The pass's dense inference program, run with paddle.inference (CPU).

    A paddle predictor is not thread-safe: ``predict`` serialises callers;
    use ``clone()`` to get an independent predictor per worker thread.
    """

    def __init__(self, model_prefix: str | Path, threads: int = 1):
        import pyarrow  # noqa: F401  (must be imported before paddle)

        from paddle import inference

        prefix = str(model_prefix)
        self.prefix = prefix
        config = inference.Config(prefix + ".pdmodel", prefix + ".pdiparams")
        config.disable_gpu()
        config.set_cpu_math_library_num_threads(threads)
        config.disable_glog_info()
        self._predictor = inference.create_predictor(config)
        self._input = self._predictor.get_input_handle(self._predictor.get_input_names()[0])
        self._output = self._predictor.get_output_handle(self._predictor.get_output_names()[0])
        self._lock = threading.Lock()

    @classmethod
    def from_pass(cls, info: PassInfo, threads: int = 1) -> DenseModel:
        return cls(info.path / DENSE_DIR / DENSE_PREFIX, threads)

    def clone(self) -> DenseModel:
        twin = object.__new__(DenseModel)
        twin.prefix = self.prefix
        twin._predictor = self._predictor.clone()
        twin._input = twin._predictor.get_input_handle(twin._predictor.get_input_names()[0])
        twin._output = twin._predictor.get_output_handle(twin._predictor.get_output_names()[0])
        twin._lock = threading.Lock()
        return twin

    def predict(self, emb_concat: np.ndarray) -> np.ndarray:
        """Click probabilities float32 [n] for pooled embeddings [n, slots*dim]."""
        if len(emb_concat) == 0:
            return np.zeros(0, np.float32)
        with self._lock:
            self._input.reshape(list(emb_concat.shape))
            self._input.copy_from_cpu(np.ascontiguousarray(emb_concat, dtype=np.float32))
            self._predictor.run()
            return self._output.copy_to_cpu().reshape(-1).copy()


Lookup = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]


def score_batch(batch: KeyBatch, lookup: Lookup, model: DenseModel) -> np.ndarray:
    vectors, _found = lookup(batch.keys)
    return model.predict(pool(batch, vectors))


def score_lines(lines: Sequence[str], info: PassInfo, lookup: Lookup, model: DenseModel) -> np.ndarray:
    """Probabilities for slot-format lines under pass ``info``."""
    return score_batch(batch_from_lines(lines, info.slots, info.sparse_dim), lookup, model)
