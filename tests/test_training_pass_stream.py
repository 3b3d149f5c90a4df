"""Pure pieces of multi-epoch training: held-out lines, shuffling, epoch plans, key counts, settings."""

from __future__ import annotations

import numpy as np
import pytest

from ctr_foundation.errors import ConfigError
from elastic_control.config.data_config import parse_data_config
from elastic_control.data.line_batch import parse_lines, permute_rows
from elastic_control.training.pass_stream import (
    Holdout,
    KeyCounts,
    ParsedShare,
    batch_bytes,
    pass_batch_size,
    planned_epochs,
    shuffled,
    unjudged_pass,
    without_holdout,
)

BASE = "export START_DATE_HR=20191221/00\nexport END_DATE_HR=20191221/01\nexport DATASET_PATH=/data\n"


def _chunks(n, size):
    lines = [f"1 {i % 2} {100 + i}:1 {200 + i}:2\n" for i in range(n)]
    return [parse_lines(lines[i : i + size])[0] for i in range(0, n, size)]


def _ids(batches):
    return [int(f) - 100 for b in batches for f in b.feasigns[b.feature_slots == 1]]


def test_held_out_lines_are_the_same_in_every_epoch_and_never_trained():
    holdout = Holdout(need=5, stride=4)
    first = _ids(without_holdout(_chunks(50, 7), holdout, first_epoch=True))
    held = _ids(holdout.lines)
    assert held == [3, 7, 11, 15, 19] and holdout.end == 20
    second = _ids(without_holdout(_chunks(50, 9), holdout, first_epoch=False))  # other chunking, same lines
    assert first == second == [i for i in range(50) if i not in held]
    assert _ids(holdout.lines) == held  # collected once


def _share(chunks, budget):
    reads = []

    def read(first):
        reads.append(first)
        yield from chunks

    return ParsedShare(read, budget), reads


def test_a_parsed_share_is_read_once_and_replayed_while_it_fits():
    chunks = _chunks(50, 7)
    share, reads = _share(chunks, budget=10**6)
    assert _ids(share) == _ids(share) == _ids(share) == list(range(50))
    assert reads == [True] and share.reads == 1  # bad lines are counted by the one read that has first=True


def test_a_parsed_share_over_its_budget_is_read_again_each_time_and_counts_bad_lines_once():
    chunks = _chunks(50, 7)
    share, reads = _share(chunks, budget=batch_bytes(chunks[0]) * 3)
    assert _ids(share) == _ids(share) == list(range(50))
    assert reads == [True, False]


def test_a_parsed_share_read_only_in_part_keeps_nothing():
    share, reads = _share(_chunks(50, 7), budget=10**6)
    next(iter(share))  # a read that stopped early (an error downstream) must not become the whole share
    assert _ids(share) == list(range(50)) and reads == [True, False]


def test_shuffle_is_a_permutation_within_windows_with_features_kept_per_line():
    rng = np.random.default_rng(0)
    out = list(shuffled(_chunks(100, 10), 30, rng))
    ids = _ids(out)
    assert sorted(ids) == list(range(100)) and ids != list(range(100))
    assert sorted(ids[:30]) == list(range(30))  # a window mixes only its own lines
    for b in out:  # each line still carries its own features
        for i in range(len(b)):
            f = b.feasigns[b.feature_line == i]
            assert int(f[1]) - int(f[0]) == 100 and b.clicks[i] == (int(f[0]) - 100) % 2
    assert _ids(shuffled(_chunks(20, 10), 0, rng)) == list(range(20))


def test_permute_rows_rebuilds_lines():
    batch, _ = parse_lines(["1 0 5:1 6:2\n", "1 1 7:1\n", "1 0 8:1 9:2 10:3\n"])
    p = permute_rows(batch, np.array([2, 0, 1]))
    assert [p.line_at(i) for i in range(3)] == ["1 0 8:1 9:2 10:3", "1 0 5:1 6:2", "1 1 7:1"]


@pytest.mark.parametrize(
    "setting,steps,want",
    [
        (3, 10, 3),
        ("auto", 31, 32),  # 32.3 epochs' worth
        ("auto", 500, 2),
        ("auto", 400, 3),  # 2.5: rounds up
        ("auto", 700, 1),  # 1.43: a pass a little short of the target trains one epoch, not two
        ("auto", 2000, 1),
        ("auto", 1, 40),
        ("auto", 0, 1),
    ],
)
def test_planned_epochs(setting, steps, want):
    assert planned_epochs(setting, steps, min_steps=1000, max_epochs=40) == want


def test_the_first_pass_of_a_fresh_model_plans_at_least_its_steps():
    # 800 steps at 124 a epoch: 6.45 epochs' worth, so 7 (at least), where the per-pass target rounds
    assert planned_epochs("auto", 124, min_steps=100, first_pass_steps=800, max_epochs=20) == 7
    assert planned_epochs("auto", 124, min_steps=100, max_epochs=20) == 1
    assert planned_epochs("auto", 19, min_steps=100, first_pass_steps=40, max_epochs=20) == 5  # the larger
    assert planned_epochs("auto", 1, min_steps=100, first_pass_steps=800, max_epochs=20) == 20


def test_only_auto_epochs_with_the_early_stop_and_too_few_held_out_lines_go_unjudged():
    assert unjudged_pass("auto", True, 499, 500)
    assert not unjudged_pass("auto", True, 500, 500)
    assert not unjudged_pass("auto", True, 50, 0)  # 0: every pass is judged
    assert not unjudged_pass("auto", False, 50, 500)  # no early stop: nothing to judge
    assert not unjudged_pass(10, True, 50, 500)  # explicit epochs: the user's for the stop to cut


@pytest.mark.parametrize(
    ("share", "batch", "min_batches", "want"),
    [
        (16_652, 128, 128, 128),  # a Criteo-split hour's share: 130 batches of 128, untouched
        (16_383, 128, 128, 127),  # one line short of 128 batches of 128
        (4_000, 128, 128, 31),
        (2_000, 128, 128, 16),  # 15 batches' worth: the floor
        (10, 128, 128, 16),
        (0, 128, 128, 16),  # an empty share (nothing to train): any valid size
        (2_000, 8, 128, 8),  # never above the batch size, even under the floor
        (2_000, 128, 0, 128),  # off
        (100, 1, 128, 1),
    ],
)
def test_a_small_share_trains_smaller_batches(share, batch, min_batches, want):
    assert pass_batch_size(share, batch, min_batches) == want


def test_key_counts_search_a_read_only_array_once_until_their_keys_change():
    counts = KeyCounts()
    counts.add(np.array([5, 9, 9], np.uint64))
    keys = np.array([9, 4, 5], np.uint64)
    keys.flags.writeable = False
    idx, hit = counts.index(keys)
    assert hit.tolist() == [True, False, True] and counts.keys[idx[hit]].tolist() == [9, 5]
    assert counts.index(keys)[0] is idx  # the same read-only array: not searched again
    writable = np.array([9, 4, 5], np.uint64)
    assert counts.index(writable)[0] is not counts.index(writable)[0]  # may change in place: searched each time
    counts.absorb(key_counts_of([4]))
    assert counts.index(keys)[1].tolist() == [True, True, True]  # the keys changed: searched again
    assert counts.lookup(keys).tolist() == [2, 1, 1]


def key_counts_of(keys):
    counts = KeyCounts()
    counts.add(np.array(keys, np.uint64))
    return counts


def test_key_counts_merge_blocks():
    counts = KeyCounts(block=5)
    for keys in ([3, 1, 3], [2**64 - 1, 3], [1], [7, 7, 7, 7]):
        counts.add(np.array(keys, dtype=np.uint64))
    assert counts.distinct.tolist() == [1, 3, 7, 2**64 - 1]  # the last block merged in, sorted
    assert len(counts) == 4
    np.testing.assert_allclose(
        counts.inverse(np.array([3, 1, 2**64 - 1, 7, 99], dtype=np.uint64)), [1 / 3, 1 / 2, 1, 1 / 4, 1]
    )


def test_data_config_model_epochs_early_stop():
    cfg = parse_data_config(BASE + 'export MODEL="wide_deep"\nexport EPOCHS=auto\nexport EARLY_STOP=1\n', env={})
    assert (cfg.model, cfg.epochs, cfg.early_stop) == ("wide_deep", "auto", True)
    cfg = parse_data_config(BASE + "export EPOCHS=3\n", env={})
    assert (cfg.model, cfg.epochs, cfg.early_stop) == (None, 3, None)
    with pytest.raises(ConfigError, match="did you mean 'deepfm'"):
        parse_data_config(BASE + "export MODEL=deepFM\n", env={})
    with pytest.raises(ConfigError, match="EPOCHS='0' must be 'auto' or a whole number"):
        parse_data_config(BASE + "export EPOCHS=0\n", env={})
    with pytest.raises(ConfigError, match="EARLY_STOP"):
        parse_data_config(BASE + "export EARLY_STOP=maybe\n", env={})
