"""scoring.key_batch's compiled pass for batches of one key a cell (elastic_control/inference/key_kernel.py)
against its numpy passes (``_sorted_key_batch``, which handle every batch): the same keys, cells and starts
on random batches with empty cells, unknown and negative slots, cells of two keys, rows out of order."""

from __future__ import annotations

import numpy as np
import pytest

from ctr_foundation.sample import PADDING_FEASIGN
from elastic_control.inference import scoring
from elastic_control.inference.key_kernel import one_key_cells

SLOTS = [7, 3, 11, 40, 2]


def _features(rng: np.random.Generator, n: int, *, doubles: bool, unknown: bool, shuffled: bool):
    """Each row's features: a random subset of SLOTS (in random order) with one feasign each; optionally a
    second feature in some cell, features of slots outside SLOTS, and rows out of order."""
    rows, slots = [], []
    for r in range(n):
        chosen = rng.permutation(SLOTS)[: rng.integers(0, len(SLOTS) + 1)].tolist()
        if doubles and chosen and rng.random() < 0.3:
            chosen.append(chosen[0])
        if unknown and rng.random() < 0.5:
            chosen.append(int(rng.choice([1, 5, 99, 1 << 30])))
        rows += [r] * len(chosen)
        slots += chosen
    rows, slots = np.array(rows, np.int64), np.array(slots, np.int64)
    feasigns = rng.integers(0, 2**64, len(rows), dtype=np.uint64, endpoint=False)
    if shuffled:
        order = rng.permutation(len(rows))
        rows, slots, feasigns = rows[order], slots[order], feasigns[order]
    return rows, feasigns, slots


def _numpy(rows, feasigns, slots, n, sparse_dim):
    return scoring._sorted_key_batch(rows, feasigns, slots, n, np.array(SLOTS, np.int64), sparse_dim, None)


@pytest.mark.parametrize("sparse_dim", [None, 1000, 2**63 + 5])
@pytest.mark.parametrize("doubles", [False, True])
@pytest.mark.parametrize("unknown", [False, True])
@pytest.mark.parametrize("shuffled", [False, True])
def test_key_batch_is_the_numpy_passes_answer(sparse_dim, doubles, unknown, shuffled):
    rng = np.random.default_rng([int(sparse_dim or 0) % 2**32, doubles, unknown, shuffled])
    for n in (0, 1, 2, 37, 500):
        rows, feasigns, slots = _features(rng, n, doubles=doubles, unknown=unknown, shuffled=shuffled)
        got = scoring.key_batch(rows, feasigns, slots, n, SLOTS, sparse_dim)
        want = _numpy(rows, feasigns, slots, n, sparse_dim)
        np.testing.assert_array_equal(got.keys, want.keys)
        np.testing.assert_array_equal(got.cells, want.cells)
        assert (got.cell_starts is None) == (want.cell_starts is None)
        if want.cell_starts is not None:
            np.testing.assert_array_equal(got.cell_starts, want.cell_starts)
        assert (got.n, got.num_slots) == (n, len(SLOTS))


def _run(rows, feasigns, slots, n, sparse_dim=0):
    table = scoring._slot_table(tuple(SLOTS))
    keys, cells = np.empty(n * len(SLOTS), np.uint64), np.empty(n * len(SLOTS), np.int64)
    ok = one_key_cells(rows, feasigns, slots, table, n, np.uint64(sparse_dim), keys, cells)
    return ok, keys, cells


def test_the_kernel_places_each_key_in_its_cell_and_pads_the_rest():
    rows = np.array([1, 0, 1], np.int64)
    slots = np.array([2, 11, 7], np.int64)  # positions 4, 2, 0
    ok, keys, cells = _run(rows, np.array([21, 5, 1007], np.uint64), slots, 2, sparse_dim=1000)
    assert ok and cells.tolist() == list(range(10))
    pad = PADDING_FEASIGN % 1000
    assert keys.tolist() == [pad, pad, 5, pad, pad, 7, pad, pad, pad, 21]


@pytest.mark.parametrize(
    "rows, slots",
    [
        ([0, 0], [3, 3]),  # two keys in one cell
        ([0, 1], [3, -4]),  # a negative slot
        ([0, 2], [3, 7]),  # a row outside the batch
        ([-1], [3]),
    ],
)
def test_the_kernel_declines_what_the_numpy_passes_must_handle(rows, slots):
    rows, slots = np.array(rows, np.int64), np.array(slots, np.int64)
    ok, _, _ = _run(rows, np.arange(len(rows), dtype=np.uint64), slots, 2)
    assert not ok
