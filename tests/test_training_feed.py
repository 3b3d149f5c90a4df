"""The training net's input layout: every slot's keys in one LoD tensor, slot after slot, and the pooled rows
reshaped into the dense part's input (each line's slots side by side, slot.conf order)."""

from __future__ import annotations

import pyarrow  # noqa: F401  (before paddle)

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

from elastic_control.training.feeding import feed_slot_keys  # noqa: E402
from elastic_control.training.model import (  # noqa: E402
    KEY_L2_INPUT,
    KEY_RATE_INPUT,
    KEYS_INPUT,
    LABEL_INPUT,
    pooled_by_line,
)

# Two slots, three lines: slot 1's lines have 2, 1, 1 keys; slot 2's 1, 3, 1.
PER_SLOT = [
    (np.array([11, 12, 13, 14], np.uint64), np.array([2, 1, 1], np.int64)),
    (np.array([21, 22, 23, 24, 25], np.uint64), np.array([1, 3, 1], np.int64)),
]


def test_the_feed_is_one_keys_tensor_slot_after_slot_with_per_key_arrays_in_its_order():
    labels = np.zeros((3, 1), np.float32)
    feed = feed_slot_keys(
        paddle,
        PER_SLOT,
        labels,
        (1, 2),
        paddle.CPUPlace(),
        l2_scale=lambda keys: 1.0 / keys.astype(np.float64),
        rate_factors=lambda keys: keys.astype(np.float32) % 10,
    )
    keys = feed[KEYS_INPUT]
    assert np.array(keys).ravel().tolist() == [11, 12, 13, 14, 21, 22, 23, 24, 25]
    assert keys.recursive_sequence_lengths() == [[2, 1, 1, 1, 3, 1]]
    assert feed[KEY_RATE_INPUT].ravel().tolist() == [1, 2, 3, 4, 1, 2, 3, 4, 5]
    assert feed[KEY_L2_INPUT].shape == (9, 1) and feed[KEY_L2_INPUT].dtype == np.float32
    assert feed[LABEL_INPUT] is labels


def test_a_feed_needs_keys_for_every_slot():
    with pytest.raises(ValueError, match="2 slots of keys for 3 slots"):
        feed_slot_keys(paddle, PER_SLOT, np.zeros((3, 1), np.float32), (1, 2, 3), paddle.CPUPlace())


def test_pooled_rows_become_each_lines_slots_side_by_side():
    dim = 2
    lengths = [2, 1, 1, 1, 3, 1]
    rows = np.arange(9 * dim, dtype=np.float32).reshape(9, dim)
    # The reference: per slot, per line, the sum of its rows; then each line's slots concatenated.
    ends = np.cumsum(lengths)
    sums = [rows[e - n : e].sum(axis=0) for n, e in zip(lengths, ends, strict=True)]
    want = np.stack([np.concatenate([sums[line], sums[3 + line]]) for line in range(3)])

    paddle.enable_static()
    try:
        main, startup = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main, startup):
            x = paddle.static.data(name="rows", shape=[-1, dim], dtype="float32", lod_level=1)
            out = pooled_by_line(paddle, x, 2, dim)
        t = paddle.base.core.LoDTensor()
        t.set(rows, paddle.CPUPlace())
        t.set_recursive_sequence_lengths([lengths])
        (got,) = paddle.static.Executor(paddle.CPUPlace()).run(main, feed={"rows": t}, fetch_list=[out])
    finally:
        paddle.disable_static()
    np.testing.assert_array_equal(got, want)
