"""The slot-line grammar at its one owner (ctr_foundation/slot_grammar.py), and its users held to it: every
path of the training reader (data/line_batch.py) and of serving's line check (serving/instances.py) accepts
what the owner accepts, with the same columns, and refuses what it refuses, in its words."""

from __future__ import annotations

import numpy as np
import pytest

from ctr_foundation import slot_grammar as g
from ctr_foundation.sample import MalformedLine, parse_sample_line
from elastic_control.data import line_batch
from elastic_control.serving.instances import InstanceError, parse_lines_strict

MAX = g.UINT64_MAX
GOOD = {  # line -> (show, click, feasigns, slots, values, value slots)
    "1 0 5:1 2.5:40": (1, 0, (5,), (1,), (2.5,), (40,)),
    "007 1 00000000000000000001:1": (7, 1, (1,), (1,), (), ()),  # leading zeros, within the digit bounds
    f"{g.SHOW_LIMIT - 1} 1 {MAX}:999999999": (g.SHOW_LIMIT - 1, 1, (MAX,), (999999999,), (), ()),
    "0 0": (0, 0, (), (), (), ()),
    "  1\t1 5:000000007 -3:41 \r": (1, 1, (5,), (7,), (-3.0,), (41,)),  # tabs, blanks, a carriage return
}
BAD = {  # line -> the owner's message
    "1": g.EXPECTED,
    "1 00 5:1": g.show_click_problem("1", "00"),
    "+1 1 5:1": g.show_click_problem("+1", "1"),
    "\u0663 1 5:1": g.show_click_problem("\u0663", "1"),
    f"{g.SHOW_LIMIT} 1 5:1": g.show_above_int64(str(g.SHOW_LIMIT)),
    "1 1 5:0000000001": f"feature '5:0000000001': {g.slot_too_long('0000000001')}",
    f"1 1 5:{1 << 63}": f"feature '5:{1 << 63}': {g.slot_too_long(str(1 << 63))}",
    f"1 1 2.5:{1 << 64}": f"feature '2.5:{1 << 64}': {g.slot_too_long(str(1 << 64))}",
    f"1 1 {MAX + 1}:1": f"feature '{MAX + 1}:1': {g.feasign_above_uint64(str(MAX + 1))}",
    "1 1 000000000000000000001:1": f"feature '000000000000000000001:1': {g.feasign_above_uint64('0' * 20 + '1')}",
    "1 1 1e999:40": g.value_not_finite("1e999:40"),
    "1 1 x:3": g.bad_token("x:3"),
    "1 1 \u00b2:3": g.bad_token("\u00b2:3"),  # str.isdigit() is true for it
    "1 1 1_0:3": g.bad_token("1_0:3"),  # int() takes it
    "1 1 nan:40": g.bad_token("nan:40"),
    "1 1 5:1\u00a07:2": "characters outside the slot format (spaces or tabs between fields, ASCII digits)",
}


@pytest.mark.parametrize("line", GOOD)
def test_the_owner_accepts_a_line_of_the_grammar(line):
    assert g.LINE_OK.fullmatch(line)
    s = parse_sample_line(line)
    assert (s.show, s.click, s.feasigns, s.slots, s.values, s.value_slots) == GOOD[line]


@pytest.mark.parametrize("line", BAD)
def test_the_owner_refuses_a_line_naming_what_is_wrong(line):
    with pytest.raises(MalformedLine) as e:
        parse_sample_line(line)
    assert str(e.value) == BAD[line]


def test_the_limits_are_the_types_they_fill():
    assert g.FEASIGN_DIGITS == len(str(MAX)) == 20
    assert g.SLOT_LIMIT == 10**g.SLOT_DIGITS < 2**32  # slot ids fit gRPC's uint32 slot keys
    assert g.SHOW_LIMIT == 2**63  # shows are int64


def _rows(batch):
    out = []
    for i in range(len(batch)):
        lo, hi = np.searchsorted(batch.feature_line, [i, i + 1])
        vlo, vhi = np.searchsorted(batch.value_line, [i, i + 1])
        out.append(
            (
                int(batch.shows[i]),
                int(batch.clicks[i]),
                tuple(batch.feasigns[lo:hi].tolist()),
                tuple(batch.feature_slots[lo:hi].tolist()),
                tuple(batch.values[vlo:vhi].tolist()),
                tuple(batch.value_slots[vlo:vhi].tolist()),
            )
        )
    return out


def _training_paths(monkeypatch):
    """Each way the training reader can parse a chunk: the whole-chunk byte parse, then the chunk regular
    expressions without it, then the per-line parse alone."""
    yield "bytes", lambda lines: line_batch.parse_text(("\n".join(lines) + "\n").encode())
    yield "lines", line_batch.parse_lines
    monkeypatch.setattr(line_batch, "_parse_plain_bytes", lambda data, lines=None: None)
    yield "chunk regex", line_batch.parse_lines
    monkeypatch.setattr(line_batch, "_parse_valid_chunk", lambda lines, text: None)
    yield "per line", line_batch.parse_lines


@pytest.mark.parametrize("line", [*GOOD, *BAD])
def test_every_training_path_follows_the_owner(line, monkeypatch):
    other = "1 1 9:2 0.5:41"  # a good line beside it; with a value token, so the value paths run too
    for name, parse in _training_paths(monkeypatch):
        batch, bad = parse([other, line, other])
        if line in GOOD:
            assert not bad and _rows(batch) == [_rows(parse([other])[0])[0], GOOD[line], _rows(parse([other])[0])[0]]
        else:
            assert [(b.index, b.reason) for b in bad] == [(1, BAD[line])], name
            assert len(batch) == 2, name


@pytest.mark.parametrize("copies", [1, 6])  # serving's few-lines path, its fast path; each falls back to the exact one
@pytest.mark.parametrize("line", [*GOOD, *BAD])
def test_serving_lines_follow_the_owner(line, copies):
    lines = ["1 1 9:2 0.5:41"] * (copies - 1) + [line]
    if line in BAD:
        with pytest.raises(InstanceError) as e:
            parse_lines_strict(lines, range(copies))
        assert str(e.value) == f"instance {copies - 1}: {BAD[line]}"
        return
    cols = parse_lines_strict(lines, range(copies))
    show, click, feasigns, slots, values, value_slots = GOOD[line]
    n = int(np.asarray(cols.counts)[-1])
    assert tuple(np.asarray(cols.feasigns, np.uint64)[-n:].tolist()) == feasigns if n else not feasigns
    assert tuple(np.asarray(cols.slots)[len(cols.slots) - n :].tolist()) == slots
    last = np.asarray(cols.value_lines) == copies - 1
    assert tuple(np.asarray(cols.values, float)[last].tolist()) == values
    assert tuple(np.asarray(cols.value_slots)[last].tolist()) == value_slots
