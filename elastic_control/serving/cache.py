"""A bounded hot-key embedding cache inside serving, keyed by (cube version, key).

Feasigns are Zipf-distributed: a small set of keys makes most lookups, so most of them never need
to leave the process. ``EmbeddingCaches`` holds one ``VersionCache`` per version serving uses (the
active one, pinned challengers, and the previous one while batches still finish on it); a version's
cache is created with it and dropped with it, so an entry can only ever answer for its own version,
and every batch reads one version's cache and looks its misses up in cube pinned to that version:
a batch never mixes cached rows of one version with looked-up rows of another. A version's content
never changes (cube versions are immutable), so entries need no invalidation. Cube's misses are
cached too (zero rows, found = False), so coverage metrics stay exact.

A VersionCache is an 8-way set-associative table in flat numpy arrays (whole batches at once: a read of
thousands of keys is one compiled pass, cache_kernel.py; an insert a dozen numpy calls): each key maps to
one set of eight ways, whose eight keys are one 64-byte cache line; an insert replaces the way filled
longest ago. Eight ways, not two: a request carries about 1,250 keys (32 Criteo lines), so the rare set
that holds more hot keys than ways makes most requests miss and wait for cube. With 2 ways and 2^20
entries, 78,000 distinct keys (4% of the capacity) left 70% of the benchmark's requests with a miss on
every pass over them; with 8 ways, none. Memory is fixed when it is created: ``entries`` rows of (key,
found, row of floats). Unused ways hold a key that hashes to another set, so no real key can match them.
"""

from __future__ import annotations

import threading

import numpy as np

from elastic_control.serving.cache_kernel import gather_cached

_MIX = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio: multiplicative hashing


class VersionCache:
    WAYS = 8  # 8 uint64 keys: one 64-byte cache line per set

    def __init__(self, entries: int, width: int):
        ways = self.WAYS
        sets = 1 << max(1, (max(entries, 2 * ways) // ways).bit_length() - 1)  # a power of two, ways * sets <= entries
        self.sets, self.capacity, self.width = sets, ways * sets, width
        self._shift = np.uint64(64 - (sets.bit_length() - 1))
        self._keys = _aligned_keys(sets, ways)
        # unused ways: a key that hashes to another set (sentinel a everywhere, b in a's own set)
        a, b = np.uint64(0), np.uint64(1)
        while self._set_of(np.array([a]))[0] == self._set_of(np.array([b]))[0]:
            b += np.uint64(1)
        self._keys[:] = a
        self._keys[int(self._set_of(np.array([a]))[0])] = b
        self._found = np.zeros(ways * sets, bool)
        self._values = np.zeros((ways * sets, width), np.float32)
        self._next = np.zeros(sets, np.int64)  # per set: the way to fill next (filled longest ago)
        self._used = np.zeros(ways * sets, bool)
        self._lock = threading.Lock()
        self.filled = 0

    def _set_of(self, keys: np.ndarray) -> np.ndarray:
        return ((keys * _MIX) >> self._shift).astype(np.int64)  # uint64 multiply wraps mod 2**64

    def get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(hit bool [n], rows float32 [n, width] (zeros where not hit), found bool [n]) for uint64 keys: one
        compiled pass without the GIL (cache_kernel.py)."""
        keys = np.ascontiguousarray(keys, dtype=np.uint64)
        n = len(keys)
        hit, rows, found = np.empty(n, bool), np.empty((n, self.width), np.float32), np.empty(n, bool)
        with self._lock:  # a put meanwhile would tear a way's key from its row
            gather_cached(keys, self._keys, self._found, self._values, _MIX, self._shift, hit, rows, found)
        return hit, rows, found

    def put(self, keys: np.ndarray, values: np.ndarray, found: np.ndarray) -> None:
        """Remember the rows cube answered for ``keys`` (unique)."""
        ways = self.WAYS
        sets = self._set_of(keys)
        # at most `ways` keys per set per call: rank keys within their set, keep the first `ways`
        order = np.argsort(sets, kind="stable")
        ss = sets[order]
        starts = np.r_[0, np.flatnonzero(ss[1:] != ss[:-1]) + 1]
        counts = np.diff(np.r_[starts, len(ss)])
        rank = np.arange(len(ss)) - np.repeat(starts, counts)
        keep = rank < ways
        pick, s, rank = order[keep], ss[keep], rank[keep]
        first = ss[starts]  # each set once
        with self._lock:
            at = s * ways + (self._next[s] + rank) % ways  # from the way filled longest ago, round the set
            self.filled += int(np.count_nonzero(~self._used[at]))
            self._used[at] = True
            self._keys.reshape(-1)[at] = keys[pick]
            self._found[at] = found[pick]
            self._values[at] = values[pick]
            self._next[first] = (self._next[first] + np.minimum(counts, ways)) % ways

    @property
    def bytes(self) -> int:
        return self._keys.nbytes + self._found.nbytes + self._values.nbytes + self._next.nbytes + self._used.nbytes


def _aligned_keys(sets: int, ways: int) -> np.ndarray:
    """A zeroed uint64 [sets, ways] whose rows start on 64-byte boundaries (a set is one cache line)."""
    raw = np.zeros(sets * ways + 8, np.uint64)
    skip = (-raw.ctypes.data % 64) // 8
    return raw[skip : skip + sets * ways].reshape(sets, ways)


class EmbeddingCaches:
    """One VersionCache per live version (``entries`` rows each), and the counters /metrics shows."""

    def __init__(self, entries: int):
        if entries < 2 * VersionCache.WAYS:
            raise ValueError(f"the cache needs at least {2 * VersionCache.WAYS} entries (or 0 to disable it)")
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
