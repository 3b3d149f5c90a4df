"""The demo's own logic without running the pipeline: arguments, data preparation, workdir safety.

The whole main job on real components is tests/test_local_pipeline.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_common import CRITEO_FILE

from ctr_foundation.errors import UsageError
from elastic_control.config import load_data_config, load_slot_conf
from elastic_control.demo.run import _size

ROOT = Path(__file__).resolve().parents[1]
CRITEO = CRITEO_FILE


def test_synthetic_data_holds_out_the_hour_after_the_training_window(tmp_path):
    from elastic_control.demo.data import DEMO_START, prepare_synthetic

    data = prepare_synthetic(tmp_path, train_hours=2, lines_per_hour=400)
    cfg = load_data_config(data.data_config, env={})
    assert [h for h in cfg.hours()] == [DEMO_START, DEMO_START.replace(hour=1)]
    assert Path(cfg.model_path) == tmp_path / "models" and Path(cfg.dataset_path) == tmp_path / "data"
    assert (tmp_path / "data" / "20191221" / "02" / "donefile").exists()  # the held-out hour exists ...
    assert len(data.heldout_lines) == 400 == len(data.heldout_labels) == len(data.heldout_truth)
    assert 0.5 < data.bayes_auc <= 1.0
    assert set(load_slot_conf(data.slot_conf).slots) >= {
        int(tok.split(":")[1]) for tok in data.heldout_lines[0].split()[2:]
    }


def test_the_demo_data_has_interactions_and_logistic_regression_is_scored_on_it(tmp_path):
    from elastic_control.demo.data import logistic_auc, prepare_synthetic

    data = prepare_synthetic(tmp_path, train_hours=2, lines_per_hour=3000)
    assert "interactions" in data.source
    lr = logistic_auc(data)
    assert 0.5 < lr < data.bayes_auc  # the planted interactions are out of its reach
    original = prepare_synthetic(tmp_path / "original", train_hours=2, lines_per_hour=400, interactions=0)
    assert "interactions" not in original.source


@pytest.mark.needs_criteo
def test_criteo_data_is_converted_and_split(tmp_path):
    from elastic_control.demo.data import prepare_criteo

    data = prepare_criteo(tmp_path, str(CRITEO), train_hours=2, lines_per_hour=500)
    assert data.lines_total == 1500 and len(data.heldout_lines) == 500
    assert data.bayes_auc is None and data.heldout_truth is None
    assert set(data.heldout_labels) <= {0, 1}
    conf = load_slot_conf(data.slot_conf)
    assert conf.slots == tuple(range(1, 40)) and conf.dense == tuple(range(40, 53))


def test_shipped_sizes_read_in_the_unit_that_shows_them():
    assert _size(41_234) == "41.2 kB"  # the demo's tables: "0.0 MB" said nothing
    assert _size(440e6) == "440.0 MB"


def test_demo_refuses_bad_arguments(tmp_path):
    from elastic_control.demo.run import run_demo

    with pytest.raises(UsageError, match="at least 2 hourly passes"):
        run_demo(workdir=str(tmp_path), hours=1)
    with pytest.raises(UsageError, match="--criteo .*not found"):
        run_demo(workdir=str(tmp_path), criteo=str(tmp_path / "missing.tsv"))
    with pytest.raises(UsageError, match="-t/--trainer"):
        run_demo(workdir=str(tmp_path), trainers=0)
    env = {**os.environ}
    res = subprocess.run(
        [sys.executable, "-m", "elastic_control", "demo", "--hours", "1", "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr


def test_demo_will_not_clear_a_workdir_whose_pipeline_runs(tmp_path):
    """A --keep run still going in the workdir is never wiped by the next demo."""
    from helpers_local import example_data_config_with_data

    from ctr_foundation.names import StateFolder
    from elastic_control import api
    from elastic_control.config import Resources
    from elastic_control.demo.run import _reset_workdir
    from elastic_control.local.process import process_identity
    from elastic_control.local.runtime import SupervisorLock, write_runtime

    api.configure_resource(
        resources=Resources(trainers=1, pservers=1, cube_shards=1),
        slot_conf=str(ROOT / "examples" / "slot.conf"),
        data_config=str(example_data_config_with_data(tmp_path / "input")),
        backend="local",
        state_dir=str(tmp_path / "state"),
    )
    layout = StateFolder.of(tmp_path / "state")
    lock = SupervisorLock(layout)
    assert lock.acquire()
    try:
        write_runtime(
            layout,
            {
                "state": "running",
                "components": {},
                "supervisor": {"pid": os.getpid(), "started": process_identity(os.getpid())},
            },
        )
        (tmp_path / "models").mkdir()
        with pytest.raises(UsageError, match="still running"):
            _reset_workdir(tmp_path)
        assert (tmp_path / "models").exists()
    finally:
        lock.release()
    _reset_workdir(tmp_path)
    assert not (tmp_path / "models").exists() and not (tmp_path / "state").exists()


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.needs_criteo
def test_demo_on_real_criteo_lines(tmp_path):
    """The main job on converted real Criteo lines, cleaned up at the end (no --keep)."""
    from helpers_local import processes_under

    from elastic_control.demo.run import run_demo

    report = run_demo(
        workdir=str(tmp_path / "demo"),
        criteo=str(CRITEO),
        hours=2,
        lines_per_hour=4000,
        trainers=1,
        pservers=1,
        shards=2,
        show=False,
        timeout=780,
    )
    assert report.served_version == "pass-20191221-01" and report.predictions == 4000
    assert report.golden_max_diff is not None and report.golden_max_diff < 1e-5
    assert report.bayes_auc is None and 0.0 <= report.auc <= 1.0
    assert processes_under(tmp_path / "demo") == []


@pytest.mark.slow
@pytest.mark.e2e
def test_demo_with_sub_hour_delta_passes_admission_and_eviction(tmp_path):
    """The main job with deltas on: 30-minute passes, a base then deltas, rolled out and served."""
    import json

    from helpers_local import processes_under

    from elastic_control.demo.run import run_demo

    report = run_demo(
        workdir=str(tmp_path / "demo"),
        hours=2,
        lines_per_hour=2000,
        trainers=2,
        pservers=1,
        shards=2,
        show=False,
        timeout=780,
        pass_minutes=30,
        admit_min_count=2,
        evict_after=2,
    )
    names = ["pass-20191221-0000", "pass-20191221-0030", "pass-20191221-0100", "pass-20191221-0130"]
    assert [p["pass"] for p in report.passes] == names
    assert [p["kind"] for p in report.passes] == ["base", "delta", "delta", "delta"]
    models = tmp_path / "demo" / "models"
    for parent, name in zip(names, names[1:], strict=False):
        meta = json.loads((models / name / "meta.json").read_text())
        assert (meta["kind"], meta["parent"]) == ("delta", parent)
        assert meta["metrics"]["keys_live"] == meta["metrics"]["keys_admitted"] + meta["metrics"]["keys_pending"]
    # Served: the last delta, through cube's delta version, the same as the training program computed.
    assert report.served_version == names[-1] and report.predictions == 2000
    assert report.golden_max_diff is not None and report.golden_max_diff < 1e-5
    assert 0.5 < report.auc <= 1.0
    deltas = [r for r in report.rollouts if r.get("kind") == "delta" and r.get("freshness_s") is not None]
    assert deltas and all(r["version"] in names[1:] for r in deltas)  # freshness is measured for deltas too
    assert processes_under(tmp_path / "demo") == []
