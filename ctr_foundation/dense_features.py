"""Dense (numeric) slots: one number per line and slot, beside the sparse keys.

A click log often carries numbers as well as ids (Criteo's 13 counts, a price, an age). Bucketing a number
into a feasign keeps its slot in the sparse table, but every bucket then learns on its own; the number
itself, fed to the dense part, lets the network use its order and interact it with the embeddings
(CHANGELOG.md, "Dense slots: the counts as numbers").

- slot.conf declares a dense slot as ``SLOT dense`` (config/slot_conf.py); the others are sparse.
- A line carries a dense slot's value as ``value:slot``, ``value`` any finite decimal number
  (``2.5:40``, ``-3:41``, ``1e-3:42``, ``7:43``). A line without a value for a dense slot has it missing;
  several values of one dense slot in a line are summed (sum pooling, as for the sparse slots).
- The network sees each dense slot standardised, ``(value - mean) / std``, with a missing value at 0
  (the mean). ``DenseNorm`` holds mean and std; trainer 0 measures them on its share of the first pass
  of a fresh model, every trainer uses the same ones, and each pass's meta.json records them
  (``dense_norm``), so that serving and evaluation standardise exactly as training did.
- The dense inference program's one input is the pooled sparse rows, slot.conf order, followed by the
  standardised dense slots in slot.conf order: ``[n, len(slots) * embedding_dim + len(dense_slots)]``.

This module owns the extraction (``dense_matrix``) and the standardisation; trainer, evaluation and
serving call them, never a copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ctr_foundation.errors import DataError

# A standard deviation under this (a constant slot) standardises with 1 instead: the slot then only shifts.
MIN_STD = 1e-6


def dense_matrix(
    n: int,
    dense_slots: Sequence[int],
    value_row: np.ndarray,
    value_slots: np.ndarray,
    values: np.ndarray,
    feature_row: np.ndarray | None = None,
    feasigns: np.ndarray | None = None,
    feature_slots: np.ndarray | None = None,
) -> np.ndarray:
    """float64 [n, len(dense_slots)]: each row's value of each dense slot, NaN where the row has none.

    ``value_*``: the value tokens (``2.5:40``). ``feature_*``: the integer tokens, of which those in a
    dense slot are values too (``7:43`` parses as an integer token: the slot's kind decides). Tokens of
    slots that are not dense are ignored here. Several values of one slot in a row are summed.
    """
    k = len(dense_slots)
    out = np.full((n, k), np.nan)
    if not k or not n:
        return out
    slots_arr = np.asarray(list(dense_slots), np.int64)
    order = np.argsort(slots_arr, kind="stable")
    sorted_slots = slots_arr[order]
    rows, cols, vals = [], [], []
    for r, s, v in (
        (value_row, value_slots, values),
        (feature_row, feature_slots, feasigns),
    ):
        if r is None or not len(r):
            continue
        s = np.asarray(s, np.int64)
        at = np.minimum(np.searchsorted(sorted_slots, s), k - 1)
        keep = sorted_slots[at] == s
        if keep.any():
            rows.append(np.asarray(r, np.int64)[keep])
            cols.append(order[at[keep]])
            vals.append(np.asarray(v)[keep].astype(np.float64))
    if not rows:
        return out
    rows, cols, vals = np.concatenate(rows), np.concatenate(cols), np.concatenate(vals)
    cell = rows * k + cols
    present = np.bincount(cell, minlength=n * k) > 0
    summed = np.bincount(cell, weights=vals, minlength=n * k)  # a sum per cell (np.add.at is 10x slower)
    flat = out.reshape(-1)
    flat[present] = summed[present]
    return out


@dataclass(frozen=True)
class DenseNorm:
    """Per dense slot (slot.conf order): the mean and standard deviation the network's input is standardised by."""

    slots: tuple[int, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __post_init__(self):
        if not (len(self.slots) == len(self.mean) == len(self.std)):
            raise DataError(f"dense_norm: {len(self.slots)} slots but {len(self.mean)} means and {len(self.std)} stds")
        if any(not np.isfinite(v) for v in (*self.mean, *self.std)) or any(s <= 0 for s in self.std):
            raise DataError("dense_norm: means and stds must be finite, stds positive")

    def apply(self, raw: np.ndarray) -> np.ndarray:
        """float32 [n, k]: ``(raw - mean) / std``, a missing (NaN) value as 0."""
        raw = np.asarray(raw, np.float64).reshape(-1, len(self.slots))
        z = (raw - np.asarray(self.mean)) / np.asarray(self.std)
        return np.nan_to_num(z, nan=0.0, posinf=0.0, neginf=0.0).astype(np.float32)

    def to_json(self) -> dict:
        return {"slots": list(self.slots), "mean": list(self.mean), "std": list(self.std)}

    @classmethod
    def from_json(cls, obj: dict | None, source: str = "dense_norm") -> DenseNorm | None:
        if not obj:
            return None
        try:
            if not all(isinstance(obj[k], list) for k in ("slots", "mean", "std")):
                raise TypeError("slots, mean and std must be lists")
            return cls(
                tuple(int(s) for s in obj["slots"]),
                tuple(float(v) for v in obj["mean"]),
                tuple(float(v) for v in obj["std"]),
            )
        except (KeyError, TypeError, ValueError, DataError) as e:
            raise DataError(f"{source}: not a dense normalisation ({e})") from None


class DenseMoments:
    """Count, mean and sum of squared deviations per dense slot, mergeable across trainers (JSON-able).

    Merged with Chan et al.'s pairwise update, not as sums of squares: a slot whose values are large beside
    their spread (a timestamp, an id-like number) would lose its variance to cancellation.
    """

    def __init__(self, slots: Sequence[int]):
        self.slots = tuple(int(s) for s in slots)
        k = len(self.slots)
        self.count, self.mean, self.m2 = np.zeros(k), np.zeros(k), np.zeros(k)

    def add(self, raw: np.ndarray) -> None:
        """Add a batch of raw values [n, k] (NaN: missing)."""
        raw = np.asarray(raw, np.float64).reshape(-1, len(self.slots))
        present = np.isfinite(raw)
        count = present.sum(axis=0).astype(np.float64)
        safe = np.maximum(count, 1)
        mean = np.where(present, raw, 0.0).sum(axis=0) / safe
        m2 = np.where(present, (raw - mean) ** 2, 0.0).sum(axis=0)
        self._combine(count, mean, m2)

    def _combine(self, count: np.ndarray, mean: np.ndarray, m2: np.ndarray) -> None:
        total = self.count + count
        safe = np.maximum(total, 1)
        delta = mean - self.mean
        self.mean = self.mean + delta * count / safe
        self.m2 = self.m2 + m2 + delta * delta * self.count * count / safe
        self.count = total

    def to_json(self) -> dict:
        return {
            "slots": list(self.slots),
            "count": self.count.tolist(),
            "mean": self.mean.tolist(),
            "m2": self.m2.tolist(),
        }

    def merge(self, obj: dict) -> None:
        """Add another trainer's ``to_json``."""
        if [int(s) for s in obj["slots"]] != list(self.slots):
            raise DataError(f"dense moments of slots {obj['slots']} cannot merge into {list(self.slots)}")
        self._combine(*(np.asarray(obj[k], np.float64) for k in ("count", "mean", "m2")))

    def norm(self) -> DenseNorm:
        """The standardisation these moments give; a slot never seen gets mean 0, std 1."""
        std = np.sqrt(self.m2 / np.maximum(self.count, 1))
        std = np.where(std < MIN_STD, 1.0, std)
        mean = np.where(self.count > 0, self.mean, 0.0)
        return DenseNorm(self.slots, tuple(mean.tolist()), tuple(std.tolist()))
