"""The training net's input layout: every slot's keys in one LoD tensor, slot after slot, and the pooled rows
reshaped into the dense part's input (each line's slots side by side, slot.conf order)."""

from __future__ import annotations

import pyarrow  # noqa: F401  (before paddle)

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

from elastic_control.training.feeding import feed_keys  # noqa: E402
from elastic_control.training.model import (  # noqa: E402
    KEY_ANCHOR_INPUT,
    KEY_ANCHOR_WEIGHT_INPUT,
    KEY_L2_INPUT,
    KEY_RATE_INPUT,
    KEYS_INPUT,
    LABEL_INPUT,
    pooled_by_line,
)

# Two slots, three lines, slot after slot: slot 1's lines have 2, 1, 1 keys; slot 2's 1, 3, 1.
KEYS = np.array([11, 12, 13, 14, 21, 22, 23, 24, 25], np.uint64)
LENGTHS = np.array([2, 1, 1, 1, 3, 1], np.int64)


def test_the_feed_is_one_keys_tensor_slot_after_slot_with_per_key_arrays_in_its_order():
    labels = np.zeros((3, 1), np.float32)
    feed = feed_keys(
        paddle,
        KEYS,
        LENGTHS,
        labels,
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


def test_per_key_inputs_of_repeated_keys_equal_each_occurrences_own_lookup():
    # feed_keys searches each distinct key once and expands; the result must be each occurrence's own
    # value, in the keys' order, however often and wherever a key repeats.
    from elastic_control.training.pass_stream import KeyCounts
    from elastic_control.training.rate_decay import RateDecay

    rng = np.random.default_rng(3)
    keys = rng.choice(np.array([7, 2**63 + 5, 40, 2**64 - 1, 13], np.uint64), size=200)
    counts = KeyCounts()
    counts.add(keys[:120])
    decay = RateDecay(decay_sightings=4.0, trainers=2)
    decay.start_epoch(counts, share_lines=50)
    decay.fed(20)
    feed = feed_keys(
        paddle,
        keys,
        np.array([200], np.int64),
        None,
        paddle.CPUPlace(),
        l2_scale=counts.inverse,
        rate_factors=decay.factors,
    )
    want_l2 = np.array([counts.inverse(np.array([k]))[0] for k in keys], np.float32)
    want_rate = np.array([decay.factors(np.array([k]))[0] for k in keys], np.float32)
    np.testing.assert_array_equal(feed[KEY_L2_INPUT].ravel(), want_l2)
    np.testing.assert_array_equal(feed[KEY_RATE_INPUT].ravel(), want_rate)
    assert len(set(want_l2.tolist())) > 1  # the keys' values differ, so a misplaced one would show


def test_the_defaults_per_key_inputs_share_one_search_of_the_pass_keys(monkeypatch):
    # The L2 scale, the rate factors and the wide prior's anchor and weight are all found in the pass's
    # counts: one search a batch (KeyCounts.index), whatever the trainer saw in earlier passes, and the
    # values are each occurrence's own.
    from elastic_control.training import pass_stream
    from elastic_control.training.pass_stream import KeyCounts
    from elastic_control.training.rate_decay import RateDecay
    from elastic_control.training.wide_prior import WidePrior

    earlier, counts = KeyCounts(), KeyCounts()
    earlier.add(np.array([7, 40, 999], np.uint64))
    keys = np.array([7, 40, 13, 7, 2**64 - 1, 40, 7], np.uint64)
    counts.add(keys)
    decay, prior = RateDecay(decay_sightings=4.0, trainers=2), WidePrior(strength=0.1, l2_wide=5.0)
    decay.seen.absorb(earlier)
    prior.seen.absorb(earlier)
    assert prior.start_pass(counts, lambda k: k.astype(np.float32) / 100) == 2  # 7 and 40 seen before
    decay.start_epoch(counts, share_lines=7)
    decay.fed(3)
    searches = []
    real = np.searchsorted
    monkeypatch.setattr(pass_stream.np, "searchsorted", lambda *a, **k: searches.append(1) or real(*a, **k))
    feed = feed_keys(
        paddle,
        keys,
        np.array([len(keys)], np.int64),
        None,
        paddle.CPUPlace(),
        l2_scale=counts.inverse,
        rate_factors=decay.factors,
        wide_prior=prior,
    )
    assert len(searches) == 1
    monkeypatch.undo()
    np.testing.assert_allclose(feed[KEY_L2_INPUT].ravel(), [1 / 3, 1 / 2, 1, 1 / 3, 1, 1 / 2, 1 / 3], rtol=1e-6)
    own = {7: 1 + 3 * 3 / 7, 40: 1 + 2 * 3 / 7, 13: 3 / 7, 2**64 - 1: 3 / 7}  # earlier + progress x this pass
    want = [1 / np.sqrt(1 + own[int(k)] * 2 / 4.0) for k in keys]
    np.testing.assert_allclose(feed[KEY_RATE_INPUT].ravel(), want, rtol=1e-6)
    np.testing.assert_allclose(feed[KEY_ANCHOR_INPUT].ravel(), [0.07, 0.4, 0, 0.07, 0, 0.4, 0.07], rtol=1e-6)
    np.testing.assert_allclose(feed[KEY_ANCHOR_WEIGHT_INPUT].ravel(), [5.1, 5.1, 5, 5.1, 5, 5.1, 5.1], rtol=1e-6)


def test_a_lookup_feed_carries_no_labels():
    feed = feed_keys(paddle, KEYS, LENGTHS, None, paddle.CPUPlace())
    assert set(feed) == {KEYS_INPUT}


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
