"""One trainer's lines of a pass, epoch after epoch: held-out lines kept apart, optional shuffling.

Trainer 0 holds out every ``stride``-th line of its share until it has
``need`` lines: they are never trained on, in any epoch, and score the pass
(held-out AUC and log loss, the early stop, golden.jsonl). Reading is in file
order, so the same positions are held out again in later epochs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from elastic_control.data.line_batch import LineBatch, concat_batches, permute_rows, take_rows


@dataclass
class Holdout:
    need: int
    stride: int
    lines: list[LineBatch] = field(default_factory=list)
    end: int | None = None  # once the first epoch is over: position after the last held-out line

    @property
    def count(self) -> int:
        return sum(len(b) for b in self.lines)

    def batch(self) -> LineBatch:
        return concat_batches(self.lines) if self.lines else LineBatch.empty()


def without_holdout(chunks: Iterable[LineBatch], holdout: Holdout, *, first_epoch: bool) -> Iterator[LineBatch]:
    """The chunks minus the held-out lines; the first epoch also collects them into ``holdout.lines``."""
    seen = 0
    remaining = holdout.need if first_epoch else 0
    last = -1
    for chunk in chunks:
        idx = np.arange(seen, seen + len(chunk))
        on_stride = idx % holdout.stride == holdout.stride - 1 if holdout.stride > 0 else np.zeros(len(chunk), bool)
        if first_epoch:
            held = np.flatnonzero(on_stride)[:remaining]
            remaining -= len(held)
            if len(held):
                holdout.lines.append(take_rows(chunk, held))
                last = int(idx[held[-1]])
        else:
            held = np.flatnonzero(on_stride & (idx < (holdout.end or 0)))
        seen += len(chunk)
        if len(held):
            chunk = take_rows(chunk, np.setdiff1d(np.arange(len(chunk)), held, assume_unique=True))
        if len(chunk):
            yield chunk
    if first_epoch:
        holdout.end = last + 1


def shuffled(chunks: Iterable[LineBatch], window: int, rng: np.random.Generator) -> Iterator[LineBatch]:
    """Lines shuffled within consecutive windows of about ``window`` lines (0: unchanged)."""
    if window <= 0:
        yield from chunks
        return
    pending: list[LineBatch] = []
    have = 0
    for chunk in chunks:
        pending.append(chunk)
        have += len(chunk)
        if have >= window:
            merged = concat_batches(pending)
            yield permute_rows(merged, rng.permutation(len(merged)))
            pending, have = [], 0
    if have:
        merged = concat_batches(pending)
        yield permute_rows(merged, rng.permutation(len(merged)))


def planned_epochs(setting: int | str, first_epoch_steps: int, *, min_steps: int, max_epochs: int) -> int:
    """Epochs of a pass: the setting, or with ``auto`` enough for ``min_steps`` steps (1..max_epochs)."""
    if setting != "auto":
        return int(setting)
    if first_epoch_steps <= 0:
        return 1
    return max(1, min(max_epochs, math.ceil(min_steps / first_epoch_steps)))


class KeyCounts:
    """How often each key occurs in a stream of key arrays (sorted unique keys + counts, merged in blocks)."""

    def __init__(self, block: int = 4_000_000):
        self.keys = np.zeros(0, np.uint64)
        self.counts = np.zeros(0, np.int64)
        self._pending: list[np.ndarray] = []
        self._pending_size = 0
        self._block = block

    def add(self, keys: np.ndarray) -> None:
        self._pending.append(np.asarray(keys, dtype=np.uint64))
        self._pending_size += len(keys)
        if self._pending_size >= self._block:
            self._merge()

    def _merge(self) -> None:
        if not self._pending:
            return
        new_keys, new_counts = np.unique(np.concatenate(self._pending), return_counts=True)
        self._pending, self._pending_size = [], 0
        keys = np.concatenate([self.keys, new_keys])
        counts = np.concatenate([self.counts, new_counts])
        self.keys, inverse = np.unique(keys, return_inverse=True)
        self.counts = np.bincount(inverse, weights=counts, minlength=len(self.keys)).astype(np.int64)

    def __len__(self) -> int:
        self._merge()
        return len(self.keys)

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """int64 count of each key (0 for a key never counted)."""
        self._merge()
        keys = np.asarray(keys, dtype=np.uint64)
        if not len(self.keys):
            return np.zeros(len(keys), np.int64)
        idx = np.minimum(np.searchsorted(self.keys, keys), len(self.keys) - 1)
        return np.where(self.keys[idx] == keys, self.counts[idx], 0)

    def inverse(self, keys: np.ndarray) -> np.ndarray:
        """float32 1 / count of each key (1 for a key never counted)."""
        return (1.0 / np.maximum(self.lookup(keys), 1)).astype(np.float32)

    def absorb(self, other: KeyCounts) -> None:
        """Add another count's keys and counts to this one."""
        self._merge()
        other._merge()
        keys = np.concatenate([self.keys, other.keys])
        counts = np.concatenate([self.counts, other.counts])
        self.keys, inverse = np.unique(keys, return_inverse=True)
        self.counts = np.bincount(inverse, weights=counts, minlength=len(self.keys)).astype(np.int64)
