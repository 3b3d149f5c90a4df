"""Batched key lookup over a memory-mapped shard: a top-bits offset table over sorted keys.

``np.searchsorted`` on millions of sorted keys is slower than Redis: each of
its ~23 probes is a dependent cache miss. Keys are hashes (or ``feasign %
SPARSE_DIM``, even over their range), so the high bits of a key below the
highest used bit spread keys evenly over 2**B buckets: an offset table
``start[b]`` (B ~ log2(rows)) narrows every key to a bucket of a few rows,
and a branch-free, vectorised binary search of fixed depth finishes it.
Everything is numpy over the whole batch: the per-batch cost is a handful of
array passes, which is why the server merges waiting requests into one batch.
"""
from __future__ import annotations

import numpy as np

from cube.shard_format import MappedShard


class ShardIndex:
    """Read-only lookup structure over one mapped shard (thread-safe: nothing mutates)."""

    def __init__(self, shard: MappedShard, bucket_bits: int | None = None):
        self.shard = shard
        self.version, self.dim = shard.version, shard.dim
        keys = shard.keys
        n = len(keys)
        top = int(keys[-1]).bit_length() if n else 1
        bits = bucket_bits if bucket_bits is not None else max(1, min(26, max(n, 1).bit_length() - 1))
        bits = min(bits, top)
        self._shift = np.uint64(top - bits)
        # start[b] = first row whose key >> shift >= b; start[2**bits] = n.
        buckets = (keys >> self._shift).astype(np.int64) if n else np.zeros(0, np.int64)
        self._start = np.searchsorted(buckets, np.arange(2 ** bits + 1, dtype=np.int64)).astype(np.int64)
        widest = int(np.diff(self._start).max()) if n else 0
        self._steps = max(1, widest.bit_length())  # 2**steps > widest bucket
        self._keys = keys
        self._n = n
        self._rows = shard.values.view(np.dtype((np.void, 4 * self.dim))).reshape(n)
        # A padded copy of the keys is NOT made: probes are clamped instead, keeping lookup zero-copy.

    @property
    def rows(self) -> int:
        return self._n

    def positions(self, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row index int64[n], found bool[n]) of each query key; row is meaningless where not found."""
        query = np.asarray(query, dtype=np.uint64)
        if self._n == 0 or len(query) == 0:
            return np.zeros(len(query), np.int64), np.zeros(len(query), bool)
        bucket = (query >> self._shift).astype(np.int64)
        np.minimum(bucket, len(self._start) - 2, out=bucket)  # keys above the table's top bit
        pos = self._start[bucket]
        keys = self._keys
        # Lower bound from the bucket's first row in fixed-depth power-of-two steps.
        # No upper bound is needed: rows past the bucket hold keys of higher
        # buckets, which are larger than the query, so a step never crosses them
        # (clipping at the last row only matters for a key that is absent anyway).
        step = 1 << (self._steps - 1)
        probe_at = np.empty_like(pos)
        probe = np.empty(len(query), np.uint64)
        less = np.empty(len(query), bool)
        while step:
            np.add(pos, step - 1, out=probe_at)
            np.take(keys, probe_at, mode="clip", out=probe)
            np.less(probe, query, out=less)
            np.add(pos, step, out=pos, where=less)
            step >>= 1
        found = np.take(keys, pos, mode="clip") == query
        return pos, found

    def lookup(self, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(values float32[n, dim], found bool[n]); missing keys get zero vectors."""
        pos, found = self.positions(query)
        np.minimum(pos, self._n - 1, out=pos)
        # Rows gathered as opaque dim*4-byte records: one memcpy each instead of dim strided copies.
        values = np.take(self._rows, pos).view(np.float32).reshape(len(pos), self.dim)
        if not found.all():
            values[~found] = 0.0
        return values, found
