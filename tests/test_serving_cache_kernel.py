"""The hot-key cache's compiled read (elastic_control/serving/cache_kernel.py) against the numpy read it
replaced, on the same tables: random keys, misses, duplicates, the extremes of the key range, sets that
are full, batch sizes around nothing and one key."""

from __future__ import annotations

import numpy as np
import pytest

from elastic_control.serving.cache import _MIX, VersionCache
from elastic_control.serving.cache_kernel import gather_cached

WIDTH = 5


def _numpy_read(cache: VersionCache, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The vectorised read VersionCache.get made before the kernel: take every key's set, compare it with the
    key; a hit's 8 match flags, read as one little-endian uint64, are 1 << (8 * way)."""
    sets = cache._set_of(keys)
    match = cache._keys.take(sets, axis=0) == keys[:, None]
    bits = match.view("<u8").reshape(-1)
    hit = bits != 0
    at = sets * cache.WAYS + ((np.frexp(bits)[1] - 1) >> 3).clip(0)
    return hit, cache._values.take(at, axis=0), cache._found.take(at)


def _filled(entries: int, keys: np.ndarray, rng: np.random.Generator) -> VersionCache:
    cache = VersionCache(entries, WIDTH)
    for chunk in np.array_split(keys, 4):  # several puts: the ways of a set are filled and overwritten in turn
        values = rng.standard_normal((len(chunk), WIDTH)).astype(np.float32)
        cache.put(chunk, values, rng.random(len(chunk)) < 0.7)
    return cache


def _queries(given: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    mixed = np.concatenate(
        [
            given[rng.integers(0, len(given), 700)],
            given[:1] + np.uint64(1),  # a neighbour of a given key
            rng.integers(0, 2**64 - 1, 300, dtype=np.uint64, endpoint=True),  # never given
            np.array([0, 1, 2**63, 2**64 - 1], np.uint64),
        ]
    )
    mixed = np.concatenate([mixed, mixed[rng.integers(0, len(mixed), 300)]])  # duplicates
    rng.shuffle(mixed)
    return [mixed[:n] for n in (0, 1, 7, 64, len(mixed))] + [np.repeat(given[-1:], 9)]


KEYS = {
    "hashed": lambda rng: np.unique(rng.integers(0, 2**64 - 1, 6000, dtype=np.uint64, endpoint=True)),
    "small keys": lambda rng: np.arange(0, 42_000, 7, dtype=np.uint64),  # feasign % sparse_dim
    "extremes": lambda rng: np.array([0, 1, 2**63, 2**64 - 2, 2**64 - 1], np.uint64),
}


@pytest.mark.parametrize("entries", [16, 1024, 1 << 14])  # 16: two sets, every one overfull
@pytest.mark.parametrize("kind", sorted(KEYS))
def test_the_compiled_read_answers_as_the_numpy_read(kind, entries):
    rng = np.random.default_rng(11)
    given = KEYS[kind](rng)
    cache = _filled(entries, given, rng)
    for query in _queries(given, rng):
        hit, rows, found = cache.get(query)
        want_hit, want_rows, want_found = _numpy_read(cache, query)
        np.testing.assert_array_equal(hit, want_hit)
        np.testing.assert_array_equal(rows[hit], want_rows[want_hit])
        np.testing.assert_array_equal(found[hit], want_found[want_hit])
        assert not rows[~hit].any() and not found[~hit].any(), "a miss is a zero row, not found"
        assert rows.dtype == np.float32 and rows.shape == (len(query), WIDTH)
    assert 0 < cache.get(given)[0].sum() <= cache.capacity


def test_every_key_of_a_set_is_found_in_its_own_way():
    """Nine keys of one set, one put each: the kernel finds each of the last eight in the way it went to
    (its own row, however the ways were filled) and the first one, evicted, nowhere."""
    cache = VersionCache(1024, WIDTH)
    candidates = np.arange(1, 200_000, dtype=np.uint64)
    sets = cache._set_of(candidates)
    same = candidates[sets == sets[0]][:9]
    for i, key in enumerate(same):
        cache.put(np.array([key]), np.full((1, WIDTH), i, np.float32), np.array([i % 2 == 0]))
    hit, rows, found = cache.get(same[::-1].copy())
    assert hit.tolist() == [True] * 8 + [False]
    assert rows[:, 0].tolist() == [8, 7, 6, 5, 4, 3, 2, 1, 0]  # the evicted key's row is zeros
    assert found.tolist() == [True, False, True, False, True, False, True, False, False]


def test_the_kernel_counts_its_hits_and_refuses_outputs_of_the_wrong_shape():
    rng = np.random.default_rng(3)
    given = KEYS["hashed"](rng)
    cache = _filled(1024, given, rng)
    n = len(given)
    hit, rows, found = np.empty(n, bool), np.empty((n, WIDTH), np.float32), np.empty(n, bool)
    hits = gather_cached(given, cache._keys, cache._found, cache._values, _MIX, cache._shift, hit, rows, found)
    assert hits == hit.sum() == cache.filled  # every way holds one of the given keys
    with pytest.raises(ValueError, match="outputs"):
        gather_cached(given, cache._keys, cache._found, cache._values, _MIX, cache._shift, hit, rows[:-1], found)
    with pytest.raises(ValueError, match="shift"):  # a shift that maps keys past the last set
        gather_cached(
            given, cache._keys, cache._found, cache._values, _MIX, cache._shift - np.uint64(1), hit, rows, found
        )
