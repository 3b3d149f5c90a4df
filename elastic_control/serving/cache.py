"""A bounded hot-key embedding cache inside serving, keyed by (cube version, key).

Feasigns are Zipf-distributed: a small set of keys makes most lookups, so most of them never need
to leave the process. The cache is a 2-way set-associative table in numpy arrays (vectorised for
whole batches: a lookup of thousands of keys is about ten numpy calls, no Python loop per key):
each key of a version maps to one set of two ways; a lookup checks both, an insert fills the way
that was not hit most recently. Memory is fixed at construction (``entries`` rows of key, version
tag, found flag and the row of floats).

Versions never mix: an entry matches only its own version's tag, every lookup names one version,
and the rows of one batch come from that version's entries or from cube lookups pinned to that
version. A version's content never changes (a cube version is immutable), so entries need no
invalidation; entries of versions no longer served are simply overwritten. Cube's misses are cached
too (zeros, found = False), so coverage metrics stay exact.
"""

from __future__ import annotations

import threading

import numpy as np

_MIX = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio: multiplicative hashing
_TAG_MIX = 0xC2B2AE3D27D4EB4F
_MASK64 = (1 << 64) - 1


class EmbeddingCache:
    def __init__(self, entries: int, width: int | None = None):
        if entries < 2:
            raise ValueError("the cache needs at least 2 entries (or is disabled)")
        sets = 1 << max(0, (entries // 2).bit_length() - 1)  # a power of two, sets * 2 <= entries
        self.sets = sets
        self.capacity = 2 * sets
        self._shift = np.uint64(64 - max(sets.bit_length() - 1, 1)) if sets > 1 else None
        self._keys = np.zeros((sets, 2), np.uint64)
        self._tags = np.zeros((sets, 2), np.int64)  # 0 = empty; version tags start at 1
        self._found = np.zeros((sets, 2), bool)
        self._recent = np.zeros(sets, np.int8)  # the way hit or filled last
        self._values: np.ndarray | None = None
        self.width = width
        if width is not None:
            self._values = np.zeros((sets, 2, width), np.float32)
        self._lock = threading.Lock()
        self._tag_of: dict[str, int] = {}
        self.lookups = 0
        self.hits = 0
        self.inserts = 0

    def tag(self, version: str) -> int:
        """The small integer standing for ``version`` in entries (stable for the cache's life)."""
        with self._lock:
            t = self._tag_of.get(version)
            if t is None:
                t = self._tag_of[version] = len(self._tag_of) + 1
            return t

    def _set_of(self, keys: np.ndarray, tag: int) -> np.ndarray:
        if self._shift is None:
            return np.zeros(len(keys), np.int64)
        mixed = (keys ^ np.uint64((tag * _TAG_MIX) & _MASK64)) * _MIX  # wraps mod 2**64 (arrays do not warn)
        return (mixed >> self._shift).astype(np.int64)

    def get(self, tag: int, keys: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(hit bool [n], values float32 [n, width] (rows of misses are zero), found bool [n]) for uint64 keys."""
        n = len(keys)
        values = np.zeros((n, width), np.float32)
        found = np.zeros(n, bool)
        with self._lock:
            self.lookups += n
            if self._values is None or self.width != width or n == 0:
                return np.zeros(n, bool), values, found
            s = self._set_of(keys, tag)
            k2, t2 = self._keys[s], self._tags[s]
            match = (k2 == keys[:, None]) & (t2 == tag)
            hit = match.any(axis=1)
            if hit.any():
                way = match[hit].argmax(axis=1)
                hs = s[hit]
                values[hit] = self._values[hs, way]
                found[hit] = self._found[hs, way]
                self._recent[hs] = way
                self.hits += int(hit.sum())
        return hit, values, found

    def put(self, tag: int, keys: np.ndarray, values: np.ndarray, found: np.ndarray) -> None:
        """Remember the rows cube answered for ``keys`` (unique) of the version ``tag`` stands for."""
        n = len(keys)
        if n == 0:
            return
        width = values.shape[1]
        with self._lock:
            if self._values is None or self.width != width:
                if self._values is not None:  # a version of another row width: start over at that width
                    self._tags[:] = 0
                self.width = width
                self._values = np.zeros((self.sets, 2, width), np.float32)
            s = self._set_of(keys, tag)
            # One key per set per call (two keys of this batch in one set: the first stays), so that
            # every written entry is the key, tag and row of the same input position.
            s_unique, first = np.unique(s, return_index=True)
            way = (1 - self._recent[s_unique]).astype(np.int64)  # the way not used most recently
            self._keys[s_unique, way] = keys[first]
            self._tags[s_unique, way] = tag
            self._found[s_unique, way] = found[first]
            self._values[s_unique, way] = values[first]
            self._recent[s_unique] = way
            self.inserts += len(first)

    def entries(self) -> int:
        with self._lock:
            return int((self._tags != 0).sum())

    def snapshot(self) -> dict:
        with self._lock:
            used = int((self._tags != 0).sum())
            row_bytes = 8 + 8 + 1 + 4 * (self.width or 0)
            return {
                "capacity": self.capacity,
                "entries": used,
                "lookups": self.lookups,
                "hits": self.hits,
                "hit_rate": (self.hits / self.lookups) if self.lookups else None,
                "bytes": self.capacity * row_bytes + self.sets,
            }
