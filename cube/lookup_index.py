"""Batched key lookup over one shard's sorted keys: a top-bits offset table over sorted keys.

``np.searchsorted`` on millions of sorted keys is slower than Redis: each of
its ~23 probes is a dependent cache miss. Keys are hashes (or ``feasign %
SPARSE_DIM``, even over their range), so the high bits of a key below the
highest used bit spread keys evenly over 2**B buckets: an offset table
``start[b]`` (B ~ log2(rows)) narrows every key to a bucket of a few rows,
and a branch-free, vectorised binary search of fixed depth finishes it.
Batches up to ``COMPILED_MAX_KEYS`` run that search in one compiled pass that
also writes the answer (``cube/lookup_kernel.py``); larger ones run it as numpy
passes over the whole batch, which is why the server merges waiting requests
into one batch.
"""

from __future__ import annotations

import numpy as np

from cube.shard_format import ShardData

# Batches up to here take the compiled pass; from about 1500 keys the numpy passes are as fast, then faster
# (lookup_rows' CPU per batch on 10M keys, compiled vs numpy: 26 keys 5.9 vs 24.5 us, 1000 keys 91 vs 98,
# 1500 keys 133 vs 135, 2048 keys 185 vs 182, 4000 keys 340 vs 328).
COMPILED_MAX_KEYS = 1024


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
        # The values as 32-bit words, the unit the compiled pass copies a row in (contiguous, as a
        # shard's values are; anything else stays on the numpy passes rather than be copied).
        self._row_words = shard.values.reshape(n, self.dim).view(np.uint32)
        self._gather = None
        if n and keys.flags.c_contiguous and self._row_words.flags.c_contiguous:
            # function-level: numba and the kernel's load only where lookups are served (cube-builder and
            # cube-transfer import version_store too)
            from cube.lookup_kernel import gather_answer

            self._gather = gather_answer

    @property
    def rows(self) -> int:
        return self._n

    def positions(self, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row index int64[n], found bool[n]) of each query key; row is meaningless where not found."""
        query = np.asarray(query, dtype=np.uint64)
        if self._n == 0 or len(query) == 0:
            return np.zeros(len(query), np.int64), np.zeros(len(query), bool)
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

    def lookup_body(self, query: np.ndarray) -> tuple[np.ndarray, int]:
        """(body, misses) of the answer to uint64 ``query``: ``body`` is uint8, the rows (``row_bytes``
        each, zeros for a missing key) then the found-bitmap (bit i of byte i // 8, least significant
        first), as cube-server sends them; ``misses`` the number of keys not found.

        The hot path of cube-server for a request answered alone: up to ``COMPILED_MAX_KEYS`` keys
        it is one buffer and one compiled call.
        """
        n = len(query)
        rb = self.row_bytes
        body = np.empty(n * rb + ((n + 7) >> 3), np.uint8)
        if self._compiled(query):
            return body, self._gather(query, self._start, self._shift, self._steps, self._keys, self._row_words, body)
        rows, found = self.search_rows(query)
        body[: n * rb] = rows.reshape(-1)
        body[n * rb :] = np.packbits(found, bitorder="little")
        return body, n - int(np.count_nonzero(found))

    def lookup_rows(self, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows uint8[n, row_bytes], found bool[n]) for uint64 ``query``; rows of missing keys are zero.

        The rows come back contiguous, ready to be sliced per request and sent.
        """
        if not self._compiled(query):
            return self.search_rows(query)
        n = len(query)
        body, _ = self.lookup_body(query)
        found = np.unpackbits(body[n * self.row_bytes :], count=n, bitorder="little").view(bool)
        return body[: n * self.row_bytes].reshape(n, self.row_bytes), found

    def _compiled(self, query: np.ndarray) -> bool:
        """Whether ``query`` takes the compiled pass (a small batch of plain contiguous uint64 keys)."""
        return (
            0 < len(query) <= COMPILED_MAX_KEYS
            and self._gather is not None
            and query.dtype == np.uint64
            and query.flags.c_contiguous
        )

    def search_rows(self, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """lookup_rows() by the numpy passes of positions(), for any batch (the path of large ones)."""
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
