"""A bounded hot-key embedding cache inside serving, keyed by (cube version, key).

Feasigns are Zipf-distributed: a small set of keys makes most lookups, so most of them never need
to leave the process. ``EmbeddingCaches`` holds one ``VersionCache`` per version serving uses (the
active one, pinned challengers, and the previous one while batches still finish on it); a version's
cache is created with it and dropped with it, so an entry can only ever answer for its own version,
and every batch reads one version's cache and looks its misses up in cube pinned to that version:
a batch never mixes cached rows of one version with looked-up rows of another. A version's content
never changes (cube versions are immutable), so entries need no invalidation. Cube's misses are
cached too (zero rows, found = False), so coverage metrics stay exact.

A VersionCache is a 2-way set-associative table in flat numpy arrays (vectorised for whole batches:
a lookup of thousands of keys is about a dozen numpy calls, no Python loop per key): each key maps to
one set of two ways; an insert replaces the way filled less recently. Memory is fixed when it is
created: ``entries`` rows of (key, found, row of floats). Unused ways hold a key that hashes to
another set, so no real key can match them.
"""

from __future__ import annotations

import threading

import numpy as np

_MIX = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio: multiplicative hashing


class VersionCache:
    def __init__(self, entries: int, width: int):
        sets = 1 << max(1, (max(entries, 4) // 2).bit_length() - 1)  # a power of two >= 2, 2 * sets <= entries
        self.sets, self.capacity, self.width = sets, 2 * sets, width
        self._shift = np.uint64(64 - (sets.bit_length() - 1))
        self._keys = np.empty(2 * sets, np.uint64)
        # unused ways: a key that hashes to another set (sentinel a everywhere, b in a's own set)
        a, b = np.uint64(0), np.uint64(1)
        while self._set_of(np.array([a]))[0] == self._set_of(np.array([b]))[0]:
            b += np.uint64(1)
        self._keys[:] = a
        sa = int(self._set_of(np.array([a]))[0])
        self._keys[2 * sa : 2 * sa + 2] = b
        self._found = np.zeros(2 * sets, bool)
        self._values = np.zeros((2 * sets, width), np.float32)
        self._older = np.zeros(sets, np.int64)  # per set: the way to fill next (0 or 1)
        self._used = np.zeros(2 * sets, bool)
        self._lock = threading.Lock()
        self.filled = 0

    def _set_of(self, keys: np.ndarray) -> np.ndarray:
        return ((keys * _MIX) >> self._shift).astype(np.int64)  # uint64 multiply wraps mod 2**64

    def get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(hit bool [n], rows float32 [n, width] (garbage where not hit), found bool [n]) for uint64 keys."""
        way0 = self._set_of(keys) * 2
        with self._lock:
            m1 = self._keys.take(way0 + 1) == keys
            hit = m1 | (self._keys.take(way0) == keys)
            at = way0 + m1
            values = self._values.take(at, axis=0)
            found = self._found.take(at)
        return hit, values, found

    def put(self, keys: np.ndarray, values: np.ndarray, found: np.ndarray) -> None:
        """Remember the rows cube answered for ``keys`` (unique)."""
        sets = self._set_of(keys)
        # at most two keys per set per call (one per way): rank keys within their set, keep ranks 0 and 1
        order = np.argsort(sets, kind="stable")
        ss = sets[order]
        starts = np.r_[0, np.flatnonzero(ss[1:] != ss[:-1]) + 1]
        rank = np.arange(len(ss)) - np.repeat(starts, np.diff(np.r_[starts, len(ss)]))
        keep = rank < 2
        pick, s, rank = order[keep], ss[keep], rank[keep]
        with self._lock:
            older = self._older[s]
            way = np.where(rank == 0, older, 1 - older)
            at = 2 * s + way
            self.filled += int(np.count_nonzero(~self._used[at]))
            self._used[at] = True
            self._keys[at] = keys[pick]
            self._found[at] = found[pick]
            self._values[at] = values[pick]
            # the way filled last is the newer one: the next insert replaces the other
            self._older[s] = 1 - way

    @property
    def bytes(self) -> int:
        return self._keys.nbytes + self._found.nbytes + self._values.nbytes + self._older.nbytes


class EmbeddingCaches:
    """One VersionCache per live version (``entries`` rows each), and the counters /metrics shows."""

    def __init__(self, entries: int):
        if entries < 4:
            raise ValueError("the cache needs at least 4 entries (or 0 to disable it)")
        self.entries = entries
        self._by_version: dict[tuple[str, int], VersionCache] = {}
        self._lock = threading.Lock()
        self.lookups = 0
        self.hits = 0

    def for_version(self, version) -> VersionCache | None:
        """The cache of a LoadedVersion, created on first use; None once the version is retired (a batch
        still in flight with it goes without: a cache created now would never be dropped)."""
        key = (version.version, version.load_id)
        c = self._by_version.get(key)
        if c is None:
            with self._lock:
                c = self._by_version.get(key)
                if c is None and not version.retired:
                    c = self._by_version[key] = VersionCache(self.entries, version.width)
        return c

    def drop(self, version) -> None:
        """Forget a retired LoadedVersion's cache (``retired`` is set first, so it is not created again)."""
        with self._lock:
            self._by_version.pop((version.version, version.load_id), None)

    def count(self, lookups: int, hits: int) -> None:
        with self._lock:
            self.lookups += lookups
            self.hits += hits

    def snapshot(self) -> dict:
        with self._lock:
            caches = dict(self._by_version)
            lookups, hits = self.lookups, self.hits
        return {
            "entries_per_version": self.entries,
            "versions": sorted({v for v, _ in caches}),
            "capacity": sum(c.capacity for c in caches.values()),
            "entries": sum(c.filled for c in caches.values()),
            "bytes": sum(c.bytes for c in caches.values()),
            "lookups": lookups,
            "hits": hits,
            "hit_rate": (hits / lookups) if lookups else None,
        }
