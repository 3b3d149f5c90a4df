"""Readers, the batch parser, the Criteo converter and the synthetic generator (no Paddle)."""

from __future__ import annotations

import datetime as dt
import gzip

import numpy as np
import pytest
from helpers_common import CRITEO_FILE
from helpers_train import START

from ctr_foundation.errors import DataError
from ctr_foundation.sample import MalformedLine, parse_sample_line, slot_keys
from elastic_control.config.data_config import parse_data_config
from elastic_control.data import line_batch
from elastic_control.data.line_batch import (
    LineBatch,
    batch_dense,
    batch_keys,
    concat_batches,
    parse_lines,
    permute_rows,
    slice_batch,
    take_rows,
)
from elastic_control.data.readers import BadLineCounter, HourlyData

BIG = (1 << 64) - 5  # a feasign above 2**63


def _config(root, *, hours=2, extra=""):
    end = START + dt.timedelta(hours=hours - 1)
    return parse_data_config(
        f"export START_DATE_HR={START:%Y%m%d/%H}\nexport END_DATE_HR={end:%Y%m%d/%H}\n"
        f'export DATASET_PATH="{root}"\n{extra}',
        env={},
    )


def _write_hour(root, hour, files: dict[str, bytes], done=True):
    folder = root / f"{hour:%Y%m%d}" / f"{hour:%H}"
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    if done:
        (folder / "donefile").write_text("ok\n")
    return folder


def _lines(n, click=1, slot_base=0):
    return [f"1 {click} {i + 1}:{slot_base + 1} {BIG - i}:{slot_base + 2}" for i in range(n)]


def _read_all(data: HourlyData, **kw):
    out = []
    for part in data.partitions():
        for b in data.iter_batches(part, **kw):
            out.extend(b.line_at(i) for i in range(len(b)))
    return out


def test_vectorised_parse_matches_the_reference_parser():
    lines = [
        "1 0 17241709254077376921:0 132683728328325035:1",
        "1 1",
        "3 1 5:2 5:2 18446744073709551615:7",
        f"1 0 {BIG}:4",
    ]
    batch, bad = parse_lines(lines)
    assert not bad and len(batch) == 4
    for i, ln in enumerate(lines):
        ref = parse_sample_line(ln)
        lo, hi = np.searchsorted(batch.feature_line, [i, i + 1])
        assert batch.feasigns[lo:hi].tolist() == list(ref.feasigns)
        assert batch.feature_slots[lo:hi].tolist() == list(ref.slots)
        assert (batch.shows[i], batch.clicks[i]) == (ref.show, ref.click)


def test_uint64_feasigns_above_2_63_and_overflow_is_bad():
    batch, bad = parse_lines([f"1 1 {BIG}:3", "1 0 18446744073709551616:3"])
    assert batch.feasigns.tolist() == [BIG]
    assert len(bad) == 1 and "unsigned 64-bit" in bad[0].reason


def test_batch_keys_follow_the_padding_rule_of_slot_keys():
    # Keys of a slot interleaved with other slots' and an unknown slot's (9) keep their order of appearance.
    lines = ["1 0 7:1 8:1 9:3", "1 1 10:2", "1 0", "1 1 11:9 12:3", "1 0 13:1 14:3 15:1 16:9 17:1"]
    slots = (3, 1, 2)
    batch, _ = parse_lines(lines)
    for sparse_dim in (None, 5):
        keys, lengths = batch_keys(batch, slots, sparse_dim)
        assert len(lengths) == len(slots) * len(lines)  # one sequence per slot and line, slot after slot
        ends = np.cumsum(lengths)
        for i, ln in enumerate(lines):
            ref = slot_keys(parse_sample_line(ln), slots, sparse_dim)
            for j in range(len(slots)):
                cell = j * len(lines) + i
                assert keys[ends[cell] - lengths[cell] : ends[cell]].tolist() == ref[j].tolist()


def test_sparse_dim_modulo_on_full_uint64_keys():
    batch, _ = parse_lines([f"1 0 {BIG}:1"])
    keys, _ = batch_keys(batch, (1,), 1000003)
    assert keys.tolist() == [BIG % 1000003]


def test_slice_concat_take_keep_lines_and_features_together():
    batch, _ = parse_lines(_lines(10))
    again = concat_batches([slice_batch(batch, 0, 3), slice_batch(batch, 3, 10)])
    assert again.lines == batch.lines and again.feasigns.tolist() == batch.feasigns.tolist()
    picked = take_rows(batch, np.array([1, 7]))
    assert picked.lines == [batch.lines[1], batch.lines[7]]
    assert picked.feature_line.tolist() == [0, 0, 1, 1]


# Dense slots of the value-token tests; integer tokens land in them too (a dense slot's value as well).
DENSE = (40, 41, 42)
# Value tokens' numbers in every syntax the format allows: sign, point on either side, exponent, many
# digits (the conversion must round as float() does), subnormal and near-overflow magnitudes.
VALUE_FORMS = (
    "2.5", "-3", "+4", ".5", "5.", "1e5", "-1.5E-3", "+.5e+2", "-0", "0.0", "1E+300", "-2.5e-310",
    "3.14159265358979323846264338327950288", "1.7976931348623157e308", "-.000000000000000000001",
)  # fmt: skip


def _random_token(rng) -> str:
    slot = int(rng.choice([*DENSE, 1, 2, 7, 123456789]))
    kind = rng.integers(0, 4)
    if kind == 0:
        feasign = rng.choice(["0", "7", "007", str(BIG), str(1 << 63), str(int(rng.integers(0, 1 << 62)))])
        return f"{feasign}:{slot}"
    if kind == 1:
        return f"{rng.choice(VALUE_FORMS)}:{slot}"
    x = float(rng.standard_normal() * 10.0 ** int(rng.integers(-8, 9)))
    return f"{rng.choice([repr(x), f'{x:.6g}', f'{x:e}'])}:{slot}"


def _random_line(rng) -> str:
    head = f"{rng.integers(0, 4)} {rng.integers(0, 2)}"
    toks = [_random_token(rng) for _ in range(int(rng.integers(0, 9)))]
    sep = rng.choice([" ", "\t", "  "])
    return sep.join([head, *toks]) + rng.choice(["", " ", "\r"])


def _rows(batch: LineBatch):
    """Each line of a batch read back from its columns: (show, click, [(feasign, slot)], [(value, slot)])."""
    # Both per-item columns are stored line after line: the searchsorted below relies on it.
    assert (np.diff(batch.feature_line) >= 0).all() and (np.diff(batch.value_line) >= 0).all()
    out = []
    for i in range(len(batch)):
        lo, hi = np.searchsorted(batch.feature_line, [i, i + 1])
        vlo, vhi = np.searchsorted(batch.value_line, [i, i + 1])
        feats = list(zip(batch.feasigns[lo:hi].tolist(), batch.feature_slots[lo:hi].tolist(), strict=True))
        vals = list(zip(batch.values[vlo:vhi].tolist(), batch.value_slots[vlo:vhi].tolist(), strict=True))
        out.append((int(batch.shows[i]), int(batch.clicks[i]), feats, vals))
    return out


def _reference_row(line: str):
    s = parse_sample_line(line)
    return (
        s.show,
        s.click,
        list(zip(s.feasigns, s.slots, strict=True)),
        list(zip(s.values, s.value_slots, strict=True)),
    )


def test_value_tokens_fast_path_matches_the_reference_parser_on_random_lines(monkeypatch):
    # Valid chunks must take the vectorised path: without this the comparison could pass vacuously, both
    # sides being the reference parser.
    def refuse(lines):
        raise AssertionError(f"a valid chunk fell back to the per-line parser: {lines[:3]}")

    per_line = line_batch._parse_line_by_line  # the reference, column by column, for batch_dense
    monkeypatch.setattr(line_batch, "_parse_line_by_line", refuse)
    rng = np.random.default_rng(20261205)
    for _ in range(200):
        lines = [_random_line(rng) for _ in range(int(rng.integers(1, 40)))]
        batch, bad = parse_lines(lines)
        assert not bad
        assert _rows(batch) == [_reference_row(ln) for ln in lines]
        assert batch.lines == [ln.rstrip("\r") for ln in lines]
        reference, _ = per_line([ln.rstrip("\r") for ln in lines])
        np.testing.assert_array_equal(batch_dense(batch, DENSE), batch_dense(reference, DENSE))


def test_value_tokens_with_bad_lines_keep_the_good_lines_of_the_chunk():
    rng = np.random.default_rng(7)
    lines = [_random_line(rng) for _ in range(30)]
    lines[4] = "1 1 2.5:40 oops"
    lines[17] = "not a line"
    batch, bad = parse_lines(lines)
    assert [b.index for b in bad] == [4, 17]
    good = [ln for i, ln in enumerate(lines) if i not in (4, 17)]
    assert _rows(batch) == [_reference_row(ln) for ln in good]


@pytest.mark.parametrize("token", ["1.2.3:40", "nan:40", "inf:40", "-inf:40", "1e999:40", "x:3", "2.5:x", "1_0.5:40"])
def test_bad_value_tokens_make_their_line_bad_naming_the_token(token):
    lines = ["1 0 3:1 2.5:40", f"1 1 5:1 {token} -1:41", "2 1 .5e1:42 9:2"]
    batch, bad = parse_lines(lines)
    assert len(bad) == 1 and bad[0].index == 1 and repr(token) in bad[0].reason
    assert _rows(batch) == [(1, 0, [(3, 1)], [(2.5, 40)]), (2, 1, [(9, 2)], [(5.0, 42)])]


@pytest.mark.parametrize("line", ["2.5:3 1 1 4:5", "1 2.5:3 1 4:5", "1 -1:2 0"])
def test_value_token_in_the_show_or_click_position_is_a_bad_line(line):
    with pytest.raises(MalformedLine):
        parse_sample_line(line)  # the reference
    batch, bad = parse_lines([line, "1 1 0.5:9"])
    assert [b.index for b in bad] == [0] and len(batch) == 1


def _with_values(n: int, seed: int = 3) -> list[str]:
    """Lines whose value tokens differ from line to line (empty lines of values included)."""
    rng = np.random.default_rng(seed)
    return [
        f"1 {i % 2} {i + 1}:1 " + " ".join(f"{i}.{j}5:{40 + j}" for j in range(int(rng.integers(0, 4))))
        for i in range(n)
    ]


def test_slice_concat_take_permute_keep_each_lines_values_with_it():
    lines = _with_values(12)
    batch, _ = parse_lines(lines)
    rows = _rows(batch)
    assert batch.has_values and rows == [_reference_row(ln) for ln in lines]
    parquet_like = LineBatch(**{**vars(batch), "lines": None})  # columns only: line_at rebuilds the text
    for b in (batch, parquet_like):
        again = concat_batches([slice_batch(b, 0, 5), slice_batch(b, 5, 5), slice_batch(b, 5, 12)])
        assert _rows(again) == rows
        picked = take_rows(b, np.array([0, 3, 4, 11]))
        assert _rows(picked) == [rows[i] for i in (0, 3, 4, 11)]
        order = np.random.default_rng(1).permutation(len(b))
        shuffled = permute_rows(b, order)
        assert _rows(shuffled) == [rows[i] for i in order]
        # line_at follows the rows too, whether it returns the raw line or rebuilds it
        assert [_reference_row(shuffled.line_at(i)) for i in range(len(b))] == [rows[i] for i in order]


def test_line_at_rebuilds_value_tokens_that_parse_back_to_the_same_floats():
    values = [0.1, -3.0, 1e-300, 5e-324, 1.7976931348623157e308, -0.0, 1e16, 123456789.123456789, 2.5]
    text, _ = parse_lines([f"1 1 7:1 {v!r}:{40 + i % 3}" for i, v in enumerate(values)] + ["0 0"])
    columns_only = LineBatch(**{**vars(text), "lines": None})
    rebuilt = [columns_only.line_at(i) for i in range(len(columns_only))]
    assert rebuilt[-1] == "0 0"
    again, bad = parse_lines(rebuilt)
    assert not bad and _rows(again) == _rows(text)
    assert again.values.tolist() == values  # bit for bit: repr round-trips a float64


# Tokens for the whole-chunk parse's differential test: the plain layout, and every way out of it.
_FUZZ_FEATURES = (
    "7:1", "007:2", f"{BIG}:3", f"{(1 << 64) - 1}:4", "0:0", "18446744073709551616:5", "0018446744073709551615:6",
    "000000000000000000001:1", "2.5:40", "-3:41", "+.5e+2:42", "1e5:40", "-0:41", "1e999:40", "1.2.3:40",
    "e5:40", ".:40", "5:", ":5", "5::6", "5:6:7", "5:-6", "5:+6", "x:3", "\u00e95:1",
)  # fmt: skip


def _fuzz_line(rng) -> str:
    show = str(rng.choice(["1", "0", "3", "007"] * 10 + ["-1", "x"]))
    click = str(rng.choice(["0", "1"] * 10 + ["00", "2", "1.0"]))
    # Mostly tokens the fast path takes (integers and good values), so that many chunks stay in the plain layout.
    good = _FUZZ_FEATURES[:5] + _FUZZ_FEATURES[8:13]
    toks = [str(rng.choice(good if rng.random() < 0.97 else _FUZZ_FEATURES)) for _ in range(int(rng.integers(0, 7)))]
    line = " ".join([show, click, *toks][: int(rng.integers(0, 3)) if rng.random() < 0.05 else None])
    if rng.random() < 0.05:
        line = str(rng.choice(["", "   ", "\t", " " + line, line + " ", line.replace(" ", "  ", 1)]))
    return line


def test_whole_chunk_parse_matches_the_older_paths_on_random_chunks(monkeypatch):
    # The reference is parse_lines without the whole-chunk parse: what the reader counted and kept before it.
    plain = line_batch._parse_plain_bytes
    rng = np.random.default_rng(5)
    cases = []
    for _ in range(600):
        lines = [_fuzz_line(rng) for _ in range(int(rng.integers(1, 12)))]
        text = "\n".join(lines) + str(rng.choice(["\n", ""]))
        cases.append((lines, text, line_batch.parse_text(text.encode())))
    monkeypatch.setattr(line_batch, "_parse_plain_bytes", lambda data, lines=None: None)
    fast = 0
    for lines, text, (batch, bad) in cases:
        ref, ref_bad = parse_lines(lines)
        assert _rows(batch) == _rows(ref), lines
        assert batch.lines == ref.lines
        assert [(b.index, b.reason) for b in bad] == [(b.index, b.reason) for b in ref_bad]
        accepted = plain(text.encode() + b"\n")
        if accepted is not None:  # and what the fast path accepts, the per-line parser reads the same
            fast += 1
            assert _rows(accepted) == [_reference_row(ln) for ln in lines if ln.strip()]
    assert fast > 100  # the comparison covers the fast path, not only the fallbacks


def test_plain_chunks_take_the_whole_chunk_parse(monkeypatch):
    def refuse(*args):
        raise AssertionError("a plain chunk took an older path")

    monkeypatch.setattr(line_batch, "_parse_line_by_line", refuse)
    monkeypatch.setattr(line_batch, "_parse_valid_chunk", refuse)
    monkeypatch.setattr(line_batch, "_parse_chunk_with_values", refuse)
    lines = _lines(50) + ["1 0", "2 1 2.5:40 7:1 -1e-3:41", f"0 0 {(1 << 64) - 1}:3"]
    batch, bad = line_batch.parse_text(("\n".join(lines[:20]) + "\n\n  \n" + "\n".join(lines[20:])).encode())
    assert not bad and batch.lines == lines
    assert _rows(batch) == [_reference_row(ln) for ln in lines]
    assert _rows(parse_lines(lines)[0]) == _rows(batch)


@pytest.mark.parametrize("chunk_lines", [1, 3, 7, 4096])
def test_text_blocks_are_the_files_lines(tmp_path, monkeypatch, chunk_lines):
    import fsspec

    from elastic_control.data import readers

    monkeypatch.setattr(readers, "READ_BLOCK_BYTES", 16)  # lines cut across reads
    lines = _lines(23) + ["", "1 0 5:1\r", "bad line", "\u00e9 1 0"]
    fs = fsspec.filesystem("file")
    for name, tail in (("plain", "\n"), ("no-newline", ""), ("gz.gz", "\n")):
        path = tmp_path / name
        data = ("\n".join(lines) + tail).encode()
        path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
        chunks = list(readers.iter_text_chunks(fs, str(path), name, chunk_lines))
        blocks = list(readers.iter_text_blocks(fs, str(path), name, chunk_lines))
        assert [len(c) for c in chunks] == [b.count(b"\n") + (not b.endswith(b"\n")) for b in blocks]
        assert b"".join(blocks).decode() == "".join(ln for c in chunks for ln in c)
        for c, b in zip(chunks, blocks, strict=True):
            assert _rows(parse_lines(c)[0]) == _rows(line_batch.parse_text(b)[0])


def test_plain_and_gz_text_hours_and_trainer_split(tmp_path):
    lines = _lines(40)
    _write_hour(
        tmp_path,
        START,
        {
            "part-00000": ("\n".join(lines[:20]) + "\n").encode(),
            "part-00001.gz": gzip.compress(("\n".join(lines[20:]) + "\n").encode()),
        },
    )
    _write_hour(tmp_path, START + dt.timedelta(hours=1), {"part-00000": ("\n".join(lines[:3]) + "\n").encode()})
    data = HourlyData(_config(tmp_path))
    assert sorted(_read_all(data)) == sorted(lines + lines[:3])
    # Two trainers: whole files in hour 0 (2 files), every other line in hour 1 (1 file); no line twice.
    shares = [_read_all(data, trainer_id=r, trainers=2) for r in range(2)]
    assert sorted(shares[0] + shares[1]) == sorted(lines + lines[:3])
    assert shares[0][:20] == lines[:20] and shares[1][:20] == lines[20:]


def test_parquet_hours(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = _write_hour(tmp_path, START, {}, done=False)
    table = pa.table(
        {
            "click": pa.array([1, 0, 5], pa.int8()),
            "feasigns": pa.array([[BIG, 3], [4], [1]], pa.list_(pa.uint64())),
            "slots": pa.array([[1, 2], [1], [1]], pa.list_(pa.int32())),
        }
    )
    pq.write_table(table, folder / "part-00000.parquet")
    (folder / "donefile").write_text("")
    data = HourlyData(
        _config(tmp_path, hours=1, extra='export DATA_FORMAT="parquet"\nexport MAX_BAD_LINE_FRACTION=0.5\n')
    )
    counter = BadLineCounter(0.5)
    (part,) = list(data.partitions())
    batches = list(data.iter_batches(part, counter=counter))
    assert [b.line_at(i) for b in batches for i in range(len(b))] == [f"1 1 {BIG}:1 3:2", "1 0 4:1"]
    assert counter.bad == 1  # click=5


def _value_table(lines, *, value_type=None):
    """The Parquet form of slot-format lines: one row per line, value tokens in values/value_slots."""
    import pyarrow as pa

    samples = [parse_sample_line(ln) for ln in lines]
    return pa.table(
        {
            "show": pa.array([s.show for s in samples], pa.int64()),
            "click": pa.array([s.click for s in samples], pa.int8()),
            "feasigns": pa.array([list(s.feasigns) for s in samples], pa.list_(pa.uint64())),
            "slots": pa.array([list(s.slots) for s in samples], pa.list_(pa.int32())),
            "values": pa.array([list(s.values) for s in samples], pa.list_(value_type or pa.float64())),
            "value_slots": pa.array([list(s.value_slots) for s in samples], pa.list_(pa.int64())),
        }
    )


def _read_parquet(root, table, *, chunk_lines=4096, counter=None, **kw) -> LineBatch:
    """Write ``table`` as an hour's one Parquet file and read it back through HourlyData, as training does."""
    import pyarrow.parquet as pq

    folder = _write_hour(root, START, {}, done=False)
    pq.write_table(table, folder / "part-00000.parquet", row_group_size=max(1, len(table) // 3))
    (folder / "donefile").write_text("")
    data = HourlyData(_config(root, hours=1, extra='export DATA_FORMAT="parquet"\n'))
    (part,) = list(data.partitions())
    return concat_batches(list(data.iter_batches(part, chunk_lines=chunk_lines, counter=counter, **kw)))


def _same_columns(a: LineBatch, b: LineBatch) -> None:
    for col in ("shows", "clicks", "feature_line", "feasigns", "feature_slots", "value_line", "value_slots", "values"):
        got, want = getattr(a, col), getattr(b, col)
        assert got.dtype == want.dtype and got.tolist() == want.tolist(), col


def test_parquet_values_read_as_the_text_parse_of_the_same_lines(tmp_path):
    rng = np.random.default_rng(11)
    lines = [ln.rstrip("\r") for ln in (_random_line(rng) for _ in range(50))]
    # Small record batches: the values of each must stay with its rows, across batch boundaries.
    text, _ = parse_lines(lines)
    for chunk_lines in (7, 4096):
        got = _read_parquet(tmp_path / str(chunk_lines), _value_table(lines), chunk_lines=chunk_lines)
        assert got.lines is None and got.has_values
        _same_columns(got, text)
        np.testing.assert_array_equal(batch_dense(got, DENSE), batch_dense(text, DENSE))
        # line_at rebuilds lines that parse back to the same columns
        again, bad = parse_lines([got.line_at(i) for i in range(len(got))])
        assert not bad
        _same_columns(again, text)
    # float32 values are read as float64 (exactly)
    import pyarrow as pa

    narrow = _read_parquet(tmp_path / "f32", _value_table(["1 1 3:1 2.5:40 -0.125:41"], value_type=pa.float32()))
    assert narrow.values.dtype == np.float64 and narrow.values.tolist() == [2.5, -0.125]


def test_parquet_values_of_bad_rows_are_dropped_with_their_rows(tmp_path):
    import pyarrow as pa

    lines = _with_values(9)
    table = _value_table(lines)
    clicks = table.column("click").to_pylist()
    clicks[2] = clicks[6] = 5  # bad rows (counted as bad lines); their values must not shift onto others
    table = table.set_column(table.schema.get_field_index("click"), "click", pa.array(clicks, pa.int8()))
    counter = BadLineCounter(0.5)
    got = _read_parquet(tmp_path, table, chunk_lines=4, counter=counter)
    assert counter.bad == 2
    assert _rows(got) == [_reference_row(ln) for i, ln in enumerate(lines) if i not in (2, 6)]


def test_parquet_values_split_between_trainers_by_line(tmp_path):
    # One file, two trainers: each keeps every other line (slice_batch/concat_batches), values included.
    lines = _with_values(11)
    table = _value_table(lines)
    shares = [_rows(_read_parquet(tmp_path / str(r), table, trainer_id=r, trainers=2)) for r in range(2)]
    want = [_reference_row(ln) for ln in lines]
    assert shares[0] == want[0::2] and shares[1] == want[1::2]


def test_parquet_without_value_columns_is_unchanged(tmp_path):
    import pyarrow as pa

    lines = _lines(5)
    table = _value_table(lines).drop_columns(["values", "value_slots"])
    got = _read_parquet(tmp_path, table, chunk_lines=2)
    assert not got.has_values and got.value_line.dtype == np.int64 and got.values.dtype == np.float64
    _same_columns(got, parse_lines(lines)[0])
    assert [got.line_at(i) for i in range(len(got))] == lines
    assert batch_dense(got, DENSE).shape == (5, 3) and np.isnan(batch_dense(got, DENSE)).all()
    # A null values list is a row without values (as a row without value tokens)
    nulls = _value_table(["1 1 3:1", "1 0 4:1 2.5:40"])
    nulls = nulls.set_column(
        nulls.schema.get_field_index("values"), "values", pa.array([None, [2.5]], pa.list_(pa.float64()))
    )
    nulls = nulls.set_column(
        nulls.schema.get_field_index("value_slots"), "value_slots", pa.array([None, [40]], pa.list_(pa.int64()))
    )
    assert _rows(_read_parquet(tmp_path / "nulls", nulls)) == [(1, 1, [(3, 1)], []), (1, 0, [(4, 1)], [(2.5, 40)])]


def _replace(table, name, values, type_):
    import pyarrow as pa

    return table.set_column(table.schema.get_field_index(name), name, pa.array(values, type_))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: t.drop_columns(["value_slots"]), r"column 'values' without 'value_slots'"),
        (lambda t: t.drop_columns(["values"]), r"column 'value_slots' without 'values'"),
        ("lengths", r"row 5: 2 values but 1 value_slots \(one slot per value\)"),
        ("nan", r"row 5: value nan in 'values' is not finite"),
        ("inf", r"row 5: value -inf in 'values' is not finite"),
        ("null", r"row 5: a null inside 'values'"),
        ("negative", r"row 5: value slot -40 is negative"),
        ("strings", r"column 'values' is list<\w+: string>, expected a list of numbers"),
        ("float slots", r"column 'value_slots' is list<\w+: double>, expected a list of integers"),
    ],
)
def test_parquet_value_column_errors_name_the_file_and_row(tmp_path, change, message):
    import pyarrow as pa

    lines = [f"1 {i % 2} {i + 1}:1 {i}.5:40 -{i}:41" for i in range(8)]
    table = _value_table(lines)
    values = table.column("values").to_pylist()
    slots = table.column("value_slots").to_pylist()
    if change == "lengths":
        slots[5], slots[7] = [40], [40]
        table = _replace(table, "value_slots", slots, pa.list_(pa.int64()))
    elif change in ("nan", "inf", "null"):
        values[5][1] = {"nan": float("nan"), "inf": float("-inf"), "null": None}[change]
        table = _replace(table, "values", values, pa.list_(pa.float64()))
    elif change == "negative":
        slots[5][0] = -40
        table = _replace(table, "value_slots", slots, pa.list_(pa.int64()))
    elif change == "strings":
        table = _replace(table, "values", [[str(v) for v in row] for row in values], pa.list_(pa.string()))
    elif change == "float slots":
        table = _replace(table, "value_slots", slots, pa.list_(pa.float64()))
    else:
        table = change(table)
    # chunk_lines=3: row 5 is in the second record batch; the message gives its row in the file.
    with pytest.raises(DataError, match=r"part-00000\.parquet: .*" + message):
        _read_parquet(tmp_path, table, chunk_lines=3)


def test_missing_hour_offline_is_skipped_with_a_warning(tmp_path):
    _write_hour(tmp_path, START + dt.timedelta(hours=1), {"part-00000": b"1 1 5:1\n"})
    _write_hour(tmp_path, START, {"part-00000": b"1 1 5:1\n"}, done=False)  # no donefile: incomplete
    warnings = []
    data = HourlyData(_config(tmp_path), warn=warnings.append)
    assert [p.hour for p in data.partitions()] == [START + dt.timedelta(hours=1)]
    assert "20191221/00 is missing" in warnings[0]


def test_missing_hour_online_waits_then_times_out(tmp_path):
    cfg = _config(tmp_path, extra='export ONLINE="1"\n')
    _write_hour(tmp_path, START, {"part-00000": b"1 1 5:1\n"})
    sleeps = []
    data = HourlyData(cfg, wait_timeout=0.3, poll_seconds=0.05, warn=lambda m: None, sleep=sleeps.append)
    parts = data.partitions()
    assert next(parts).hour == START
    with pytest.raises(DataError, match=r"20191221/01: no donefile .* after waiting"):
        # Fake sleep never advances the clock: use the real one for the timeout.
        data._sleep = __import__("time").sleep
        next(parts)


def test_online_wait_returns_when_the_donefile_appears(tmp_path):
    cfg = _config(tmp_path, hours=1, extra='export ONLINE="1"\n')
    folder = _write_hour(tmp_path, START, {"part-00000": b"1 1 5:1\n"}, done=False)

    def sleep(_):
        (folder / "donefile").write_text("")

    data = HourlyData(cfg, wait_timeout=30, poll_seconds=0.01, warn=lambda m: None, sleep=sleep)
    assert next(data.partitions()).hour == START


def test_malformed_lines_under_and_over_the_threshold(tmp_path):
    good = _lines(99)
    _write_hour(tmp_path, START, {"part-00000": ("\n".join(good + ["garbage line"]) + "\n").encode()})
    data = HourlyData(_config(tmp_path, hours=1, extra="export MAX_BAD_LINE_FRACTION=0.02\n"))
    counter = BadLineCounter(0.02)
    assert len(_read_all(data, counter=counter)) == 99 and counter.bad == 1
    strict = HourlyData(_config(tmp_path, hours=1, extra="export MAX_BAD_LINE_FRACTION=0.001\n"))
    with pytest.raises(DataError, match=r"1 of 100 lines are malformed .*MAX_BAD_LINE_FRACTION=0.001"):
        _read_all(strict)


@pytest.mark.parametrize(
    "line, reason",
    [
        (f"{1 << 63} 1 5:1", "show 9223372036854775808 is above 2**63-1"),
        (f"1 1 5:{1 << 63}", "slot 9223372036854775808 has more than 9 digits"),
        (f"1 1 2.5:{(1 << 64) + 1}", "slot 18446744073709551617 has more than 9 digits"),
        ("99999999999999999999 0 5:1", "show 99999999999999999999 is above 2**63-1"),
    ],
)
def test_a_show_or_slot_beyond_int64_is_a_malformed_line_not_an_overflow(tmp_path, line, reason):
    # These raised OverflowError out of the reader (numpy's int64 columns); now the line is counted and named.
    _write_hour(tmp_path, START, {"part-00000": ("\n".join(_lines(3) + [line]) + "\n").encode()})
    counter = BadLineCounter(1.0)
    assert len(_read_all(HourlyData(_config(tmp_path, hours=1)), counter=counter)) == 3 and counter.bad == 1
    assert reason in counter.examples[0] and repr(line) in counter.examples[0]
    strict = HourlyData(_config(tmp_path, hours=1, extra="export MAX_BAD_LINE_FRACTION=0.001\n"))
    with pytest.raises(DataError, match="1 of 4 lines are malformed"):
        _read_all(strict)


def test_unsupported_filesystem_is_a_clear_error(tmp_path):
    # s3:// works without s3fs (pyarrow's S3 client, tests/test_kube_s3.py); gs:// needs gcsfs, not installed.
    cfg = parse_data_config(
        'export START_DATE_HR=20191221/00\nexport END_DATE_HR=20191221/00\nexport DATASET_PATH="gs://bucket/logs"\n',
        env={},
    )
    with pytest.raises(DataError, match=r"cannot open gs://bucket/logs: no driver for gs:// \(pip install gcsfs\)"):
        HourlyData(cfg)


def test_synthetic_generator_is_deterministic_and_knows_its_bayes_auc(tmp_path):
    from elastic_control.data.synth import generate, read_truth
    from elastic_control.metrics import auc

    a = generate(tmp_path / "a", slots=(1, 2, 3), hours=2, lines_per_hour=3000, seed=5, start=START)
    b = generate(tmp_path / "b", slots=(1, 2, 3), hours=2, lines_per_hour=3000, seed=5, start=START)
    assert a == b and 0.6 < a["bayes_auc"] < 0.99
    lines, prob = read_truth(tmp_path / "a" / "20191221" / "01")
    assert lines == read_truth(tmp_path / "b" / "20191221" / "01")[0]
    labels = np.array([int(ln.split()[1]) for ln in lines])
    assert auc(labels, prob) > 0.6
    feas = parse_lines(lines)[0].feasigns
    assert (feas > np.uint64(1 << 63)).any()


def test_criteo_converter(tmp_path):
    from elastic_control.data.criteo import CriteoConverter, convert_file

    conv = CriteoConverter()
    raw = "1\t5\t\t-1" + "\t3" * 10 + "\t68fd1e64" * 25 + "\t"
    line = conv.convert_line(raw)
    sample = parse_sample_line(line)
    assert sample.click == 1 and sample.slots == tuple(range(1, 40))
    assert conv.convert_line(raw) == line  # stable hashes
    with pytest.raises(ValueError, match="fields"):
        conv.convert_line("1\t2")
    src = tmp_path / "raw.txt"
    src.write_text(raw + "\n" + raw.replace("1", "0", 1) + "\n" + raw + "\n")
    summary = convert_file(src, tmp_path / "out", hours=2, start=START)
    assert summary["lines"] == 3 and (tmp_path / "out" / "20191221" / "01" / "donefile").exists()


@pytest.mark.needs_criteo
def test_criteo_real_lines_convert_with_feasigns_above_2_63(tmp_path):
    from elastic_control.data.criteo import CriteoConverter

    conv = CriteoConverter()
    with open(CRITEO_FILE) as f:
        lines = [conv.convert_line(next(f)) for _ in range(2000)]
    batch, bad = parse_lines(lines)
    assert not bad and len(batch) == 2000
    assert (batch.feasigns > np.uint64(1 << 63)).mean() > 0.3
