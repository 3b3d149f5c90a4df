"""Readers, the batch parser, the Criteo converter and the synthetic generator (no Paddle)."""

from __future__ import annotations

import datetime as dt
import gzip

import numpy as np
import pytest
from helpers_common import CRITEO_FILE
from helpers_train import START

from ctr_foundation.errors import DataError
from ctr_foundation.sample import parse_sample_line, slot_keys
from elastic_control.config.data_config import parse_data_config
from elastic_control.data.line_batch import (
    batch_keys,
    concat_batches,
    parse_lines,
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
