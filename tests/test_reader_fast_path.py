"""The training reader's whole-chunk byte parse against the per-line parser, on lines with dense value tokens.

The byte parse checks a value token by where its non-digit bytes stand (``line_batch._value_tokens``), not by
the grammar's regular expression, and converts every number with pyarrow: these tests hold it to the reference
(``sample.parse_sample_line``, through ``line_batch._parse_line_by_line``) on random tokens over the bytes a
value token may hold, valid or not, in the layout writers produce and around it.
"""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from ctr_foundation.sample import parse_sample_line
from ctr_foundation.slot_grammar import VALUE_NUMBER_OK, MalformedLine
from elastic_control.data import line_batch

VALUE_ALPHABET = list("0123456789" * 2 + ".+-eE")


def _random_value(rng) -> str:
    """Mostly numbers the grammar takes, in every form (sign, point, exponent), else any mix of its bytes."""
    if rng.random() < 0.6:
        sign = str(rng.choice(["", "", "-", "+"]))
        digits = "".join(rng.choice(list("0123456789"), int(rng.integers(0, 4))))
        frac = "".join(rng.choice(list("0123456789"), int(rng.integers(0, 4))))
        mantissa = str(rng.choice([f"{digits}.{frac}", digits, f".{frac}"]))
        exponent = str(rng.choice(["", "", f"e{int(rng.integers(-400, 400))}", f"E+{int(rng.integers(0, 30))}"]))
        return sign + mantissa + exponent
    return "".join(rng.choice(VALUE_ALPHABET, int(rng.integers(1, 7))))


def _random_line(rng) -> str:
    toks = []
    for _ in range(int(rng.integers(0, 8))):
        slot = str(int(rng.integers(0, 60)))
        toks.append(f"{int(rng.integers(0, 1 << 62))}:{slot}" if rng.random() < 0.5 else f"{_random_value(rng)}:{slot}")
    return " ".join([str(int(rng.integers(0, 5))), str(int(rng.integers(0, 2))), *toks])


def _rows(batch):
    out = []
    for i in range(len(batch)):
        lo, hi = np.searchsorted(batch.feature_line, [i, i + 1])
        vlo, vhi = np.searchsorted(batch.value_line, [i, i + 1])
        out.append(
            (
                int(batch.shows[i]),
                int(batch.clicks[i]),
                list(zip(batch.feasigns[lo:hi].tolist(), batch.feature_slots[lo:hi].tolist(), strict=True)),
                list(zip(batch.values[vlo:vhi].tolist(), batch.value_slots[vlo:vhi].tolist(), strict=True)),
            )
        )
    return out


def _good(line: str) -> bool:
    try:
        parse_sample_line(line)
    except MalformedLine:
        return False
    return True


def test_a_value_token_alone_is_taken_exactly_when_the_grammar_takes_it():
    rng = np.random.default_rng(11)
    seen = {True: 0, False: 0}
    for _ in range(3000):
        value = _random_value(rng)
        line = f"1 0 5:1 {value}:40 7:2"
        fast = line_batch._parse_plain_bytes(f"{line}\n".encode())
        good = _good(line)
        seen[good] += 1
        if value.isdigit():  # an integer token: not a value
            continue
        assert (fast is not None) == good, value
        assert good == (VALUE_NUMBER_OK.fullmatch(value) is not None and np.isfinite(float(value))), value
        if good:
            assert fast.values.tolist() == [float(value)] and fast.value_slots.tolist() == [40], value
            assert fast.feasigns.tolist() == [5, 7] and fast.feature_slots.tolist() == [1, 2]
    assert min(seen.values()) > 500  # both sides covered


@pytest.mark.parametrize("seed", range(4))
def test_chunks_with_value_tokens_parse_as_the_per_line_parser_does(seed):
    rng = np.random.default_rng(seed)
    fast = 0
    for _ in range(300):
        lines = [_random_line(rng) for _ in range(int(rng.integers(1, 30)))]
        if rng.random() < 0.5:  # a chunk of valid lines only, so that many take the byte parse
            lines = [ln for ln in lines if _good(ln)] or ["1 1 0.5:40"]
        batch, bad = line_batch.parse_text(("\n".join(lines) + "\n").encode())
        ref, ref_bad = line_batch._parse_line_by_line(lines)
        assert _rows(batch) == _rows(ref), lines
        assert batch.lines == ref.lines
        assert [(b.index, b.line, b.reason) for b in bad] == [(b.index, b.line, b.reason) for b in ref_bad]
        np.testing.assert_array_equal(batch.value_line, ref.value_line)
        if line_batch._parse_plain_bytes(("\n".join(lines) + "\n").encode()) is not None:
            fast += 1
            assert not ref_bad
    assert fast > 100  # the comparison covers the byte parse, not only the fallbacks


def test_the_byte_parse_takes_criteo_like_lines_with_values_and_refuses_misplaced_ones():
    good = "1 0 17:1 18446744073709551615:2 1.38629:40 -0.693147:41 2e-05:42 +3.:43"
    batch = line_batch._parse_plain_bytes(f"{good}\n{good}\n".encode())
    assert batch is not None and batch.value_line.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert batch.values.tolist() == [1.38629, -0.693147, 2e-05, 3.0] * 2
    for bad in (
        "1 0 17:1.5",  # a value as a slot
        "1.5 0 17:1",  # as a show
        "1 0.5 17:1",  # as a click
        "1 0 1e5e5:40",
        "1 0 1.5.:40",
        "1 0 1-5:40",
        "1 0 1e:40",
        "1 0 -e5:40",
        "1 0 .e5:40",
        "1 0 1.5e-:40",
        "1 0 1e1.5:40",
        "1 0 --1:40",
        "1 0 1e999:40",
    ):
        assert line_batch._parse_plain_bytes(f"{good}\n{bad}\n".encode()) is None, bad
        assert not _good(bad), bad


@pytest.mark.parametrize("mapped", [False, True])
@pytest.mark.parametrize("block_bytes", [1, 7, 64, 1 << 20])
def test_text_chunks_cut_every_chunk_lines_lines_whatever_the_reads(tmp_path, monkeypatch, block_bytes, mapped):
    import fsspec

    from elastic_control.data import readers

    monkeypatch.setattr(readers, "READ_BLOCK_BYTES", block_bytes)
    # Mapped: the file's chunks where the mapping holds them, its last lines read as an unmapped file's.
    monkeypatch.setattr(readers, "MAP_MIN_BYTES", 0 if mapped else 1 << 62)
    rng = np.random.default_rng(block_bytes)
    lines = [_random_line(rng) for _ in range(200)]
    lines[7] = lines[8] = ""  # blank lines count as lines here (parse_lines drops them)
    fs = fsspec.filesystem("file")
    for tail in ("\n", ""):
        path = tmp_path / f"part{len(tail)}"
        path.write_bytes(("\n".join(lines) + tail).encode())
        for chunk_lines in (1, 5, 64, 199, 200, 4096):
            chunks = list(readers.read_text_chunks(fs, str(path), "part", chunk_lines))
            # Each whole lines, the file's last line given its newline when it has none.
            expected = ["\n".join(lines[i : i + chunk_lines]) + "\n" for i in range(0, len(lines), chunk_lines)]
            assert [c.data().decode() for c in chunks] == expected
            assert [(c.lines, c.colons) for c in chunks] == [(e.count("\n"), e.count(":")) for e in expected]
            assert [c.newline_added for c in chunks] == [not tail and c is chunks[-1] for c in chunks]
            expected[-1] = expected[-1][: len(expected[-1]) - (not tail)]
            assert list(readers.iter_text_blocks(fs, str(path), "part", chunk_lines)) == [e.encode() for e in expected]
            for c in chunks:  # the padding the compiled pass reads past a chunk's end
                assert len(c.buffer) >= c.end + line_batch.byte_scan.PADDING
            # Mapped, the chunks that end at least the padding before the file's end are the mapping's.
            ends = np.cumsum([c.end - c.start for c in chunks])  # in the file
            in_mapping = [mapped and end + line_batch.byte_scan.PADDING <= path.stat().st_size for end in ends]
            assert [isinstance(getattr(c.buffer.base, "obj", None), mmap.mmap) for c in chunks] == in_mapping


def test_counts_and_line_ends_take_no_byte_after_stop():
    """The compiled counts read 64 bytes at a time: a newline or colon after ``stop`` (the padding, or the
    next read's bytes) is not counted, at every offset of start and stop within and across blocks."""
    from elastic_control.data import byte_scan

    rng = np.random.default_rng(5)
    b = rng.choice(np.frombuffer(b"0:\n ", np.uint8), 300 + byte_scan.PADDING)
    for start in range(0, 70, 3):
        for stop in range(start, 300, 7):
            part = b[start:stop]
            assert byte_scan.count(b, start, stop) == ((part == 10).sum(), (part == 58).sum())
            newlines = np.flatnonzero(part == 10)
            for lines in {1, 2, max(len(newlines), 1), len(newlines) + 1}:
                got = byte_scan.chunk_end(b, start, stop, lines)
                if lines <= len(newlines):
                    end = start + newlines[lines - 1] + 1
                    assert got == (end, lines, (b[start:end] == 58).sum())
                else:
                    assert got == (-1, len(newlines), (part == 58).sum())


def test_the_byte_parse_keeps_its_lines_as_text_lines_that_behave_as_a_list():
    lines = ["1 0 5:1 2.5:40", "2 1 7:2", "3 0 9:9 -1e-3:41"]
    batch, bad = line_batch.parse_text(("\n".join(lines) + "\n").encode())
    assert not bad and isinstance(batch.lines, line_batch.TextLines)
    assert batch.lines == lines and lines == batch.lines and list(batch.lines) == lines
    assert [batch.lines[i] for i in (0, -1, np.int64(1))] == [lines[0], lines[2], lines[1]]
    assert batch.lines[1:] == lines[1:] and batch.lines[::2] == lines[::2] and len(batch.lines[5:]) == 0
    assert batch.lines + ["x"] == [*lines, "x"] and ["x"] + batch.lines == ["x", *lines]
    assert [batch.line_at(i) for i in range(3)] == lines
    order = np.array([2, 0, 1])
    assert line_batch.permute_rows(batch, order).lines == [lines[i] for i in order]
    assert line_batch.take_rows(batch, np.array([0, 2])).lines == [lines[0], lines[2]]
    assert line_batch.slice_batch(batch, 1, 3).lines == lines[1:]
    both = line_batch.concat_batches([batch, batch])
    assert isinstance(both.lines, line_batch.TextLines) and both.lines == lines * 2
    mixed = line_batch.concat_batches([batch, line_batch.parse_lines(["4 1 1:1"])[0]])
    assert mixed.lines == [*lines, "4 1 1:1"]


# Integer tokens around the grammar's bounds, digit by digit (the compiled pass reads them 8 digits at a time),
# and value tokens it does not convert itself (more than 2**53, long exponents): each alone in a line.
_BOUNDARY_TOKENS = [
    "18446744073709551615:1",  # 2**64-1
    "18446744073709551616:1",  # 2**64
    "18446744073709551625:1",
    "18446744083709551615:1",
    "28446744073709551615:1",
    "00000000000000000001:1",  # 20 digits, leading zeros
    "000000000000000000001:1",  # 21
    "99999999999999999999:1",
    "1844674407370955161:1",
    *(f"{'7' * k}:{'3' * s}" for k in range(1, 22) for s in (1, 9, 10)),
    "5:0000000001",
    "9007199254740993.0:40",  # above 2**53: the caller's float()
    "-12345678901234567890123.5:40",
    "1.5e22:40",
    "1.5e23:40",
    "4.9e-324:40",
    "1e-400:40",
    "1e400:40",
    "0e999999:40",
    "-0.0:40",
    "+.5:40",
    "123456789.123456789:40",
    "1234567.1234567:40",
    "12345678.1:40",
    "1.12345678:40",
]
_BOUNDARY_SHOWS = ["9223372036854775807", "9223372036854775808", "09223372036854775807", "0", "00", "1" * 21]


def test_tokens_at_the_grammars_bounds_parse_as_the_per_line_parser_does():
    lines = [f"1 0 {tok}" for tok in _BOUNDARY_TOKENS] + [f"{show} 1 5:1" for show in _BOUNDARY_SHOWS]
    lines += ["  1 0   5:1  6:2  ", "1  1 5:1", "1 0", "   ", "", "1 1 5:1 :1", "1 1 5: 1", "1 2 5:1", "1 01 5:1"]
    taken = refused = 0
    for line in lines:
        for text in (f"{line}\n", f"7 1 1:1\n{line}\n\n8 0 2:2\n"):
            batch, bad = line_batch.parse_text(text.encode())
            kept = [ln for ln in text.split("\n")[:-1] if ln.strip()]
            ref, ref_bad = line_batch._parse_line_by_line(kept)
            assert _rows(batch) == _rows(ref), line
            assert list(batch.lines) == list(ref.lines), line
            assert [(b.index, b.line, b.reason) for b in bad] == [(b.index, b.line, b.reason) for b in ref_bad], line
            fast = line_batch._parse_plain_bytes(text.encode())
            taken += fast is not None
            refused += fast is None and not ref_bad  # valid, but left to the older paths (a 21-digit value)
            assert fast is None or not ref_bad, line
    assert taken > 80 and refused < 5  # the compiled pass itself took the valid lines, bar a few


def test_integer_tokens_of_every_length_parse_as_the_per_line_parser_does():
    """Feasigns, slots and shows of 1 to 22 digits, and feasigns around 2**64 (the compiled pass counts a
    token's digits 32 bytes at a time and converts 16 of them at once)."""
    rng = np.random.default_rng(3)
    tokens = []
    for _ in range(400):
        digits = "".join(rng.choice(list("0123456789"), int(rng.integers(1, 23))))
        tokens.append(f"{digits}:{int(rng.integers(0, 100))}")
        tokens.append(f"{int(rng.integers(0, 100))}:{digits}")
    tokens += [f"{(1 << 64) + int(d)}:1" for d in rng.integers(-3000, 3000, 200)]
    for k in range(0, len(tokens), 7):
        line = " ".join(["1", "0", *tokens[k : k + 7]])
        fast = line_batch._parse_plain_bytes(f"{line}\n".encode())
        if _good(line):
            assert fast is not None and _rows(fast) == _rows(line_batch._parse_line_by_line([line])[0]), line
        else:
            assert fast is None, line


def _hour_data(root, text: bytes, max_bad: float = 0.5):
    import datetime as dt

    from elastic_control.config.data_config import parse_data_config
    from elastic_control.data.readers import HourlyData

    hour = dt.datetime(2020, 1, 1)
    folder = root / "20200101" / "00"
    folder.mkdir(parents=True)
    (folder / "part-00000").write_bytes(text)
    (folder / "donefile").write_text("ok\n")
    config = parse_data_config(
        f'export START_DATE_HR=20200101/00\nexport END_DATE_HR=20200101/00\nexport DATASET_PATH="{root}"\n'
        f"export MAX_BAD_LINE_FRACTION={max_bad}\n",
        env={},
    )
    data = HourlyData(config)
    (part,) = list(data.partitions())
    assert part.hour == hour
    return data, part


@pytest.mark.parametrize("threads", [2, 3])
def test_chunks_parsed_on_several_threads_come_in_order_with_their_bad_lines(tmp_path, threads):
    from elastic_control.data.readers import BadLineCounter

    rng = np.random.default_rng(threads)
    lines = [_random_line(rng) for _ in range(3000)]
    lines[10] = "1\t0\t5:1"  # the older paths, in one chunk
    data, part = _hour_data(tmp_path, ("\n".join(lines) + "\n").encode())
    results = []
    for n in (1, threads):
        data.threads = n
        counter = BadLineCounter(0.9)
        batches = list(data.iter_batches(part, counter=counter, chunk_lines=97))
        results.append(([_rows(b) for b in batches], [list(b.lines) for b in batches], counter.bad, counter.examples))
    assert results[0] == results[1]
    assert results[0][2] > 100  # random lines: many bad, counted in every chunk


def test_a_bad_line_limit_stops_a_threaded_read(tmp_path):
    from ctr_foundation.errors import DataError

    lines = ["1 0 5:1"] * 50_000 + ["garbage"] * 5_000
    data, part = _hour_data(tmp_path, ("\n".join(lines) + "\n").encode(), max_bad=0.01)
    data.threads = 2
    read = data.iter_batches(part, chunk_lines=1000)
    with pytest.raises(DataError, match="lines are malformed"):
        for _ in read:
            pass
