"""The compiled answer pass of small batches (cube/lookup_kernel.py) against the numpy passes of large ones."""

from __future__ import annotations

import numpy as np
import pytest

from cube import lookup_kernel
from cube.lookup_index import COMPILED_MAX_KEYS, ShardIndex
from cube.shard_format import ShardData

DIM = 5


def _index(keys: np.ndarray, bucket_bits: int | None = None) -> tuple[ShardIndex, np.ndarray]:
    keys = np.unique(keys)
    values = np.random.default_rng(len(keys)).standard_normal((len(keys), DIM)).astype(np.float32)
    keys.setflags(write=False)  # as read from a shard file
    values.setflags(write=False)
    shard = ShardData(version="v", shard=0, shards=1, dim=DIM, keys=keys, values=values)
    return ShardIndex(shard, bucket_bits=bucket_bits), values


def _queries(keys: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """Batches of present keys, absent keys (neighbours, random, 0 and 2**64-1), the first and last keys
    and duplicates, in sizes around the bitmap's byte boundaries and the compiled pass's limit."""
    keys = np.unique(keys)
    mixed = np.concatenate(
        [
            keys[rng.integers(0, len(keys), 600)],
            keys[:2],
            keys[-2:],
            keys[:50] + np.uint64(1),
            rng.integers(0, 2**64 - 1, 300, dtype=np.uint64, endpoint=True),
            np.array([0, 2**64 - 1], np.uint64),
        ]
    )
    mixed = np.concatenate([mixed, mixed[rng.integers(0, len(mixed), 200)]])  # duplicates
    rng.shuffle(mixed)
    out = [mixed[:n] for n in (1, 7, 8, 9, 26, 64, 1000)]
    out += [keys[:1], keys[-1:], np.repeat(keys[-1:], 17), np.full(3, 2**64 - 1, np.uint64)]
    big = np.resize(mixed, COMPILED_MAX_KEYS)
    return out + [big]


SHARDS = {
    "hashed": lambda rng: rng.integers(1, 2**64 - 1, 20_000, dtype=np.uint64),
    "small keys": lambda rng: np.arange(0, 140_000, 7, dtype=np.uint64),  # feasign % SPARSE_DIM: the clamp
    "extremes": lambda rng: np.array([0, 1, 2**64 - 1], np.uint64),
    "one key": lambda rng: np.array([42], np.uint64),
}


@pytest.mark.parametrize("bucket_bits", [None, 3])  # 3: buckets of thousands of rows (a deep search)
@pytest.mark.parametrize("kind", sorted(SHARDS))
def test_the_compiled_pass_answers_as_the_numpy_passes(kind, bucket_bits):
    rng = np.random.default_rng(7)
    index, values = _index(SHARDS[kind](rng), bucket_bits)
    keys = index.shard.keys
    for query in _queries(keys, rng):
        query = np.frombuffer(query.astype("<u8").tobytes(), "<u8")  # read-only, as a request body gives it
        n = len(query)
        rows, found = index.search_rows(query)  # the numpy passes
        expect_found = np.isin(query, keys)
        np.testing.assert_array_equal(found, expect_found)
        np.testing.assert_array_equal(rows[found].view(np.float32), values[np.searchsorted(keys, query[found])])
        body, misses = index.lookup_body(query)  # the compiled pass
        assert body.dtype == np.uint8 and len(body) == n * 4 * DIM + (n + 7) // 8
        assert body.tobytes() == rows.tobytes() + np.packbits(found, bitorder="little").tobytes()
        assert misses == n - int(found.sum())
        got_rows, got_found = index.lookup_rows(query)
        assert got_rows.shape == rows.shape and got_found.dtype == bool
        np.testing.assert_array_equal(got_rows, rows)
        np.testing.assert_array_equal(got_found, found)


def test_batches_the_compiled_pass_does_not_take_get_the_same_answer():
    rng = np.random.default_rng(3)
    index, _ = _index(SHARDS["hashed"](rng))
    query = _queries(index.shard.keys, rng)[-1]
    body, misses = index.lookup_body(query)
    for other in (
        np.concatenate([query, query[:1]]),  # one key over COMPILED_MAX_KEYS
        np.repeat(query, 2)[::2],  # not contiguous
        query.astype(">u8"),  # big-endian
    ):
        other_body, other_misses = index.lookup_body(other)
        n = len(query)
        rows, found = index.lookup_rows(other)
        assert other_body[: n * 4 * DIM].tobytes() == body[: n * 4 * DIM].tobytes() == rows[:n].tobytes()
        if len(other) == n:
            assert (other_body.tobytes(), other_misses) == (body.tobytes(), misses)
        assert other_misses == len(other) - int(found.sum())


def test_an_empty_shard_or_batch_answers_without_the_kernel():
    index, _ = _index(np.array([], np.uint64))
    body, misses = index.lookup_body(np.array([5, 6], np.uint64))
    assert (body.tobytes(), misses) == (bytes(2 * 4 * DIM + 1), 2)
    index, _ = _index(np.array([5], np.uint64))
    body, misses = index.lookup_body(np.array([], np.uint64))
    assert (len(body), misses) == (0, 0)


def test_the_kernel_refuses_an_answer_buffer_of_the_wrong_size():
    index, _ = _index(np.array([5, 9], np.uint64))
    query = np.array([5, 9, 7], np.uint64)
    args = (query, index._start, index._shift, index._steps, index._keys, index._row_words)
    for size in (3 * 4 * DIM, 3 * 4 * DIM + 2):  # no room for the bitmap; a byte too many
        with pytest.raises(ValueError, match="out must hold"):
            lookup_kernel.gather_answer(*args, np.zeros(size, np.uint8))
    out = np.full(3 * 4 * DIM + 1, 0xAB, np.uint8)
    assert lookup_kernel.gather_answer(*args, out) == 1 and out[-1] == 0b011
