"""Serving's parts on their own: request parsing, the one KeyBatch builder, the cache, A/B routing, the
prediction log and the live monitor (no model, no servers)."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np
import pytest
from helpers_serving import criteo_slot_lines, slots_instance
from sklearn.metrics import log_loss, roc_auc_score

from ctr_foundation.sample import PADDING_FEASIGN, parse_sample_line, slot_keys
from elastic_control.data.line_batch import parse_lines
from elastic_control.inference.scoring import InMemoryTable, batch_from_lines, concat_key_batches, pool
from elastic_control.inference.scoring import line_key_batch as line_batch_key_batch
from elastic_control.serving.arms import Arm, SplitError, make_split, route_point, split_from_flag, split_from_json
from elastic_control.serving.cache import EmbeddingCaches, VersionCache
from elastic_control.serving.feedback import PredictionLog
from elastic_control.serving.instances import (
    InstanceError,
    TooManyInstances,
    UnparsedLines,
    build_key_batch,
    concat_parsed,
    decode_json,
    parse_instances,
    parse_lines_strict,
    parse_parts,
    parsed_lines,
    predict_request,
    slice_parsed,
)
from elastic_control.serving.monitor import AlertRules, Monitor
from elastic_control.serving.versions import LoadedVersion

SLOTS = list(range(1, 40))
DENSE_SLOTS = list(range(40, 53))  # Criteo's I1-I13 as numbers, as `elastic-control data criteo` writes them


# ---- the one KeyBatch builder ----------------------------------------------------------------


def reference_pooled(lines, slots, sparse_dim, table):
    """Per line, per slot: sum of the key vectors, from the per-line reference parser (sample.py)."""
    rows = []
    for ln in lines:
        per_slot = slot_keys(parse_sample_line(ln), tuple(slots), sparse_dim)
        rows.append(np.concatenate([table.lookup(k)[0].sum(axis=0) for k in per_slot]))
    return np.stack(rows)


def reference_dense(lines, dense_slots):
    """Per line, per dense slot: the sum of its numbers (value tokens, and integer tokens of that slot), NaN
    without any: the rule of ctr_foundation/dense_features.py, line by line from the reference parser."""
    out = np.full((len(lines), len(dense_slots)), np.nan)
    for i, ln in enumerate(lines):
        s = parse_sample_line(ln)
        for v, slot in [*zip(s.values, s.value_slots, strict=True), *zip(s.feasigns, s.slots, strict=True)]:
            if slot in dense_slots:
                j = dense_slots.index(slot)
                out[i, j] = (0.0 if np.isnan(out[i, j]) else out[i, j]) + float(v)
    return out


@pytest.mark.parametrize("sparse_dim", [None, 1000003])
def test_every_builder_pools_like_the_per_line_reference(sparse_dim):
    criteo = criteo_slot_lines(0, 150)  # with Criteo's dense values: value tokens, and '0:40' integer ones
    assert any(":" in t and not t.split(":")[0].isdigit() for t in criteo[0].split()[2:])
    lines = criteo + [
        "1 0",
        "1 1 5:1 6:1 7:99 8:1",
        "0 1 3:2 4:2 5:2",
        # several numbers of one dense slot are summed; a value token of a sparse slot (2) is ignored
        "1 0 5:1 2.5:40 7:41 -1.5:41 +3:42 1e-3:43 .5:44 3.5:2 4.:45",
    ]
    rng = np.random.default_rng(0)
    keys = np.unique(np.concatenate([k for ln in lines for k in slot_keys(parse_sample_line(ln), SLOTS, sparse_dim)]))
    table = InMemoryTable(keys, rng.normal(size=(len(keys), 9)).astype(np.float32))
    want = reference_pooled(lines, SLOTS, sparse_dim, table)
    want_dense = reference_dense(lines, DENSE_SLOTS)
    mixed = [{"line": ln} if i % 2 else slots_instance(ln) for i, ln in enumerate(criteo)]
    batches = {
        "lines": (batch_from_lines(lines, SLOTS, sparse_dim, DENSE_SLOTS), slice(None)),
        "serving instances": (
            build_key_batch([{"line": ln} for ln in lines], SLOTS, sparse_dim, DENSE_SLOTS),
            slice(None),
        ),
        "evaluation LineBatch": (
            line_batch_key_batch(parse_lines(lines)[0], SLOTS, sparse_dim, DENSE_SLOTS),
            slice(None),
        ),
        "serving slots form": (
            build_key_batch([slots_instance(ln) for ln in criteo], SLOTS, sparse_dim, DENSE_SLOTS),
            slice(len(criteo)),
        ),
        "serving mixed forms": (build_key_batch(mixed, SLOTS, sparse_dim, DENSE_SLOTS), slice(len(criteo))),
    }
    for name, (kb, rows) in batches.items():
        got = pool(kb, table.lookup(kb.keys)[0])
        np.testing.assert_allclose(got, want[rows], rtol=0, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(kb.dense, want_dense[rows], rtol=1e-12, atol=0, err_msg=name)
        cells = kb.rows * kb.num_slots + kb.slot_pos
        assert (np.diff(cells) >= 0).all(), f"{name}: keys are sorted by (row, slot)"
    # without dense slots (a pass that has none): the same keys, and no dense values
    plain = build_key_batch([{"line": ln} for ln in lines], SLOTS, sparse_dim)
    assert plain.dense is None and plain.keys.tolist() == batches["serving instances"][0].keys.tolist()
    # merging keeps each part's rows
    merged, offsets = concat_key_batches([batches["lines"][0], batches["serving instances"][0]])
    got = pool(merged, table.lookup(merged.keys)[0])
    np.testing.assert_allclose(got[offsets[1] :], want, rtol=0, atol=1e-5)
    np.testing.assert_allclose(merged.dense[offsets[1] :], want_dense, rtol=1e-12, atol=0)


def test_one_key_per_cell_pools_by_reshape_and_padding_fills_empty_slots():
    kb = build_key_batch([{"slots": {"3": [10]}}, {"slots": {"1": [20], "3": [30]}}], [3, 1], None)
    table = InMemoryTable(
        np.array([10, 20, 30, PADDING_FEASIGN], np.uint64), np.arange(8, dtype=np.float32).reshape(4, 2)
    )
    assert kb.cell_starts is None  # every (row, slot) cell has exactly one key
    np.testing.assert_array_equal(pool(kb, table.lookup(kb.keys)[0]), [[0, 1, 6, 7], [4, 5, 2, 3]])


def test_slots_form_equals_line_form():
    big = (1 << 64) - 5
    a = build_key_batch([{"line": f"1 0 {big}:0 7:1 8:1"}], [0, 1, 2], None)
    b = build_key_batch([{"slots": {"0": [str(big)], "1": [7, 8]}}], [0, 1, 2], None)
    assert a.keys.tolist() == b.keys.tolist() and a.slot_pos.tolist() == b.slot_pos.tolist()


def test_slots_form_takes_one_number_per_dense_slot_like_the_line_form():
    slots, dense = [1, 2], [40, 41]
    given = [
        {"slots": {"1": [5], "40": 2.5, "41": [-3]}},
        {"slots": {"2": ["7"], "40": [7], "41": []}},  # an integer is a dense slot's value; [] leaves it missing
        {"slots": {"1": [1], "40": "1e-3", "41": 10**30}},  # a decimal string; any finite JSON number
    ]
    lines = ["1 0 5:1 2.5:40 -3:41", "1 0 7:2 7:40", f"1 0 1:1 1e-3:40 {float(10**30)!r}:41"]
    kb = build_key_batch(given, slots, None, dense)
    np.testing.assert_array_equal(kb.dense, [[2.5, -3], [7, np.nan], [1e-3, 1e30]])
    line_kb = build_key_batch([{"line": ln} for ln in lines], slots, None, dense)
    np.testing.assert_array_equal(kb.dense, line_kb.dense)
    assert kb.keys.tolist() == line_kb.keys.tolist()


@pytest.mark.parametrize(
    "instances, dense, words",
    [
        ([{"slots": {"40": [1, 2.5]}}], [40], "instance 0 slot 40: a dense slot takes one number, got 2"),
        ([{"line": "1 0 1:1"}, {"slots": {"40": [1, 2]}}], [40], "instance 1 slot 40: a dense slot takes one"),
        ([{"slots": {"1": [1.5], "40": 1}}], [40], "instance 0 slot 1: feasign 1.5 is not an integer (slot 1 is"),
        ([{"slots": {"1": [-1]}}], [40], "instance 0 slot 1: feasign -1 is outside the unsigned 64-bit range"),
        ([{"slots": {"1": [10**30]}}], [], "instance 0 slot 1: feasign 1e+30 is outside the unsigned 64-bit"),
        ([{"slots": {"1": ["2.5"]}}], [], "instance 0 slot 1: feasign 2.5 is not an integer"),
        ([{"slots": {"77": 2.5}}], [40], "unknown slot '77'; this model's slots are [1, 2] and dense slots [40]"),
        ([{"slots": {"40": 2.5}}], [], "unknown slot '40'; this model's slots are [1, 2]"),  # a model without
        ([{"slots": {"40": True}}], [40], "instance 0 slot 40: True is not an integer feasign nor a number"),
        ([{"slots": {"40": None}}], [40], "instance 0 slot 40: None is not an integer feasign nor a number"),
        ([{"slots": {"40": float("inf")}}], [40], "instance 0 slot 40: inf is not a finite number"),
        ([{"slots": {"40": "2,5"}}], [40], "instance 0 slot 40: feasign '2,5' is not an unsigned integer"),
        ([{"slots": {"40": "nan"}}], [40], "nor a decimal number"),
        ([{"line": "1 0 1:1 2.5.1:40"}], [40], "'2.5.1:40' is not integer:integer (feasign:slot) nor number:integer"),
        ([{"line": "1 0 1:1 1e999:40"}], [40], "instance 0: feature '1e999:40': a dense value must be a finite"),
        ([{"line": "1 0 1:1 2.5:1234567890"}], [40], "slot 1234567890 has more than 9 digits"),
        ([{"line": "1 0 1:1 ٣.5:40"}], [40], "ASCII digits"),
    ],
)
def test_bad_dense_values_are_named(instances, dense, words):
    with pytest.raises(InstanceError) as info:
        build_key_batch(instances, [1, 2], None, dense)
    assert words in str(info.value)


# ---- strict request parsing: one bad request fails alone --------------------------------------------


@pytest.mark.parametrize(
    "line, words",
    [
        ("1 0 ²:1", "ASCII digits"),  # str.isdigit() is true for '²'
        ("1 0 ٣:1", "ASCII digits"),  # an Arabic-Indic digit: int() would take it
        ("1 0 1_0:1", "ASCII digits"),  # int() takes underscores
        ("1 0 " + "9" * 4300 + ":1", r"feasign 9{20}\.\.\.\(4300 digits\) is above 2\*\*64-1"),
        ("1 0 " + "9" * 21 + ":1", r"feasign 9{21} is above 2\*\*64-1 \(the largest unsigned 64-bit integer"),
        ("1 0 18446744073709551616:1", r"feasign 18446744073709551616 is above 2\*\*64-1"),  # 2**64
        ("1 0 1:2:3 4", "integer:integer"),
        ("1 0 :5 6:", "integer:integer"),
        ("1 0 12", "integer:integer"),
        ("1:0 1 1:1", "show/click"),
        ("1 2 1:1", "show/click"),
        ("1 0 1:1234567890", "slot 1234567890 has more than 9 digits"),
        ("1 0 12345678901234567890123:39", r"'12345678901234567890123:39': feasign 12345678901234567890123 is above"),
        ("1 0 1:1\n1 0 1:2", "integer:integer"),
        ("", "expected"),
    ],
)
def test_bad_lines_are_refused_with_the_reason(line, words):
    with pytest.raises(InstanceError, match=words):
        parse_lines_strict([line], [0])


def test_a_line_with_a_newline_inside_is_refused_even_beside_a_blank_line():
    """Joined for the byte parse, a line holding a newline makes two lines and a blank one none: their counts
    must not cancel out into a batch whose rows belong to other instances."""
    lines = ["1 0 5:1\n1 0 6:1", "   ", "1 0 7:1", "1 0 8:1", "1 0 9:1"]
    with pytest.raises(InstanceError, match="instance [01]"):
        parse_lines_strict(lines, list(range(len(lines))))


def _same_as_reference(got, lines):
    """parse_lines_strict's columns of ``lines`` equal the reference parser's, line by line, values included."""
    want = [parse_sample_line(ln) for ln in lines]
    assert list(got.counts) == [len(w.feasigns) for w in want], lines[0]
    assert list(got.feasigns) == [f for w in want for f in w.feasigns], lines[0]
    assert list(got.slots) == [s for w in want for s in w.slots], lines[0]
    assert sorted(zip(got.value_lines, got.value_slots, got.values, strict=True)) == sorted(
        (i, s, v) for i, w in enumerate(want) for s, v in zip(w.value_slots, w.values, strict=True)
    ), lines[0]


def test_fast_and_exact_line_paths_agree_on_random_lines():
    rng = random.Random(7)
    lines = criteo_slot_lines(500, 40)
    assert any("." in ln for ln in lines), "Criteo lines carry dense values"
    good = [ln for ln in lines]
    good += ["1 0 18446744073709551615:3", "0 1", "7 1 1:2\t3:4", "1 0  5:1 ", "1 1 00012:0001"]
    good += ["1 0 2.5:40 -3:41 1e-3:42 7:43 +.5:44 5.:45 1E+2:46 -0:47", "1 1 1:1\t-2.5:40 ", "0 0 0.0:1"]
    bads = []
    for ln in good:
        for many in (1, 6):  # the few-lines path and the vectorised path
            _same_as_reference(parse_lines_strict([ln] * many, list(range(many))), [ln] * many)
    mixed = ["1 0", "1 0 2.5:40", "0 1 5:1", "1 1 -1:41 3:2 7:40", "1 0 1:1 1e3:41"] * 2 + lines[:3]
    for chosen in (mixed, mixed[:4], list(reversed(mixed))):  # lines with and without values, and none
        _same_as_reference(parse_lines_strict(chosen, list(range(len(chosen)))), chosen)
    alphabet = "0123456789 :\t²x-\n.e+E"
    for _ in range(600):  # mutations: either refused with InstanceError, or parsed like the reference
        base = list(rng.choice(lines))
        for _ in range(rng.randint(1, 3)):
            base[rng.randrange(len(base))] = rng.choice(alphabet)
        mutated = "".join(base)
        for many in (1, 6):
            try:
                got = parse_lines_strict([mutated] * many, list(range(many)))
            except InstanceError:
                bads.append(mutated)
                continue
            _same_as_reference(got, [mutated] * many)
    assert bads, "the mutations must produce some bad lines"


def _columns_of(parsed):
    return [
        np.asarray(parsed.counts, np.int64).tolist(),
        np.asarray(parsed.feasigns, np.uint64).tolist(),
        np.asarray(parsed.feature_slots, np.int64).tolist(),
        sorted(
            zip(*(np.asarray(c).tolist() for c in (parsed.value_rows, parsed.value_slots, parsed.values)), strict=True)
        ),
    ]


def test_lines_parsed_together_are_each_request_parsed_alone():
    """The batch worker parses the unparsed lines of every request in its batch at once (parse_parts): each
    request gets exactly what parsing it alone gives, values included, whatever its size."""
    rng = random.Random(3)
    lines = criteo_slot_lines(300, 40)
    lines += ["1 0 2.5:40 -3:41 1e-3:42 7:43", "0 1", "1 1 00012:0001 5.:45"]
    rng.shuffle(lines)
    sizes, at = [], 0
    while at < len(lines):
        sizes.append(min(rng.choice([1, 2, 5, 32, 40]), len(lines) - at))
        at += sizes[-1]
    requests = np.split(np.array(lines, dtype=object), np.cumsum(sizes)[:-1])
    items = [UnparsedLines(list(r)) for r in requests]
    items.insert(3, parse_instances([{"slots": {"2": [5]}}]))  # a request parsed by its frontend passes through
    got = parse_parts(items)
    assert got[3] is items[3]
    for item, parsed in zip(items, got, strict=True):
        if isinstance(item, UnparsedLines):
            assert parsed.n == item.n
            assert _columns_of(parsed) == _columns_of(parsed_lines(item.lines, range(item.n)))


def test_requests_parsed_together_merge_back_to_their_shared_columns_exactly():
    """A batch of requests parsed together merges (concat_parsed) into the columns they were cut from, without
    a copy, and those equal merging each one parsed alone; any other selection or order is concatenated."""
    lines = criteo_slot_lines(500, 24) + ["1 0 2.5:40 -3:41 1e-3:42 7:43"]
    items = [UnparsedLines(lines[0:5]), UnparsedLines(lines[5:6]), UnparsedLines(lines[6:25])]
    got = parse_parts(items)
    alone = [parsed_lines(item.lines, range(item.n)) for item in items]
    merged, offsets = concat_parsed(got)
    assert offsets == [0, 5, 6] and merged is got[0].within[0]
    assert _columns_of(merged) == _columns_of(concat_parsed(alone)[0])
    for pick in ([got[0], got[2]], [got[1], got[0], got[2]], got[1:]):
        part_merged, _ = concat_parsed(pick)
        assert part_merged is not merged
        assert _columns_of(part_merged) == _columns_of(concat_parsed([alone[got.index(p)] for p in pick])[0])


def test_a_bad_line_parsed_together_refuses_its_own_request_alone():
    good = criteo_slot_lines(12, 40)
    items = [UnparsedLines(good[:6]), UnparsedLines([good[6], "1 0 5:1 oops", good[7]]), UnparsedLines(good[8:])]
    first, bad, last = parse_parts(items)
    assert isinstance(bad, InstanceError) and bad.status == 400
    with pytest.raises(InstanceError) as alone:
        parse_instances([{"line": ln} for ln in items[1].lines])
    assert str(bad) == str(alone.value) and str(bad).startswith("instance 1:")
    assert _columns_of(first) == _columns_of(parsed_lines(good[:6], range(6)))
    assert _columns_of(last) == _columns_of(parsed_lines(good[8:], range(4)))
    # a part of a larger request names its instances as the whole request does
    (part,) = parse_parts([slice_parsed(UnparsedLines([*good[:5], "1 0 x:1"]), 4, 6)])
    assert str(part).startswith("instance 5:")


def test_only_requests_of_lines_stay_unparsed():
    assert isinstance(predict_request({"instances": [{"line": "1 0 5:1"}]}, defer_lines=True).parsed, UnparsedLines)
    for instances in ([{"slots": {"1": [5]}}], [{"line": "1 0 5:1"}, {"slots": {"1": [5]}}], [{"line": 5}]):
        try:
            parsed = predict_request({"instances": instances}, defer_lines=True).parsed
        except InstanceError:
            continue
        assert not isinstance(parsed, UnparsedLines)
    with pytest.raises(InstanceError, match="empty"):
        predict_request({"instances": []}, defer_lines=True)


@pytest.mark.parametrize(
    "body, status, words",
    [
        (b"[" * 100_000 + b"]" * 100_000, 400, "nested deeper than"),
        (b'{"instances": [{"slots": {"1": [' + b"9" * 5000 + b"]}}]}", 400, "malformed JSON"),
        (b'{"instances": [{"slots": {"1": ["' + b"9" * 30 + b'"]}}]}', 400, r"is above 2\*\*64-1"),
        (b'{"instances": [{"slots": {"1": ["\xc2\xb2"]}}]}', 400, "ASCII digits"),
        (b'{"instances": [{"slots": {"1": [true]}}]}', 400, "not an integer"),
        (b'{"instances": [{"slots": {"1": [1e999]}}]}', 400, "not a finite number"),
        (b'{"instances": [{"slots": {"1": [null]}}]}', 400, "not an integer feasign nor a number"),
        (b'{"instances": [{"slots": {"1": ["2.5x"]}}]}', 400, "nor a decimal number"),
        (b'{"instances": [{"slots": {"1": [[1]]}}]}', 400, "not an integer feasign nor a number"),
        (b'{"instances": [{"slots": {"\xc2\xb2": [1]}}]}', 400, "unknown slot"),
        (json.dumps({"instances": [{"line": "1 0 1:1"}] * 10_001}).encode(), 413, "at most 10000"),
        (b'{"instances": []}', 400, "empty"),
        (b'{"instances": [{"line": "1 0 1:1"}], "routing_key": []}', 400, "routing_key"),
        (b'{"instances": [{"line": "1 0 1:1"}], "arm": "No Such"}', 400, "arm"),
    ],
)
def test_bad_bodies_are_client_errors(body, status, words):
    with pytest.raises(InstanceError, match=words) as info:
        predict_request(decode_json(body))
    assert info.value.status == status
    assert isinstance(info.value, TooManyInstances) == (status == 413)


def test_mixed_forms_keep_instance_order():
    parsed = parse_instances([{"slots": {"2": [5]}}, {"line": "1 0 7:1"}, {"slots": {"1": ["8"]}}])
    assert parsed.feature_row.tolist() == [0, 1, 2]
    assert list(parsed.feasigns) == [5, 7, 8] and list(parsed.feature_slots) == [2, 1, 1]
    assert list(parsed.strict_rows) == [True, False, True]


# ---- the hot-key cache ------------------------------------------------------------------------


def test_version_cache_hits_only_what_it_was_given_and_stays_bounded():
    rng = np.random.default_rng(1)
    cache = VersionCache(1024, 3)
    keys = np.unique(rng.integers(0, 2**63, 5000, dtype=np.int64).astype(np.uint64))
    values = rng.normal(size=(len(keys), 3)).astype(np.float32)
    found = rng.random(len(keys)) < 0.8
    hit, _, _ = cache.get(keys)
    assert not hit.any()
    cache.put(keys, values, found)
    hit, got, got_found = cache.get(keys)
    assert 0 < hit.sum() <= cache.capacity == 1024 and cache.filled <= 1024
    np.testing.assert_array_equal(got[hit], values[hit])  # a hit is always that key's own row
    np.testing.assert_array_equal(got_found[hit], found[hit])
    hit0, _, _ = cache.get(np.array([0, 1, 2], np.uint64))  # never given: the empty ways never match
    assert not hit0.any()


def test_keys_sharing_a_set_all_stay_until_its_ways_are_full():
    """A request carries about 1,250 keys: with two ways a set holding three of them kept evicting one, so
    most requests missed and waited for cube. A set keeps up to its 8 ways; the 9th key replaces the way
    filled longest ago."""
    cache = VersionCache(1024, 3)
    candidates = np.arange(1, 200_000, dtype=np.uint64)
    sets = cache._set_of(candidates)
    same = candidates[sets == sets[0]][:9]  # nine keys of one set
    assert len(same) == 9
    for i, key in enumerate(same[:8]):  # one at a time, as lookups come back
        cache.put(np.array([key]), np.full((1, 3), i, np.float32), np.ones(1, bool))
    hit, rows, _ = cache.get(same[:8])
    assert hit.all() and (rows[:, 0] == np.arange(8)).all()
    cache.put(same[8:], np.full((1, 3), 8, np.float32), np.ones(1, bool))
    hit, _, _ = cache.get(same)
    assert hit.tolist() == [False] + [True] * 8  # the first one in went out


def _version(name: str, load_id: int, width: int = 2) -> LoadedVersion:
    return LoadedVersion(name, (1,), None, width, Path("unused"), lookup=None, load_id=load_id)


def test_caches_are_per_version():
    caches = EmbeddingCaches(64)
    va, vb = _version("pass-a", 1), _version("pass-b", 2)
    a, b = caches.for_version(va), caches.for_version(vb)
    keys = np.array([5, 6], np.uint64)
    a.put(keys, np.ones((2, 2), np.float32), np.ones(2, bool))
    assert a.get(keys)[0].all() and not b.get(keys)[0].any()
    va.retired = True
    caches.drop(va)
    assert caches.snapshot()["versions"] == ["pass-b"]


def test_a_retired_version_gets_no_cache_again():
    """A batch pinned to a version before the switch can reach the cache after the version was retired (its
    lookup was in flight): a cache created for it then was never dropped, about 1.5 MB of RSS a reload."""
    caches = EmbeddingCaches(64)
    old = _version("pass-a", 1)
    caches.for_version(old)
    old.retired = True
    caches.drop(old)
    assert caches.for_version(old) is None
    assert caches.snapshot()["versions"] == []


# ---- A/B routing ---------------------------------------------------------------------------------


def test_split_routes_keys_stably_within_3_percent_of_the_weights():
    split = split_from_flag("challenger=pass-20200101-05:10")
    assert split.weights() == {"control": 0.9, "challenger": 0.1}
    arms = [split.pick(f"user-{i}").name for i in range(2000)]
    share = arms.count("challenger") / 2000
    assert abs(share - 0.10) <= 0.03, share
    assert arms == [split.pick(f"user-{i}").name for i in range(2000)]  # the same key, the same arm
    assert route_point("user-1") == route_point("user-1") and 0 <= route_point("x") < 1


def test_split_validation():
    with pytest.raises(SplitError, match="exactly one arm"):
        make_split([Arm("a", 1, "v1"), Arm("b", 1, "v2")])
    with pytest.raises(SplitError, match="unique"):
        make_split([Arm("a", 1, None), Arm("a", 1, "v2")])
    with pytest.raises(SplitError, match="add up to"):
        split_from_flag("x=pass-1:60,y=pass-2:50")
    with pytest.raises(SplitError, match="NAME=VERSION:WEIGHT"):
        split_from_flag("challenger")
    with pytest.raises(SplitError, match="body must be"):
        split_from_json({"arms": "x"}, 1)
    s = split_from_json({"arms": [{"name": "control", "weight": 0}, {"name": "b", "weight": 1, "version": "v"}]}, 3)
    assert s.pick("anyone").name == "b" and s.generation == 3


# ---- the prediction log and the monitor ------------------------------------------------------------


def test_prediction_log_joins_once_within_the_window_and_counts_the_rest():
    log = PredictionLog(window_s=60, capacity=10, max_requests=4)
    seen = []
    rid = log.record("control", "v1", np.array([0.1, 0.2, 0.3], np.float32), now=1000.0)
    r = log.join(
        [(rid, 0, 1), (rid, 2, 0), (rid, 2, 1), (rid, 3, 1), (rid, 1, 2), ("nope", 0, 1)],
        lambda *a: seen.append(a),
        now=1001.0,
    )
    assert (r.joined, r.duplicate, r.invalid, r.unknown) == (2, 1, 2, 1)
    arm, version, probs, clicks = seen[0]
    assert (arm, version) == ("control", "v1")
    np.testing.assert_allclose(probs, [0.1, 0.3], rtol=1e-6)
    assert clicks.tolist() == [1, 0]
    assert log.join([(rid, 1, 1)], lambda *a: None, now=1061.0).unknown == 1  # older than the window
    for _ in range(4):  # the request ring wraps: the first request is gone
        log.record("control", "v1", np.array([0.5], np.float32), now=1002.0)
    assert log.join([(rid, 1, 1)], lambda *a: None, now=1003.0).unknown == 1


def test_monitor_figures_match_a_recomputation_and_alerts_fire():
    rng = np.random.default_rng(3)
    mon = Monitor(window_s=600, rules=AlertRules(min_feedback=100, min_keys=10, coverage_floor=0.9))
    p = rng.uniform(0.01, 0.6, 3000)
    y = (rng.random(3000) < p * 0.5).astype(np.int64)  # outcomes at half the predicted rate: miscalibrated
    mon.observe_predictions("control", "v1", [1, 2], p.astype(np.float32), np.array([100, 100]), np.array([0, 50]))
    mon.observe_feedback("control", "v1", p, y)
    (s,) = mon.summary()
    fb = s["feedback"]
    assert fb["count"] == 3000 and fb["clicks"] == int(y.sum())
    assert fb["observed_ctr"] == pytest.approx(y.mean()) and fb["mean_prediction"] == pytest.approx(p.mean())
    assert fb["calibration"] == pytest.approx(p.mean() / y.mean())
    assert fb["logloss"] == pytest.approx(log_loss(y, p), rel=1e-9)
    assert fb["auc"] == pytest.approx(roc_auc_score(y, p), abs=2e-3)
    assert s["coverage"]["slots"]["2"]["unknown_share"] == 0.5
    kinds = {(a["kind"], a.get("slot")) for a in mon.alerts()}
    assert kinds == {("calibration", None), ("coverage", "2")}


def test_pins_keep_other_writers_versions(tmp_path):
    import json as _json

    from elastic_control.serving.pins import PinStore

    (tmp_path / "pins.json").write_text(_json.dumps({"versions": ["pass-ops"]}))  # pinned by someone else
    store = PinStore.local(tmp_path)
    store.set_serving_pins([("pass-b", "A/B challenger arm")])
    doc = _json.loads((tmp_path / "pins.json").read_text())
    assert doc["versions"] == ["pass-b", "pass-ops"] and store.serving_versions() == ["pass-b"]
    store.set_serving_pins([])
    assert _json.loads((tmp_path / "pins.json").read_text())["versions"] == ["pass-ops"]


def test_a_batch_recorded_at_once_joins_like_requests_recorded_one_by_one():
    log = PredictionLog(window_s=60, capacity=8, max_requests=16)
    ids = log.record_batch("a", "v", np.array([0.1, 0.2, 0.3, 0.4, 0.5], np.float32), [2, 1, 2])
    ids += log.record_batch("a", "v", np.array([0.6, 0.7, 0.8, 0.9], np.float32), [4])  # wraps the ring
    seen = []
    r = log.join([(ids[1], 0, 1), (ids[2], 1, 0), (ids[3], 3, 1), (ids[0], 0, 1)], lambda *a: seen.append(a))
    assert (r.joined, r.unknown) == (3, 1)  # ids[0]'s probabilities were overwritten by the wrap
    np.testing.assert_allclose(sorted(seen[0][2]), [0.3, 0.5, 0.9], rtol=1e-6)
    assert len(set(ids)) == 4 and all(len(i) == 24 for i in ids)


def test_answer_bytes_equal_json_dumps():
    from elastic_control.serving.batcher import Answer

    a = Answer(np.array([0.1, 1e-8, 0.99999994], np.float32), "ab" * 12, "control", 'pass-"x"', "pass-y")
    assert json.loads(a.to_json_bytes()) == a.to_json()


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--split", "foo"], "NAME=VERSION:WEIGHT"),
        (["--split", "a=pass-1:70,b=pass-2:40"], "add up to 110%"),
        (["--alert-calibration", "2..1"], "0 < LOW < 1 < HIGH"),
    ],
)
def test_serve_refuses_bad_flags_in_one_line(tmp_path, flags, words):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "elastic_control", "serve", "--model-dir", str(tmp_path), *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and words in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_batcher_that_never_started_stops_cleanly():
    """A start-up failure (e.g. the gRPC front end failing to import) stops the app before its workers started:
    stop() must not raise over the real error."""
    from elastic_control.serving.batcher import Batcher

    Batcher(app=None, workers=2).stop()


def test_requests_arriving_while_others_are_in_flight_wait_to_share_a_batch():
    """Frontend.submit: at an idle server a request is queued at the end of the loop's pass; while others are
    in flight, it waits up to the batch delay for more to join (gRPC calls arrive one at a time and woke a
    worker each); a full batch goes at once; a delay of 0 never waits."""
    import asyncio
    from types import SimpleNamespace

    from elastic_control.serving.batcher import Batcher, Frontend, Job

    def scenario(delay: float):
        batcher = Batcher(app=None, workers=1, max_batch_instances=8, batch_delay=delay)
        frontend = Frontend(SimpleNamespace(batcher=batcher))
        queued: list[int] = []  # instances per submit_many call
        submit_many = batcher.submit_many
        batcher.submit_many = lambda jobs: (queued.append(sum(j.n for j in jobs)), submit_many(jobs))

        def job(n: int) -> Job:
            return Job(predict_request({"instances": [{"line": "1 0 5:1"}] * n}), frontend, None)

        async def run():
            frontend.loop = asyncio.get_running_loop()
            frontend.submit(job(1))  # nothing in flight: no wait
            await asyncio.sleep(0.01)
            seen = [list(queued)]
            frontend.submit(job(1))  # the first is in flight (never answered: no worker runs)
            frontend.submit(job(2))
            await asyncio.sleep(0.01)
            seen.append(list(queued))
            frontend.submit(job(1))  # joins the two still waiting
            await asyncio.sleep(0.15)
            seen.append(list(queued))
            frontend.submit(job(3))
            frontend.submit(job(5))  # 8 instances pending: the batch is full
            seen.append(list(queued))
            await asyncio.sleep(0.15)
            return seen

        try:
            return asyncio.run(run())
        finally:
            batcher.stop()

    assert scenario(0.1) == [[1], [1], [1, 4], [1, 4, 8]]
    assert scenario(0.0) == [[1], [1, 3], [1, 3, 1], [1, 3, 1]]  # no delay: each pass's requests go together


def _lookup_scenario(hold: float):
    """A _Pending over four parts: part 0 needs key 10 (shard 0), part 1 key 30 (shard 1), part 2 keys 20 and 30,
    part 3 none (its keys were cached, it waits along); and the batcher holding it."""
    from types import SimpleNamespace

    from elastic_control.serving.batcher import Batcher, _Part, _Pending

    counted: list[str] = []
    batcher = Batcher(app=SimpleNamespace(metrics=SimpleNamespace(count=counted.append)), workers=1, lookup_hold=hold)
    parts = [_Part(job=None, lo=i, hi=i + 1, parsed=None) for i in range(4)]
    keys, key_at, part_at = np.array([10, 20, 30]), np.array([0, 2, 1, 2]), np.array([0, 1, 2, 2])
    pending = _Pending(batcher, parts, SimpleNamespace(load_id=7), keys, key_at, part_at)
    batcher._hold(pending)
    return batcher, pending, parts, counted


def _piece(idx: list[int], error=None):
    from elastic_control.serving.lookup import Looked, failed_piece

    at = np.array(idx)
    return failed_piece(at, error) if error else Looked(at, np.ones((len(at), 2), np.float32), np.ones(len(at), bool))


def test_the_parts_of_a_lookup_come_back_together_unless_a_shard_is_slow_or_fails():
    """The requests of a batch that wait for a lookup come back as one batch once every shard has answered
    (split per shard, a cold cache scored up to three times as many batches); once the hold has passed, or a shard has
    failed, each goes back as soon as its own keys are in, with the error of a shard it needed."""
    from elastic_control.serving.lookup import CubeUnavailable

    def sent_back(batcher) -> list[list[int]]:
        out: list[list[int]] = []
        batcher._come_back = lambda parts: out.append([p.lo for p in parts])
        return out

    # every shard answers within the hold: one batch, each part with every piece
    batcher, pending, parts, _ = _lookup_scenario(hold=60)
    back = sent_back(batcher)
    pending.piece(_piece([0, 1]))
    assert back == []
    pending.piece(_piece([2]))
    assert back == [[0, 1, 2, 3]]
    assert all(p.rows[0] == 7 and len(p.rows[1]) == 2 and p.error is None for p in parts)

    # the hold passes before shard 1 answers: the parts with their keys in go on, the others on its answer
    batcher, pending, parts, _ = _lookup_scenario(hold=60)
    back = sent_back(batcher)
    pending.piece(_piece([0, 1]))
    assert pending.release_held() == [parts[0], parts[3]]
    pending.piece(_piece([2]))
    assert back == [[1, 2]]

    # shard 1 fails first: the parts that needed only it go back at once with its error, the rest on their keys
    batcher, pending, parts, counted = _lookup_scenario(hold=60)
    back = sent_back(batcher)
    error = CubeUnavailable("cube shard 1 did not answer")
    pending.piece(_piece([2], error))
    assert back == [[1, 3]] and parts[1].error is error and parts[3].error is None
    pending.piece(_piece([0, 1]))
    assert back == [[1, 3], [0, 2]] and parts[2].error is error and parts[0].error is None
    assert counted == ["cube_errors"]


def test_a_waiting_worker_sends_the_parts_on_when_the_hold_passes():
    """A shard slower than the hold: the workers' wait ends with the hold, and the parts whose keys are in are
    the next batch (nothing else is queued)."""
    from types import SimpleNamespace

    batcher, pending, parts, _ = _lookup_scenario(hold=0.2)
    pending.piece(_piece([0, 1]))
    t = time.monotonic()
    try:
        got = batcher.take_parts(SimpleNamespace(control=[]))
    finally:
        batcher.stop()
    assert got == [parts[0], parts[3]]
    assert 0.15 < time.monotonic() - t < 1.0


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def test_prediction_log_and_cache_memory_is_bounded_by_their_rings():
    """The soak's RSS rise: the feedback rings and the hot-key cache are preallocated numpy
    arrays whose pages the kernel commits when first written, so RSS climbs until they are full once;
    after that, traffic, overwritten predictions and evicted keys add nothing."""
    log = PredictionLog(window_s=60, capacity=400_000, max_requests=100_000)
    probs = np.random.default_rng(0).random(4 * 250, dtype=np.float32)
    sizes = [4] * 250

    def wrap_rings():  # one full turn of both rings: 100k requests, 400k instances
        for _ in range(400):
            log.record_batch("control", "v1", probs, sizes)

    wrap_rings()
    first = _rss()
    for _ in range(3):
        wrap_rings()
    assert _rss() - first < 3 << 20, "the prediction log grew after its rings were full"
    assert log.snapshot()["requests_recorded"] == 400_000

    cache = VersionCache(1 << 16, 9)
    rng = np.random.default_rng(1)

    def fill():  # 4x the cache's capacity of distinct new keys
        for _ in range(64):
            keys = np.unique(rng.integers(0, 2**63, 4096, dtype=np.uint64))
            cache.put(keys, np.ones((len(keys), 9), np.float32), np.ones(len(keys), bool))

    fill()
    first = _rss()
    fill()
    fill()
    assert _rss() - first < 3 << 20, "the hot-key cache grew after it was full"
    assert cache.filled <= cache.capacity


def test_monitor_keeps_at_most_a_window_of_buckets():
    mon = Monitor(window_s=10, buckets=5)
    p = np.full(8, 0.1, np.float32)
    for t in range(0, 400):  # 400 s of traffic and feedback, the monitor loop folding every 5 s
        mon.observe_predictions("control", "v1", (1, 2), p, np.array([8, 8]), np.array([0, 1]), now=1000.0 + t)
        mon.observe_feedback("control", "v1", p, np.zeros(8, np.int64), now=1000.0 + t)
        if t % 5 == 0:
            mon.summary(now=1000.0 + t)
    (series,) = mon._series.values()
    assert len(series.buckets) <= 5 + 2


def test_serving_compiles_the_line_parse_before_it_listens(tmp_path):
    """A fresh process without numba's cache compiles the byte parse on first use (3-4 s of CPU, 14 s seen
    under load): serve() runs warm_up_line_parse before it binds, and that leaves the parse compiled."""
    import inspect
    import subprocess
    import sys

    from elastic_control.serving import service

    source = inspect.getsource(service.serve)
    assert source.index("warm_up_line_parse()") < source.index("ServingServer(")
    probe = (
        "import pyarrow\n"
        "from elastic_control.data import byte_scan\n"
        "from elastic_control.serving.instances import warm_up_line_parse\n"
        "before = len(byte_scan._scan.signatures)\n"
        "warm_up_line_parse()\n"
        "print(before, len(byte_scan._scan.signatures))\n"
    )
    env = {**__import__("os").environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["0", "1"]
