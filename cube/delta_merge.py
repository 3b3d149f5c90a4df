"""Delta versions: fold a chain of deltas into one, and lay a delta over its parent's rows.

A delta says, for one shard: these keys now have these values (new or changed
keys), and these keys are gone. Its version's content is its parent's content
with the delta applied: changed keys answer their new values, deleted keys are
not found, every other key keeps its parent's value. A key both changed and
deleted in one delta is changed (the deletes are applied first).

cube-server materialises a delta version into one sorted array per version
when it loads it (one O(rows) merge, ~0.1 s per million rows), so a lookup costs
the same on a delta version as on a base version; cube-builder uses the same
functions to compact a chain into a new base.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cube.shard_format import private_array


@dataclass(frozen=True)
class Delta:
    keys: np.ndarray  # uint64 [m], sorted, unique: new or changed keys
    values: np.ndarray  # float32 [m, dim]
    deleted: np.ndarray  # uint64 [k], sorted, unique, disjoint from keys

    @classmethod
    def of(cls, keys: np.ndarray, values: np.ndarray, deleted: np.ndarray) -> Delta:
        """A delta from sorted unique changed keys and sorted unique deleted keys (a key in both: changed)."""
        deleted = np.asarray(deleted, dtype=np.uint64)
        if len(deleted) and len(keys):
            deleted = deleted[~contains(keys, deleted)]
        return cls(np.asarray(keys, dtype=np.uint64), np.asarray(values, dtype=np.float32), deleted)

    @property
    def dim(self) -> int:
        return self.values.shape[1]


def contains(sorted_keys: np.ndarray, query: np.ndarray) -> np.ndarray:
    """bool[len(query)]: is each query key in ``sorted_keys`` (sorted ascending)?"""
    if len(sorted_keys) == 0 or len(query) == 0:
        return np.zeros(len(query), dtype=bool)
    pos = np.searchsorted(sorted_keys, query)
    np.minimum(pos, len(sorted_keys) - 1, out=pos)
    return sorted_keys[pos] == query


def _rows(values: np.ndarray) -> np.ndarray:
    """float32 [n, dim] as n opaque fixed-size records (one memcpy per row when moved)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    return values.view(np.dtype((np.void, 4 * values.shape[1]))).reshape(len(values))


def fold(older: Delta, newer: Delta) -> Delta:
    """The single delta equivalent to applying ``older`` then ``newer``."""
    if older.dim != newer.dim:
        raise ValueError(f"deltas of dim {older.dim} and {newer.dim} cannot be folded")
    survives = ~(contains(newer.deleted, older.keys) | contains(newer.keys, older.keys))
    keys = np.concatenate([older.keys[survives], newer.keys])
    values = np.concatenate([older.values[survives], newer.values])
    order = np.argsort(keys, kind="stable")
    still_deleted = older.deleted[~contains(newer.keys, older.deleted)]
    deleted = np.union1d(still_deleted, newer.deleted).astype(np.uint64)
    return Delta(keys[order], values[order], deleted)


def fold_all(deltas: list[Delta]) -> Delta:
    """Fold a chain of deltas, oldest first."""
    out = deltas[0]
    for d in deltas[1:]:
        out = fold(out, d)
    return out


def apply(keys: np.ndarray, values: np.ndarray, delta: Delta) -> tuple[np.ndarray, np.ndarray]:
    """(keys, values) of the parent rows ``keys``/``values`` with ``delta`` laid over them.

    The parent arrays are never modified; with an empty delta they are returned as they are. One
    sequential gather of the parent's rows into the new arrays, then the delta's rows put in place:
    no pass over the parent besides that one (~0.08 s CPU for 5M rows of 9 floats).
    """
    if len(delta.keys) == 0 and len(delta.deleted) == 0:
        return keys, values
    if len(keys) and values.shape[1] != delta.dim:
        raise ValueError(f"a delta of dim {delta.dim} cannot apply to rows of dim {values.shape[1]}")
    n, m = len(keys), len(delta.keys)
    out_dtype = np.dtype((np.void, 4 * delta.dim))
    if n == 0:
        return delta.keys.copy(), delta.values.copy()
    dropped = []
    for query in (delta.keys, delta.deleted):  # parent rows replaced or deleted
        if len(query):
            pos = np.searchsorted(keys, query)
            hit = pos < n
            hit[hit] = keys[pos[hit]] == query[hit]
            dropped.append(pos[hit])
    drop = np.sort(np.concatenate(dropped)) if dropped else np.zeros(0, np.int64)
    # Output position of each changed key: its rank among the kept parent rows plus the changed keys before it.
    kept_before = np.searchsorted(keys, delta.keys) - np.searchsorted(drop, np.searchsorted(keys, delta.keys))
    at = kept_before + np.arange(m)
    total = n - len(drop) + m
    # The parent row each output position copies: src = cumsum(step) - 1, where the parent index advances by
    # 1 per parent-sourced position, not at all on a changed key's position, and by one more after each
    # dropped row (at the position of the first kept row after it).
    step = np.ones(total, dtype=np.int64)
    step[at] = 0
    rank = drop - np.arange(len(drop))  # the kept row a dropped row precedes
    jump = rank + np.searchsorted(kept_before, rank, side="right")
    np.add.at(step, jump[jump < total], 1)
    src = np.cumsum(step, out=step)
    src -= 1
    out_keys = private_array(total, np.uint64)
    out_rows = private_array(total, out_dtype)
    np.take(keys, src, out=out_keys, mode="clip")  # (a changed key's src is a neighbour's: overwritten next)
    np.take(_rows(values), src, out=out_rows, mode="clip")
    out_keys[at] = delta.keys
    out_rows[at] = _rows(delta.values)
    return out_keys, out_rows.view(np.float32).reshape(total, delta.dim)
