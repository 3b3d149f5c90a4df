"""Scoring parsed lines with a pass offline: its sparse table in memory, its dense program in paddle.inference.

The path is the shared one (elastic_control/scoring.py: pool + DenseModel),
fed from the training reader's column batches (data/line_batch.py), so the
probabilities are the ones serving and the training program compute.
"""

from __future__ import annotations

import os

import numpy as np

from ctr_foundation.pass_format import PassInfo, load_pass
from elastic_control.data.line_batch import LineBatch
from elastic_control.inference.scoring import DenseModel, InMemoryTable, line_key_batch, model_input

# The dense model runs on chunks of exactly this many rows (the last one zero-padded). The CPU
# kernels pick their code path by the number of rows, and a row's float32 result differs in the
# last bit between paths (measured with the 400-400-400 MLP: 3-7, 13-15, 33-39, 145-171 rows
# differ from 128 or 4096): with a fixed chunk, a line's score no longer depends on how many lines
# share its batch, so scores (and the metrics) are identical however the window is split. Chunks
# cost no more CPU than one call (8192 rows: 734 ms in 256-row chunks, 776 ms in one call, medians
# of 4 interleaved runs on a loaded machine), and a small chunk pads a partial batch with few rows.
DENSE_CHUNK_ROWS = 256


def group_keys(batch: LineBatch, group_slot: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(group uint64[n], has_group bool[n]): each line's first feasign of ``group_slot``."""
    n = len(batch)
    groups, has = np.zeros(n, np.uint64), np.zeros(n, bool)
    if group_slot is None or n == 0:
        return groups, has
    idx = np.flatnonzero(batch.feature_slots == group_slot)
    lines, first = np.unique(batch.feature_line[idx], return_index=True)
    groups[lines] = batch.feasigns[idx[first]]
    has[lines] = True
    return groups, has


class PassScorer:
    """A pass loaded for offline scoring (one per process: paddle predictors are per process)."""

    def __init__(self, pass_dir: str | os.PathLike, threads: int = 1):
        self.info: PassInfo = load_pass(pass_dir)
        self.table = InMemoryTable.from_pass(self.info)
        self.model = DenseModel.from_pass(self.info, threads=threads)

    @property
    def name(self) -> str:
        return self.info.name

    def score(self, batch: LineBatch) -> np.ndarray:
        """Click probabilities float32[n] for the lines of ``batch``."""
        kb = line_key_batch(batch, self.info.slots, self.info.sparse_dim, self.info.dense_slots)
        vectors, _found = self.table.lookup(kb.keys)
        return predict_in_fixed_chunks(self.model, model_input(kb, vectors, self.info.dense_norm))


def predict_in_fixed_chunks(model: DenseModel, x: np.ndarray, rows: int = DENSE_CHUNK_ROWS) -> np.ndarray:
    """``model.predict(x)`` computed on chunks of exactly ``rows`` rows, so each row's result is independent
    of the batch it came in."""
    n = len(x)
    if n == 0:
        return model.predict(x)
    padded = np.zeros((n + (-n) % rows, x.shape[1]), np.float32)
    padded[:n] = x
    return np.concatenate([model.predict(padded[i : i + rows]) for i in range(0, len(padded), rows)])[:n]
