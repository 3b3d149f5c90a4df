"""Dense slots' numbers: extraction (dense_matrix), moments across trainers, standardisation (no Paddle)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ctr_foundation.dense_features import MIN_STD, DenseMoments, DenseNorm, dense_matrix
from ctr_foundation.errors import DataError
from ctr_foundation.sample import parse_sample_line

NAN = float("nan")


def _columns(lines):
    """The value tokens and integer tokens of slot-format lines as dense_matrix takes them, built with the
    per-line reference parser (so this file tests dense_matrix alone, not the batch parser)."""
    vrow, vslot, vals, frow, feas, fslot = [], [], [], [], [], []
    for i, ln in enumerate(lines):
        s = parse_sample_line(ln)
        vrow += [i] * len(s.values)
        vslot += s.value_slots
        vals += s.values
        frow += [i] * len(s.feasigns)
        feas += s.feasigns
        fslot += s.slots
    return (
        np.array(vrow, np.int64),
        np.array(vslot, np.int64),
        np.array(vals, np.float64),
        np.array(frow, np.int64),
        np.array(feas, np.uint64),
        np.array(fslot, np.int64),
    )


def test_dense_matrix_missing_repeated_integer_and_other_slots():
    lines = [
        "1 1 2.5:40 1.0:40 -3:41 9:1",  # two values of slot 40 are summed; 9:1 is a sparse feature
        "1 0 7:42 0.5:9",  # an integer token of a dense slot is its value; slot 9 is not dense
        "1 1 5:1",  # no dense token at all: every dense slot missing
        "1 0 4:41 0.25:41",  # an integer and a value token of one slot are summed too
        "1 1 1.5:42 -1.5:42 0.0:40",  # present values that sum to 0 are 0, not missing
    ]
    vrow, vslot, vals, frow, feas, fslot = _columns(lines)
    dense = (42, 40, 41)  # columns in the order given (slot.conf order), not sorted
    got = dense_matrix(len(lines), dense, vrow, vslot, vals, frow, feas, fslot)
    want = [
        [NAN, 3.5, -3.0],
        [7.0, NAN, NAN],
        [NAN, NAN, NAN],
        [NAN, NAN, 4.25],
        [0.0, 0.0, NAN],
    ]
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, want)
    # Without the integer tokens only the value tokens count.
    values_only = dense_matrix(len(lines), dense, vrow, vslot, vals)
    np.testing.assert_array_equal(values_only[:, 0], [NAN, NAN, NAN, NAN, 0.0])
    np.testing.assert_array_equal(values_only[3], [NAN, NAN, 0.25])


def test_dense_matrix_shapes_without_rows_or_dense_slots():
    vrow, vslot, vals, *_ = _columns(["1 1 2.5:40"])
    assert dense_matrix(1, (), vrow, vslot, vals).shape == (1, 0)
    empty = np.zeros(0, np.int64)
    assert dense_matrix(0, (40, 41), empty, empty, np.zeros(0)).shape == (0, 2)
    np.testing.assert_array_equal(dense_matrix(2, (40,), empty, empty, np.zeros(0)), [[NAN], [NAN]])


def test_moments_norm_mean_std_and_constant_or_unseen_slots():
    raw = np.array(
        [
            [1.0, 5.0, NAN],
            [3.0, 5.0, NAN],
            [NAN, 5.0, NAN],  # missing values are left out of the moments, not counted as 0
            [8.0, 5.0, NAN],
        ]
    )
    m = DenseMoments((40, 41, 42))
    m.add(raw)
    norm = m.norm()
    assert norm.slots == (40, 41, 42)
    np.testing.assert_allclose(norm.mean, [4.0, 5.0, 0.0])
    # population std of the seen values; a constant slot (41) and a slot never seen (42) get std 1
    np.testing.assert_allclose(norm.std, [np.std([1.0, 3.0, 8.0]), 1.0, 1.0])
    assert MIN_STD < norm.std[0]


def test_moments_of_two_trainers_merged_equal_the_moments_of_all_lines():
    rng = np.random.default_rng(5)
    raw = rng.normal([2.0, -7.0, 0.0], [3.0, 0.5, 10.0], size=(1000, 3))
    raw[rng.random(raw.shape) < 0.2] = NAN
    everything = DenseMoments((40, 41, 42))
    for chunk in np.array_split(raw, 7):  # the trainer adds batch after batch
        everything.add(chunk)
    a, b = DenseMoments((40, 41, 42)), DenseMoments((40, 41, 42))
    a.add(raw[:377])
    b.add(raw[377:])
    a.merge(json.loads(json.dumps(b.to_json())))  # trainer 1's moments travel as JSON
    merged, want = a.norm(), everything.norm()
    np.testing.assert_allclose(merged.mean, want.mean, rtol=1e-12)
    np.testing.assert_allclose(merged.std, want.std, rtol=1e-12)
    present = ~np.isnan(raw)
    np.testing.assert_allclose(want.mean, np.nanmean(raw, axis=0), rtol=1e-12)
    np.testing.assert_allclose(want.std, np.nanstd(raw, axis=0), rtol=1e-9)
    assert a.count.tolist() == present.sum(axis=0).tolist()


def test_moments_of_other_slots_do_not_merge():
    other = DenseMoments((40, 43))
    with pytest.raises(DataError, match=r"dense moments of slots \[40, 43\] cannot merge into \[40, 41\]"):
        DenseMoments((40, 41)).merge(other.to_json())


def test_norm_apply_standardises_and_puts_missing_at_zero():
    norm = DenseNorm((40, 41), (1.0, -2.0), (2.0, 0.5))
    got = norm.apply(np.array([[3.0, -2.0], [NAN, -1.0], [1.0, NAN]]))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, [[1.0, 0.0], [0.0, 2.0], [0.0, 0.0]])
    assert DenseNorm.from_json(json.loads(json.dumps(norm.to_json()))) == norm


@pytest.mark.parametrize(
    "obj, message",
    [
        ({"slots": [40], "mean": [0.0]}, r"meta\.json: dense_norm: not a dense normalisation \('std'\)"),
        ({"slots": [40], "mean": ["x"], "std": [1.0]}, r"meta\.json: dense_norm: not a dense normalisation"),
        ({"slots": 40, "mean": [0.0], "std": [1.0]}, r"meta\.json: dense_norm: not a dense normalisation"),
        ({"slots": [40], "mean": [0.0, 1.0], "std": [1.0]}, r"1 slots but 2 means and 1 stds"),
        ({"slots": [40], "mean": [0.0], "std": [0.0]}, r"means and stds must be finite, stds positive"),
        ({"slots": [40], "mean": [NAN], "std": [1.0]}, r"means and stds must be finite, stds positive"),
    ],
)
def test_norm_from_json_errors(obj, message):
    with pytest.raises(DataError, match=message):
        DenseNorm.from_json(obj, "/models/pass-20191221-00/meta.json: dense_norm")


def test_norm_from_json_of_nothing_is_none():
    assert DenseNorm.from_json(None) is None and DenseNorm.from_json({}) is None


def test_moments_keep_the_spread_of_values_large_beside_it():
    # Sums of squares would cancel to 0 here (std 1e8-scale values, spread 0.14): Chan's update keeps it.
    values = 1e8 + np.array([0.0, 0.1, 0.2, 0.3, 0.4])
    one, two = DenseMoments([7]), DenseMoments([7])
    one.add(values[:2, None])
    two.add(values[2:, None])
    one.merge(two.to_json())
    assert one.norm().std[0] == pytest.approx(np.std(values), rel=1e-6)
