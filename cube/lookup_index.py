"""Batched key lookup over one shard's sorted keys: a top-bits offset table over sorted keys.

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

from cube.shard_format import ShardData

WINDOW_MAX_WIDTH = 32  # widest bucket for which small batches use the window gather
WINDOW_MAX_KEYS = 512  # above, the fixed-depth search is as cheap per key (416 keys: 45 vs 48 us; 1000: even)


class ShardIndex:
    """Read-only lookup structure over one loaded shard (thread-safe: nothing mutates)."""

    def __init__(self, shard: ShardData, bucket_bits: int | None = None):
        self.shard = shard
        self.version, self.dim = shard.version, shard.dim
        keys = shard.keys
        n = len(keys)
        top = int(keys[-1]).bit_length() if n else 1
        bits = bucket_bits if bucket_bits is not None else max(1, min(26, max(n, 1).bit_length() - 1))
        bits = min(bits, top)
        self._shift = np.uint64(top - bits)
        # start[b] = first row whose key >> shift >= b; start[2**bits] = n. The keys are sorted, so that
        # is the number of keys in lower buckets: a count per bucket and a running sum (one pass over the
        # keys, instead of a binary search per bucket).
        counts = np.bincount((keys >> self._shift).astype(np.int64), minlength=2**bits) if n else np.zeros(2**bits)
        self._start = np.zeros(2**bits + 1, dtype=np.int64)
        np.cumsum(counts, out=self._start[1:])
        widest = int(counts.max()) if n else 0
        self._steps = max(1, widest.bit_length())  # 2**steps > widest bucket
        self._keys = keys
        self._n = n
        self.row_bytes = 4 * self.dim
        # Rows as opaque bytes: take() copies each as one chunk instead of dim strided floats.
        self._row_bytes = shard.values.reshape(n, self.dim).view(np.uint8)
        # A padded copy of the keys is NOT made: probes are clamped instead (the keys stay shared).
        self._top_bucket = np.uint64(len(self._start) - 2)
        self._shift_0d = np.array(self._shift)  # a 0-d array: cheaper for a ufunc than a scalar
        # Hashed keys use all 64 bits, so no query can land past the last bucket: skip the clamp.
        self._clamp = top < 64
        # Small batches: compare each key with its whole bucket at once. windows[r] is the `widest` keys
        # from row r as ONE opaque item (a strided view of the keys, no copy), so gathering every key's
        # window is a plain 1-D fancy index: a handful of numpy calls instead of three per search step,
        # and fewer than a 2-D index (a (26, widest) index array, or a 2-D sliding-window view, cost
        # 1-2 us more per 26 keys). Only while buckets are narrow, as they are for hashed keys (~1.2 rows
        # on average).
        self._windows = None
        if 0 < widest <= WINDOW_MAX_WIDTH:
            self._window_keys = np.dtype((np.uint64, (widest,)))  # a window seen as its keys
            self._last_window = n - widest  # windows start at rows 0 .. n - widest
            self._windows = np.ndarray(
                shape=(n - widest + 1,), dtype=np.dtype((np.void, 8 * widest)), buffer=keys, strides=(8,)
            )

    @property
    def rows(self) -> int:
        return self._n

    def positions(self, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row index int64[n], found bool[n]) of each query key; row is meaningless where not found."""
        query = np.asarray(query, dtype=np.uint64)
        if self._n == 0 or len(query) == 0:
            return np.zeros(len(query), np.int64), np.zeros(len(query), bool)
        if self._windows is not None and len(query) <= WINDOW_MAX_KEYS:
            return self._window_positions(query)
        pos = self._start.take(self._buckets(query))
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

    def _buckets(self, query: np.ndarray) -> np.ndarray:
        """Bucket of each key as int64 (keys above the table's top bit go to the last bucket)."""
        bucket = np.right_shift(query, self._shift_0d)
        if self._clamp:
            np.minimum(bucket, self._top_bucket, out=bucket)
        return bucket.view(np.int64)  # < 2**63 (shift >= 1, or clamped), so the view is exact

    def _window_positions(self, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """positions() for a small batch: compare each key with every row of its bucket."""
        pos = self._start.take(self._buckets(query))
        # A bucket starting in the last `widest` rows lies inside the last window.
        np.minimum(pos, self._last_window, out=pos)
        equal = self._windows[pos].view(self._window_keys) == query[:, None]  # (n, widest) keys
        pos += equal.argmax(axis=1)  # the first equal row (any row of the window when none is)
        return pos, self._keys.take(pos) == query

    def lookup_rows(self, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows uint8[n, row_bytes], found bool[n]) for uint64 ``query``; rows of missing keys are zero.

        The hot path of cube-server, kept to a few numpy calls: the rows are
        gathered as raw bytes (one memcpy each) and come back contiguous,
        ready to be sliced per request and sent.
        """
        if self._windows is not None and 0 < len(query) <= WINDOW_MAX_KEYS and query.dtype == np.uint64:
            pos, found = self._window_positions(query)
            rows = self._row_bytes.take(pos, axis=0)
            rows[~found] = 0  # one boolean assignment: the cheapest way for a few rows
            return rows, found
        pos, found = self.positions(query)
        if self._n == 0:
            return np.zeros((len(pos), self.row_bytes), np.uint8), found
        rows = self._row_bytes.take(pos, axis=0, mode="clip")
        if not found.all():
            rows[~found] = 0
        return rows, found

    def lookup(self, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(values float32[n, dim], found bool[n]); missing keys get zero vectors."""
        rows, found = self.lookup_rows(query)
        return rows.view(np.float32), found
