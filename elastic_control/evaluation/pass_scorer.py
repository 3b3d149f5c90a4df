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
# share its batch, so scores (and the metrics) are identical however the window is split. Chunks of
# 128 to 8192 rows gave the same bits for every row; larger chunks cost less per row (CPU per 32,768
# rows of the 400-400-400 MLP: 122 ms in chunks of 256, 94 ms of 4096, 84 ms of 8192; the per-line
# path's calls of 2048 rows, 103 ms). ``ChunkedScoring`` carries rows over from one batch to the next,
# so only a share's last chunk is padded.
DENSE_CHUNK_ROWS = 8192


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
        return predict_in_fixed_chunks(self.model, self.model_input(batch))

    def model_input(self, batch: LineBatch) -> np.ndarray:
        """The dense program's input rows for the lines of ``batch`` (pooled embeddings, dense slots)."""
        kb = line_key_batch(batch, self.info.slots, self.info.sparse_dim, self.info.dense_slots)
        return model_input(kb, self.lookup(kb.keys), self.info.dense_norm)

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """The table's rows for ``keys`` (zero rows for keys it lacks): ``InMemoryTable.lookup``'s vectors,
        gathered with one ``take`` and the few missing rows zeroed, rather than through boolean masks."""
        table = self.table
        if not len(table.keys):
            return np.zeros((len(keys), table.dim), np.float32)
        idx = np.searchsorted(table.keys, keys)
        np.minimum(idx, len(table.keys) - 1, out=idx)
        found = table.keys[idx] == keys
        vectors = table.values.take(idx, axis=0)
        if not found.all():
            vectors[~found] = 0.0
        return vectors


class ChunkedScoring:
    """Scores a stream of batches with one or more passes, running each dense program on chunks of exactly
    ``rows`` rows that run across batch boundaries: a batch's scores come out once all its rows have run,
    in the order the batches went in, and only the stream's last chunk is padded.

    ``add(batch, item)`` and ``finish()`` return the ``(item, [scores per pass])`` of the batches completed.
    """

    def __init__(self, scorers: list[PassScorer], rows: int = DENSE_CHUNK_ROWS):
        self.scorers = scorers
        self.rows = rows
        self._items: list[tuple[object, int]] = []  # batches not yet returned, and their row counts
        self._inputs: list[list[np.ndarray]] = [[] for _ in scorers]  # rows not yet run, per pass
        self._pending = 0
        self._scored: list[list[np.ndarray]] = [[] for _ in scorers]  # scores not yet returned, per pass
        self._ready = 0

    def add(self, batch: LineBatch, item) -> list[tuple[object, list[np.ndarray]]]:
        self._items.append((item, len(batch)))
        for inputs, scorer in zip(self._inputs, self.scorers, strict=True):
            inputs.append(scorer.model_input(batch))
        self._pending += len(batch)
        full = self._pending - self._pending % self.rows
        if full:
            self._run(full)
        return self._completed()

    def finish(self) -> list[tuple[object, list[np.ndarray]]]:
        if self._pending:
            self._run(self._pending)  # the last chunk, padded
        return self._completed()

    def _run(self, n: int) -> None:
        for j, scorer in enumerate(self.scorers):
            x = np.concatenate(self._inputs[j]) if len(self._inputs[j]) > 1 else self._inputs[j][0]
            self._scored[j].append(predict_in_fixed_chunks(scorer.model, x[:n], self.rows))
            self._inputs[j] = [x[n:]] if n < len(x) else []
        self._pending -= n
        self._ready += n

    def _completed(self) -> list[tuple[object, list[np.ndarray]]]:
        done = []
        while self._items and self._items[0][1] <= self._ready:
            item, n = self._items.pop(0)
            per_pass = []
            for j in range(len(self.scorers) if n else 0):
                scored = np.concatenate(self._scored[j]) if len(self._scored[j]) > 1 else self._scored[j][0]
                per_pass.append(scored[:n])
                self._scored[j] = [scored[n:]] if n < len(scored) else []
            self._ready -= n
            done.append((item, per_pass or [np.zeros(0, np.float32) for _ in self.scorers]))
        return done


def predict_in_fixed_chunks(model: DenseModel, x: np.ndarray, rows: int = DENSE_CHUNK_ROWS) -> np.ndarray:
    """``model.predict(x)`` computed on chunks of exactly ``rows`` rows, so each row's result is independent
    of the batch it came in."""
    n = len(x)
    if n == 0:
        return model.predict(x)
    padded = np.zeros((n + (-n) % rows, x.shape[1]), np.float32)
    padded[:n] = x
    return np.concatenate([model.predict(padded[i : i + rows]) for i in range(0, len(padded), rows)])[:n]
