"""line_batch.parse_plain_lines, serving's parse of a merged batch's lines: the same columns as the reader's
``parse_lines``, and None (the caller then parses each request on its own, naming the bad line) for what is
not one plain sample a line."""

from __future__ import annotations

import numpy as np
import pytest

from elastic_control.data.line_batch import parse_lines, parse_plain_lines

COLUMNS = ("shows", "clicks", "feature_line", "feasigns", "feature_slots", "value_line", "value_slots", "values")


def _lines(rng: np.random.Generator, n: int) -> list[str]:
    out = []
    for _ in range(n):
        feats = [
            f"{int(rng.integers(0, 2**64, dtype=np.uint64))}:{int(rng.integers(1, 40))}"
            for _ in range(rng.integers(1, 30))
        ]
        out.append(f"1 {int(rng.integers(0, 2))} " + " ".join(feats) + f" {rng.random():.6f}:41")
    return out


@pytest.mark.parametrize("n", [1, 5, 32, 700])
def test_plain_lines_parse_as_the_reader_parses_them(n):
    lines = _lines(np.random.default_rng(n), n)
    got = parse_plain_lines(lines)
    want, bad = parse_lines(lines)
    assert got is not None and not bad and len(got) == n
    for column in COLUMNS:
        np.testing.assert_array_equal(getattr(got, column), getattr(want, column), err_msg=column)
    assert list(got.lines) == lines


@pytest.mark.parametrize(
    "odd",
    [
        "1 0 5:1\n6:2",  # a newline inside a line: two samples in one instance
        "1 0 5:1\n",  # a line's own trailing newline is one more line too
        "",  # blank: not a sample
        "   ",
        "1 0 5:1 é:2",  # not ASCII
        "1 0 5:1 x:2",  # malformed
    ],
)
def test_a_line_that_is_not_one_plain_sample_declines_the_batch(odd):
    lines = _lines(np.random.default_rng(1), 6)
    assert parse_plain_lines(lines) is not None
    assert parse_plain_lines([*lines[:3], odd, *lines[3:]]) is None
