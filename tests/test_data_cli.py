"""`elastic-control data criteo` and `elastic-control data synth` as a user runs them (real processes)."""

from __future__ import annotations

import itertools
import json
import math

import pytest
from helpers_common import CRITEO_FILE, run_cli

from elastic_control.config.data_config import parse_hour
from elastic_control.config.slot_conf import load_slot_conf
from elastic_control.data.readers import HOUR_DONEFILE
from elastic_control.data.synth import read_truth
from elastic_control.metrics import auc


def _hour_lines(folder):
    return [ln for p in sorted(folder.glob("part-*")) for ln in p.read_text().splitlines() if ln.strip()]


@pytest.mark.needs_criteo
def test_criteo_converts_a_few_hundred_real_lines_into_sealed_hours(tmp_path):
    raw = tmp_path / "raw.tsv"
    with open(CRITEO_FILE, encoding="utf-8") as f:
        raw.write_text("".join(itertools.islice(f, 300)))
    r = run_cli("data", "criteo", "--input", raw, "--output", tmp_path / "data", "--hours", 3, "--start", "20200101/22")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["lines"] == 300 and summary["bad_lines"] == 0 and summary["lines_per_hour"] == 100
    assert summary["slots"] == list(range(1, 40))
    # Hours run across midnight; each hour is complete only with its donefile.
    folders = [tmp_path / "data" / d for d in ("20200101/22", "20200101/23", "20200102/00")]
    for folder in folders:
        assert (folder / HOUR_DONEFILE).exists()
        lines = _hour_lines(folder)
        assert len(lines) == 100
        for line in lines[:5]:
            show, click, *features = line.split()
            sparse = [f for f in features if int(f.split(":")[1]) < 40]
            assert show == "1" and click in ("0", "1") and len(sparse) == 39
            assert {int(f.split(":")[1]) for f in sparse} == set(range(1, 40))
    # Each present integer feature also as a number, log(1 + v), in dense slot 39 + k.
    raw_first = raw.read_text().splitlines()[0].split("\t")
    first = _hour_lines(folders[0])[0].split()[2:]
    dense = {int(s): float(v) for v, s in (f.split(":") for f in first) if int(s) >= 40}
    want = {39 + k: math.log1p(int(t)) for k, t in enumerate(raw_first[1:14], start=1) if t and int(t) >= 0}
    assert dense.keys() == want.keys() and all(abs(dense[s] - want[s]) < 1e-5 * max(1, want[s]) for s in want)
    conf = load_slot_conf(summary["slot_conf"])
    assert conf.slots == tuple(range(1, 40)) and conf.dense == tuple(range(40, 53)) == tuple(summary["dense_slots"])
    feasigns = [
        int(f.split(":")[0]) for ln in _hour_lines(folders[0]) for f in ln.split()[2:] if int(f.split(":")[1]) < 40
    ]
    assert max(feasigns) > 2**63  # full 64-bit hashes
    assert sum(int(ln.split()[1]) for folder in folders for ln in _hour_lines(folder)) == round(summary["ctr"] * 300)


def test_criteo_refuses_missing_and_foreign_input_in_one_line(tmp_path):
    r = run_cli("data", "criteo", "--input", tmp_path / "nope.tsv", "--output", tmp_path / "out")
    assert r.returncode == 1 and "input file not found" in r.stderr and "Traceback" not in r.stderr
    foreign = tmp_path / "foreign.tsv"
    foreign.write_text("not\ta\tcriteo\tline\n" * 10)
    r = run_cli("data", "criteo", "--input", foreign, "--output", tmp_path / "out")
    assert r.returncode == 1 and "not raw Criteo" in r.stderr and "foreign.tsv:1" in r.stderr
    assert not (tmp_path / "out").exists()  # nothing half-written
    r = run_cli("data", "criteo", "--input", foreign, "--output", tmp_path / "out", "--start", "2020-01-01")
    assert r.returncode == 2 and "YYYYMMDD/HH" in r.stderr


def test_synth_writes_hours_with_their_truth_and_reports_the_bayes_auc(tmp_path):
    slot_conf = tmp_path / "slot.conf"
    slot_conf.write_text("3\n7\n")
    out = tmp_path / "data"
    argv = ["data", "synth", "--output", out, "--hours", 2, "--lines-per-hour", 3000, "--seed", 4, "-s", slot_conf]
    r = run_cli(*argv, "--start", "20200101/00", "--gz")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["hours"] == 2 and summary["lines"] == 6000 and summary["start"] == "20200101/00"
    lines, truth = [], []
    for hour in ("00", "01"):
        folder = out / "20200101" / hour
        assert (folder / HOUR_DONEFILE).exists() and list(folder.glob("part-*.gz"))
        hour_lines, hour_truth = read_truth(folder)
        lines += hour_lines
        truth.extend(hour_truth)
    assert {int(f.split(":")[1]) for ln in lines for f in ln.split()[2:]} == {3, 7}
    clicks = [int(ln.split()[1]) for ln in lines]
    assert summary["bayes_auc"] == pytest.approx(auc(clicks, truth), abs=1e-9)
    assert 0.6 < summary["bayes_auc"] < 0.95
    # Deterministic for a seed.
    again = run_cli(*argv[:3], tmp_path / "again", *argv[4:], "--start", "20200101/00", "--gz")
    assert json.loads(again.stdout) == summary
    assert parse_hour(summary["start"]).hour == 0
