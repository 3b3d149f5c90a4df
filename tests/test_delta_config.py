"""Incremental rollouts without a parameter server: data.config keys, sub-hour layout, pass plans, the key
state, whole-line table work, admission masks, and the manifests with deltas on."""

from __future__ import annotations

import datetime as dt
import json

import numpy as np
import pytest

from ctr_foundation.errors import ConfigError
from elastic_control.config.data_config import parse_data_config

HEAD = "export START_DATE_HR=20191221/00\nexport END_DATE_HR=20191221/01\nexport DATASET_PATH=/data\n"


def _cfg(extra: str = ""):
    return parse_data_config(HEAD + extra, env={})


def test_defaults_are_full_hourly_passes():
    c = _cfg()
    assert (c.delta_passes, c.base_every, c.admit_min_count, c.evict_after_passes, c.pass_minutes) == (
        False,
        24,
        None,
        None,
        None,
    )
    assert not c.incremental and [c.format_slot(t) for t in c.slots()] == ["20191221/00", "20191221/01"]


def test_incremental_keys_parse():
    c = _cfg('export DELTA_PASSES="1"\nexport BASE_EVERY=6\nexport ADMIT_MIN_COUNT=3\nexport EVICT_AFTER_PASSES=12\n')
    assert (c.delta_passes, c.base_every, c.admit_min_count, c.evict_after_passes) == (True, 6, 3, 12)
    assert c.incremental
    assert _cfg("export ADMIT_MIN_COUNT=1\n").admit_min_count is None  # seen once = every key: off


def test_sub_hour_passes_are_deltas_by_default_and_cover_whole_hours():
    c = _cfg("export PASS_MINUTES=15\n")
    assert c.delta_passes and c.pass_minutes == 15
    slots = [c.format_slot(t) for t in c.slots()]
    assert slots[0] == "20191221/0000" and slots[-1] == "20191221/0145" and len(slots) == 8
    assert c.hour_dir(c.end) == "/data/20191221/0145"
    assert not _cfg("export PASS_MINUTES=15\nexport DELTA_PASSES=0\n").delta_passes


@pytest.mark.parametrize(
    "line,match",
    [
        ("export DELTA_PASSES=yes-please", r"DELTA_PASSES='yes-please' must be 0 or 1"),
        ("export BASE_EVERY=0", r"BASE_EVERY='0' must be an integer from 1 to 100000"),
        ("export ADMIT_MIN_COUNT=2000000", r"ADMIT_MIN_COUNT='2000000' must be an integer from 1 to 1000000"),
        ("export EVICT_AFTER_PASSES=soon", r"EVICT_AFTER_PASSES='soon' must be an integer"),
        ("export PASS_MINUTES=7", r"PASS_MINUTES='7' must divide the hour: one of 1, 2, 3, 4, 5, 6, 10, 12, 15"),
        ("export PASS_MINUTES=60", r"PASS_MINUTES='60' must divide the hour"),
        ("export DELTA_PASS=1", r"unknown key 'DELTA_PASS'; did you mean 'DELTA_PASSES'\?"),
        ("export PASS_HOURS=0", r"PASS_HOURS='0' must be an integer from 1 to 168"),
        ("export PASS_HOURS=4\nexport PASS_MINUTES=15", r"PASS_HOURS='4' and PASS_MINUTES='15' cannot both be set"),
    ],
)
def test_bad_incremental_keys_fail_in_one_line_naming_the_key(line, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(line + "\n")


def test_cli_refuses_a_bad_key_with_exit_2(tmp_path):
    import subprocess
    import sys

    from helpers_kube import EXAMPLE_SLOT_CONF

    (tmp_path / "data.config").write_text(HEAD + "export PASS_MINUTES=7\n")
    r = subprocess.run(
        [sys.executable, "-m", "elastic_control", "-r", "--backend", "k8s", "-s", str(EXAMPLE_SLOT_CONF), "-f",
         str(tmp_path / "data.config"), "--state-dir", str(tmp_path / "state")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and "PASS_MINUTES='7' must divide the hour" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "state" / "plan.json").exists()


def test_sub_hour_layout_is_written_and_read(tmp_path):
    from elastic_control.data.readers import HourlyData
    from elastic_control.data.synth import generate

    generate(tmp_path, slots=(1, 2), hours=1, lines_per_hour=120, seed=1, start=dt.datetime(2019, 12, 21), minutes=20)
    folders = sorted(p.name for p in (tmp_path / "20191221").iterdir())
    assert folders == ["0000", "0020", "0040"]
    assert all((tmp_path / "20191221" / f / "donefile").read_text() == "40\n" for f in folders)
    c = parse_data_config(
        f"export START_DATE_HR=20191221/00\nexport END_DATE_HR=20191221/00\nexport DATASET_PATH={tmp_path}\n"
        "export PASS_MINUTES=20\n",
        env={},
    )
    data = HourlyData(c)
    parts = list(data.partitions())
    assert [p.name for p in parts] == ["20191221/0000", "20191221/0020", "20191221/0040"]
    lines = sum(len(b) for p in parts for b in data.iter_batches(p))
    assert lines == 120
    (tmp_path / "20191221" / "0040" / "donefile").unlink()  # an incomplete slot is skipped (offline)
    assert [p.name for p in data.partitions(after=dt.datetime(2019, 12, 21, 0, 0))] == ["20191221/0020"]


def test_sub_hour_pass_names_sort_and_windows_say_the_slot(tmp_path):
    from ctr_foundation.pass_format import pass_name
    from elastic_control.training import pass_export

    t = dt.datetime(2019, 12, 21, 1, 5)
    assert pass_name(t, minutes=True) == "pass-20191221-0105" and pass_name(t) == "pass-20191221-01"
    names = [pass_name(dt.datetime(2019, 12, 21, h, m), minutes=True) for h in (0, 1, 10) for m in (0, 5, 55)]
    assert names == sorted(names)
    entry = pass_export.write_pass(
        tmp_path,
        hour_start=t,
        hour_end=t,
        save_sparse=lambda p: p.mkdir(parents=True),
        save_dense=lambda p: None,
        score_golden=lambda: [],
        meta={"kind": "delta", "parent": "pass-20191221-0100", "metrics": {}},
        minutes=5,
    )
    assert entry.pass_name == "pass-20191221-0105" and entry.window == {
        "start": "20191221/0105",
        "end": "20191221/0105",
    }
    assert (entry.kind, entry.parent) == ("delta", "pass-20191221-0100")
    line = json.loads((tmp_path / "donefile").read_text())
    assert line["kind"] == "delta" and line["parent"] == "pass-20191221-0100"


def test_multi_hour_passes_group_the_window_from_its_start():
    c = parse_data_config(HEAD.replace("20191221/01", "20191221/09") + "export PASS_HOURS=4\n", env={})
    windows = [(c.format_slot(a), c.format_slot(b)) for a, b in c.pass_windows()]
    # Groups of four from START_DATE_HR; the last ends at END_DATE_HR.
    assert windows == [("20191221/00", "20191221/03"), ("20191221/04", "20191221/07"), ("20191221/08", "20191221/09")]
    assert len(list(c.slots())) == 10 and not c.delta_passes  # the data folders are still hours
    assert [(a, b) for a, b in _cfg().pass_windows()] == [(t, t) for t in _cfg().slots()]


def test_multi_hour_pass_reads_every_hour_of_its_group(tmp_path):
    from elastic_control.data.readers import HourlyData
    from elastic_control.data.synth import generate

    generate(tmp_path, slots=(1, 2), hours=5, lines_per_hour=30, seed=1, start=dt.datetime(2019, 12, 21))
    c = parse_data_config(
        f"export START_DATE_HR=20191221/00\nexport END_DATE_HR=20191221/04\nexport DATASET_PATH={tmp_path}\n"
        "export PASS_HOURS=2\n",
        env={},
    )
    warnings = []
    data = HourlyData(c, warn=warnings.append)
    parts = list(data.partitions())
    assert [p.name for p in parts] == ["20191221/00..20191221/01", "20191221/02..20191221/03", "20191221/04"]
    assert [p.last.hour for p in parts] == [1, 3, 4]
    assert parts[0].files[0].startswith("20191221/00/part-") and parts[0].files[-1].startswith("20191221/01/")
    assert [sum(len(b) for b in data.iter_batches(p)) for p in parts] == [60, 60, 30]
    # Two trainers split a group's files, each reading some of every hour.
    shares = [sum(len(b) for b in data.iter_batches(parts[0], trainer_id=i, trainers=2)) for i in (0, 1)]
    assert sum(shares) == 60 and min(shares) > 0
    # Resuming after the first group's last hour; a missing hour is left out of its group, with a warning.
    (tmp_path / "20191221" / "03" / "donefile").unlink()
    again = list(data.partitions(after=dt.datetime(2019, 12, 21, 1)))
    assert [p.name for p in again] == ["20191221/02..20191221/03", "20191221/04"]
    assert all(f.startswith("20191221/02/") for f in again[0].files) and "hour 20191221/03 is missing" in warnings[0]
    # A resume inside a group (an earlier window ended at hour 00) trains the rest of that group first.
    assert [p.name for p in data.partitions(after=dt.datetime(2019, 12, 21, 0))][:2] == ["20191221/01", again[0].name]


def test_online_multi_hour_pass_waits_for_every_hour_of_its_group(tmp_path):
    from ctr_foundation.errors import DataError
    from elastic_control.data.readers import HourlyData
    from elastic_control.data.synth import generate

    generate(tmp_path, slots=(1,), hours=3, lines_per_hour=10, seed=1, start=dt.datetime(2019, 12, 21))
    c = parse_data_config(
        f"export START_DATE_HR=20191221/00\nexport END_DATE_HR=20191221/00\nexport DATASET_PATH={tmp_path}\n"
        "export PASS_HOURS=2\nexport ONLINE=1\n",
        env={},
    )
    parts = HourlyData(c, wait_timeout=0.05, poll_seconds=0.01, warn=lambda m: None).partitions()
    assert next(parts).name == "20191221/00..20191221/01"  # online: past END_DATE_HR, in groups of two
    with pytest.raises(DataError, match="hour 20191221/03: no donefile"):
        next(parts)  # hour 02 is there, 03 is not: the pass does not start without it


def test_multi_hour_pass_is_named_by_its_last_hour(tmp_path):
    from elastic_control.training import pass_export

    entry = pass_export.write_pass(
        tmp_path,
        hour_start=dt.datetime(2019, 12, 21, 0),
        hour_end=dt.datetime(2019, 12, 21, 3),
        save_sparse=lambda p: p.mkdir(parents=True),
        save_dense=lambda p: None,
        score_golden=lambda: [],
        meta={"metrics": {}},
    )
    assert entry.pass_name == "pass-20191221-03" and entry.window == {"start": "20191221/00", "end": "20191221/03"}


def test_gate_holdout_counts_sub_hour_slots():
    from elastic_control.evaluation.gate import holdout_window

    c = _cfg("export PASS_MINUTES=30\n")
    meta = {"window": {"end": "20191221/0130"}}
    s, e, after = holdout_window(meta, c, 1, lambda t: True)
    assert (s, e, after) == (dt.datetime(2019, 12, 21, 2, 0), dt.datetime(2019, 12, 21, 2, 30), True)
    s, e, after = holdout_window(meta, c, 1, lambda t: False)
    assert (s, e, after) == (dt.datetime(2019, 12, 21, 1, 0), dt.datetime(2019, 12, 21, 1, 30), False)


def _pass(root, name, kind="base", parent=None, depth=0):
    from ctr_foundation.pass_format import load_pass

    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "meta.json").write_text(
        json.dumps({"pass": name, "kind": kind, "parent": parent, "depth": depth, "embedding_dim": 2, "slots": [1]})
    )
    return load_pass(folder)


def test_first_pass_and_every_base_every_th_are_bases(tmp_path):
    from elastic_control.training.delta_export import plan_next

    c = _cfg('export DELTA_PASSES=1\nexport BASE_EVERY="3"\n')
    plans, last = [], None
    for i in range(7):
        p = plan_next(last, c)
        plans.append(p.kind)
        last = _pass(tmp_path, f"pass-{i:02d}", p.kind, p.parent, p.depth)
        assert p.parent == (None if p.kind == "base" else f"pass-{i - 1:02d}")
    assert plans == ["base", "delta", "delta", "base", "delta", "delta", "base"]
    assert plan_next(last, _cfg()).kind == "base"  # deltas off: every pass whole


def test_pass_chain_walks_to_the_base_and_names_a_missing_parent(tmp_path):
    from ctr_foundation.errors import DataError
    from ctr_foundation.pass_format import pass_chain

    _pass(tmp_path, "pass-00")
    _pass(tmp_path, "pass-01", "delta", "pass-00", 1)
    _pass(tmp_path, "pass-02", "delta", "pass-01", 2)
    assert [p.name for p in pass_chain(tmp_path / "pass-02")] == ["pass-00", "pass-01", "pass-02"]
    _pass(tmp_path, "pass-05", "delta", "pass-04", 1)
    with pytest.raises(DataError, match="delta on pass-04, but .*pass-04 is not a pass folder"):
        pass_chain(tmp_path / "pass-05")


def test_key_state_admits_evicts_and_replays_the_same_as_it_exports():
    from elastic_control.training.key_state import KeyState

    s = KeyState()
    u = np.uint64
    admitted, stats = s.observe(np.array([1, 2, 3], u), np.array([True, False, False]), np.array([5, 1, 1]))
    assert admitted.tolist() == [True, False, False] and (stats.new, stats.newly_admitted) == (3, 1)
    admitted, stats = s.observe(np.array([2, 4], u), np.array([True, False]), np.array([2, 1]))
    assert admitted.tolist() == [True, False] and (stats.new, stats.newly_admitted) == (1, 1)
    assert s.counts() == {"keys_live": 4, "keys_admitted": 2, "keys_pending": 2}
    s.observe(np.array([4], u), np.array([False]), np.array([2]))  # pass 3: only key 4 seen
    gone, was_admitted = s.evict(2)  # unseen in passes 2 and 3: keys 1 and 3
    assert gone.tolist() == [1, 3] and was_admitted.tolist() == [True, False]
    assert s.is_admitted(np.array([1, 2, 4, 9], u)).tolist() == [False, True, False, False]
    assert s.shows_of(np.array([4, 9], u)).tolist() == [2.0, 0.0]
    # An admitted key stays admitted even if a later line's count would not qualify it.
    admitted, _ = s.observe(np.array([2], u), np.array([False]), np.array([3]))
    assert admitted.tolist() == [True]


def test_training_admission_counts_what_it_fed_and_never_exceeds_the_pserver_count():
    from elastic_control.training.admission import AdmissionMask, TrainingAdmission
    from elastic_control.training.key_state import KeyState
    from elastic_control.training.pass_stream import KeyCounts

    u = np.uint64

    def key_counts_of(keys):  # the pass's key counts, as the trainer counts its share
        counts = KeyCounts()
        counts.add(np.array(keys, u))
        return counts

    state = KeyState()
    state.observe(np.array([10, 11], u), np.array([True, False]), np.array([3, 1]))  # 11 seen once so far
    train, export = TrainingAdmission(state, 3), AdmissionMask(state, 3)
    train.start_pass(key_counts_of([10, 11, 12]))
    batch = np.array([10, 11, 12, 11], u)
    assert train.admitted(batch).tolist() == [True, False, False, False]  # 11: 1 before this batch
    assert train.admitted(np.array([11, 12], u)).tolist() == [True, False]  # 11: 1 + 2 fed = 3
    assert train.admitted(np.array([12, 12], u)).tolist() == [False, False]  # 12: 2 fed before this batch
    assert train.admitted(np.array([12], u)).tolist() == [True]  # 12: 2 + 2 fed, never exported
    assert export.admitted(np.array([11], u)).tolist() == [False]  # the pass's table: not until exported
    train.start_pass(key_counts_of([11, 13]))
    assert train.admitted(np.array([11], u)).tolist() == [False]  # counts since the export only
    with pytest.raises(ValueError, match="key 12 fed but not among the pass's keys"):
        train.admitted(np.array([11, 12], u))


def test_whole_lines_overlay_split_and_reset(tmp_path):
    from elastic_control.training.table_files import PartLines, overlay, read_part_lines, write_lines, zero_delta_score

    older = tmp_path / "a" / "000" / "part-000-00000.gz"
    newer = tmp_path / "b" / "000" / "part-000-00000"
    import pyarrow as pa

    write_lines(
        older, pa.array(["16 0 0 0.5 5 0 0.1 1", "32 0 0 0.1 1 0 0.2 2", "18446744073709551600 0 0 0.3 3 0 0.3 3"])
    )
    write_lines(newer, pa.array(["32 0 0 0.7 7 0 0.9 9"]))
    a, b = read_part_lines(older), read_part_lines(newer)
    assert a.keys.tolist() == [16, 32, 18446744073709551600] and a.shows().tolist() == [5, 1, 3]
    merged = overlay(a, b, np.array([16], np.uint64))
    assert sorted(zip(merged.keys.tolist(), merged.lines.to_pylist(), strict=True)) == [
        (32, "32 0 0 0.7 7 0 0.9 9"),
        (18446744073709551600, "18446744073709551600 0 0 0.3 3 0 0.3 3"),
    ]
    assert sorted(zero_delta_score(merged.lines).to_pylist()) == [
        "18446744073709551600 0 0 0 3 0 0.3 3",
        "32 0 0 0 7 0 0.9 9",
    ]
    assert len(PartLines.concat([PartLines.empty(), b])) == 1


def test_manifests_carry_the_incremental_keys_to_every_training_pod(tmp_path):
    import yaml
    from helpers_kube import render_plan
    from helpers_kube_schema import validate_manifest

    text = HEAD.replace("/data", "/var/lib/elastic-ctr/data") + (
        'export DELTA_PASSES="1"\nexport BASE_EVERY="12"\nexport ADMIT_MIN_COUNT="3"\n'
        'export EVICT_AFTER_PASSES="48"\nexport PASS_MINUTES="15"\nexport ONLINE="1"\n'
    )
    (tmp_path / "data.config").write_text(text)
    _, manifests = render_plan(tmp_path / "state", data_config=str(tmp_path / "data.config"))
    docs = [d for p in sorted(manifests.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]
    for doc in docs:
        validate_manifest(doc)
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap" and "data.config" in d.get("data", {})]
    pod_config = parse_data_config(config_map["data"]["data.config"], env={})
    assert (pod_config.delta_passes, pod_config.base_every, pod_config.admit_min_count) == (True, 12, 3)
    assert (pod_config.evict_after_passes, pod_config.pass_minutes, pod_config.online) == (48, 15, True)
    (job,) = [d for d in docs if d["kind"] == "Job"]
    for task in job["spec"]["tasks"]:
        spec = task["template"]["spec"]
        mounts = {m["mountPath"] for c in spec["containers"] for m in c.get("volumeMounts", [])}
        env = {e["name"] for c in spec["containers"] for e in c.get("env", [])}
        assert "/etc/elastic-ctr" in mounts and "ELASTIC_CTR_DATA_CONFIG" in env, task["name"]


def test_drift_brings_fresh_feasigns_and_retires_old_ones_for_good(tmp_path):
    from elastic_control.data.synth import generate

    generate(tmp_path, slots=(1,), hours=1, lines_per_hour=3000, seed=2, start=dt.datetime(2019, 12, 21),
             minutes=10, drift=20, vocab=60)  # fmt: skip
    seen = []
    for folder in sorted((tmp_path / "20191221").iterdir()):
        keys = set()
        for part in folder.glob("part-*"):
            keys.update(tok.split(":")[0] for ln in part.read_text().splitlines() for tok in ln.split()[2:])
        seen.append(keys)
    first, last = seen[0], seen[-1]
    assert len(first) <= 60 and len(last) <= 60  # 60 live feasigns at a time
    assert not first & last  # 5 slots x 20 = 100 ranks later, every first-slot feasign has retired
    later = set().union(*seen[1:])
    assert len(set().union(*seen)) > 120 and first - later  # the vocabulary keeps growing; retired ones stay gone


def test_admission_trains_one_epoch_per_pass_and_refuses_more(tmp_path):
    """A sighting is a push (one per epoch): with ADMIT_MIN_COUNT, EPOCHS=auto is 1 and EPOCHS>1 a usage error."""
    import subprocess
    import sys

    from elastic_control.training.settings import resolve_epochs

    admit = _cfg("export ADMIT_MIN_COUNT=2\n")
    assert resolve_epochs(None, admit) == 1 and resolve_epochs("auto", admit) == 1 and resolve_epochs(1, admit) == 1
    assert resolve_epochs(None, _cfg()) == "auto" and resolve_epochs(3, _cfg()) == 3  # without admission: as set
    with pytest.raises(ConfigError, match="EPOCHS=3 with ADMIT_MIN_COUNT=2"):
        resolve_epochs(None, _cfg("export ADMIT_MIN_COUNT=2\nexport EPOCHS=3\n"))
    (tmp_path / "data.config").write_text(HEAD + f"export ADMIT_MIN_COUNT=2\nexport MODEL_PATH={tmp_path / 'm'}\n")
    (tmp_path / "slot.conf").write_text("1\n2\n")
    r = subprocess.run(
        [sys.executable, "-m", "elastic_control", "train", "-f", str(tmp_path / "data.config"), "-s",
         str(tmp_path / "slot.conf"), "--epochs", "4"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and "EPOCHS=4 with ADMIT_MIN_COUNT=2" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "m").exists()


def _table(folder, shards, rows):
    """A saved table of ``shards`` part files: each key's line in the file of shard ``key % shards``."""
    import pyarrow as pa

    from elastic_control.training.table_files import write_lines

    for s in range(shards):
        lines = [line for key, line in rows if key % shards == s]
        write_lines(folder / "000" / f"part-000-{s:05d}.gz", pa.array(lines, pa.string()))


def test_a_chain_saved_with_other_shard_counts_assembles_into_any_count(tmp_path):
    """A job of another number of pservers (or a pass of the former 16 shards) resumes: every key of the chain
    lands in the shard ``key % shards`` of the new table, the newest layer's line winning, the deleted gone."""
    from elastic_control.training.delta_export import assemble_resume_table
    from elastic_control.training.table_files import read_part_lines

    big = 18446744073709551600
    base = [(k, f"{k} 0 0 0.5 1 0 0.1 1") for k in (*range(40), big)]
    delta = [(k, f"{k} 0 0 0.5 2 0 0.2 2") for k in (3, 17, 38)]
    _pass(tmp_path, "pass-00")
    _table(tmp_path / "pass-00" / "sparse", 16, base)
    _pass(tmp_path, "pass-01", "delta", "pass-00", 1)
    _table(tmp_path / "pass-01" / "sparse", 4, delta)  # written after a resume with 2 pservers
    (tmp_path / "pass-01" / "deleted").mkdir()
    (tmp_path / "pass-01" / "deleted" / "part-00000").write_text("5\n")
    expected = {k: line for k, line in base + delta if k != 5}
    for shards in (2, 3, 4, 16):
        out = assemble_resume_table(
            tmp_path / "pass-01", tmp_path / f"out{shards}", shards=shards, mine=range(shards), log=lambda m: None
        )
        got = {}
        for s in range(shards):
            part = read_part_lines(out / "000" / f"part-000-{s:05d}")
            assert (part.keys % np.uint64(shards) == s).all(), (shards, s)
            got.update(zip(part.keys.tolist(), part.lines.to_pylist(), strict=True))
        # delta_score (the 4th column) is reset by the resume.
        assert got == {k: line.replace(" 0.5 ", " 0 ") for k, line in expected.items()}, shards
    # Only this pserver's shards are filled; the others are empty files, as Paddle's load wants.
    out = assemble_resume_table(tmp_path / "pass-01", tmp_path / "mine", shards=4, mine=range(2, 4), log=print)
    assert [(out / "000" / f"part-000-{s:05d}").stat().st_size > 0 for s in range(4)] == [False, False, True, True]
