"""Real parameter-server training on loopback: 1 pserver + 2 trainers as separate processes."""

from __future__ import annotations

import datetime as dt
import json
import re

import numpy as np
import pytest
from helpers_common import CRITEO_FILE
from helpers_train import START, labels_of, read_golden, run_training, score_pass, write_job

from ctr_foundation import pass_format
from ctr_foundation.errors import ComponentError
from ctr_foundation.records import GOLDEN_FILE, read_donefile
from elastic_control.training import pass_export
from elastic_control.training.table_files import read_part_lines

SLOTS = (1, 2, 3, 4, 5, 6)


def _synth_job(tmp_path, *, hours, lines_per_hour, vocab=100, seed=11):
    from elastic_control.data.synth import generate

    job = write_job(tmp_path, slots=SLOTS, hours=hours)
    generate(job.data, slots=SLOTS, hours=hours, lines_per_hour=lines_per_hour, seed=seed, start=START, vocab=vocab)
    return job


def _assert_complete_pass(models, name, embedding_dim=9):
    folder = models / name
    meta = json.loads((folder / pass_format.META_FILE).read_text())
    assert meta["pass"] == name and meta["slots"] == list(SLOTS) and meta["embedding_dim"] == embedding_dim
    assert meta["dense_input"] == pass_format.DENSE_INPUT
    assert meta["sparse_layout"]["accessor"] == "SparseAccessor"
    assert (folder / "dense" / "inference.pdmodel").exists() and (folder / "dense" / "inference.pdiparams").exists()
    assert pass_format.sparse_part_files(folder)
    assert (folder / GOLDEN_FILE).stat().st_size > 0


@pytest.mark.e2e
def test_two_trainers_one_pserver_write_passes_of_hour_groups_track_mlflow_resume_and_stop(tmp_path):
    """The parameter-server job end to end, with PASS_HOURS=2 (hourly passes: test_crash_during_export below and
    the local pipeline tests)."""
    from mlflow.tracking import MlflowClient

    from elastic_control.training.cli import hyperparameter_args
    from elastic_control.training.settings import Hyperparameters

    job = _synth_job(tmp_path, hours=5, lines_per_hour=700)
    text = job.data_config.read_text() + "export PASS_HOURS=2\nexport EPOCHS=2\n"  # few epochs: a quick test
    job.data_config.write_text(text.replace("END_DATE_HR=20191221/04", "END_DATE_HR=20191221/01"))
    args = hyperparameter_args(Hyperparameters(batch_size=256, log_every=2))
    first = run_training(job, trainers=2, pservers=1, args=args, timeout=400)
    assert first.passes == ["pass-20191221-01"]  # hours 00-01 as one pass, named by its last hour
    # The pserver ended by itself (trainer 0 stopped it), cleanly.
    assert first.pservers_exited_by_themselves and first.pserver_exit_codes == [0]

    # MLflow: params, step and pass metrics, one registered version per pass with its window and AUC.
    uri = f"sqlite:///{job.models.resolve() / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("elastic-ctr").experiment_id])
    assert run.data.params["trainers"] == "2" and run.data.params["pservers"] == "1"
    assert run.data.params["window_start"] == "20191221/00"
    for metric in ("loss", "auc", "examples_per_sec", "cpu_percent", "memory_mb", "pass_auc", "pass_examples"):
        assert metric in run.data.metrics, metric

    # A longer window resumes after the first group's last hour: hours 02-03, then 04 alone (the window's end).
    job.data_config.write_text(text)
    result = run_training(job, trainers=2, pservers=1, args=args, timeout=400)
    assert result.passes == ["pass-20191221-01", "pass-20191221-03", "pass-20191221-04"]
    entries = read_donefile(job.models)
    assert [(e.window["start"], e.window["end"]) for e in entries] == [
        ("20191221/00", "20191221/01"),
        ("20191221/02", "20191221/03"),
        ("20191221/04", "20191221/04"),
    ]
    # An epoch of a group is both hours: all 1,400 lines but trainer 0's held-out ones (examples count epochs).
    per_epoch = [e.metrics["examples"] / e.metrics["epochs"] for e in entries]
    assert 1400 - 100 < per_epoch[1] <= 1400 and 700 - 100 < per_epoch[2] <= 700
    for name in result.passes:
        _assert_complete_pass(job.models, name)
    versions = client.search_model_versions("name='elastic-ctr'")
    assert sorted(v.tags["pass"] for v in versions) == result.passes
    assert all("auc" in v.tags and v.tags["window_end"] for v in versions)

    # golden.jsonl is reproduced from the saved pass: sparse table + padding rule + dense inference model.
    lines, golden = read_golden(job.models / "pass-20191221-03")
    assert len(lines) >= 30
    np.testing.assert_allclose(score_pass(job.models / "pass-20191221-03", lines), golden, atol=1e-5, rtol=0)


@pytest.mark.e2e
def test_crash_during_export_leaves_no_complete_pass_and_resume_continues_on_more_pservers(tmp_path):
    job = _synth_job(tmp_path, hours=3, lines_per_hour=1500)
    with open(job.data_config, "a") as f:
        f.write("export EPOCHS=2\n")  # the first pass of a new model would train 20 epochs of these few lines
    # Trainer 0 dies after pass 01's folder is in place but before its donefile line.
    with pytest.raises(ComponentError, match="trainer-0 failed"):
        run_training(
            job, trainers=2, env={"ELASTIC_CTR_TEST_CRASH_EXPORT": "before_donefile:pass-20191221-01"}, timeout=400
        )
    assert [p.name for p in pass_format.complete_passes(job.models)] == ["pass-20191221-00"]
    assert (job.models / "pass-20191221-01").exists()  # looks finished, but is not: no donefile line

    # Resumed by a job of 2 pservers: their table has 4 shards, the pass was saved with 2; each pserver loads
    # its shards' keys from the pass's files.
    result = run_training(job, trainers=2, pservers=2, timeout=400)
    assert result.passes == ["pass-20191221-00", "pass-20191221-01", "pass-20191221-02"]
    log = (job.models / "logs" / "train-trainer-0.log").read_text()
    assert "resuming after pass-20191221-00" in log
    saved = pass_format.sparse_part_files(job.models / "pass-20191221-00")
    rows = sum(len(read_part_lines(p)) for p in saved)
    assert len(saved) == 2 and rows > 0
    assembled = [
        int(re.search(r"assembled (\d+) rows of pass-20191221-00", (job.models / "logs" / name).read_text())[1])
        for name in ("train-pserver-0.log", "train-pserver-1.log")
    ]
    assert sum(assembled) == rows and min(assembled) > 0
    assert len(pass_format.sparse_part_files(job.models / "pass-20191221-01")) == 4
    for name in result.passes:
        _assert_complete_pass(job.models, name)
    lines, golden = read_golden(job.models / "pass-20191221-02")
    np.testing.assert_allclose(score_pass(job.models / "pass-20191221-02", lines), golden, atol=1e-5, rtol=0)


def test_write_pass_failure_leaves_nothing_that_looks_complete(tmp_path):
    def boom():
        raise RuntimeError("scoring failed")

    with pytest.raises(RuntimeError):
        pass_export.write_pass(
            tmp_path,
            hour_start=START,
            hour_end=START,
            save_sparse=lambda p: p.mkdir(parents=True),
            save_dense=lambda p: None,
            score_golden=boom,
            meta={},
        )
    assert list(tmp_path.iterdir()) == []  # staging removed, no pass folder, no donefile
    entry = pass_export.write_pass(
        tmp_path,
        hour_start=START,
        hour_end=START + dt.timedelta(hours=1),
        save_sparse=lambda p: p.mkdir(parents=True),
        save_dense=lambda p: None,
        score_golden=lambda: [],
        meta={"metrics": {"auc": 0.7}},
    )
    assert entry.pass_name == "pass-20191221-01" and read_donefile(tmp_path) == [entry]


def test_role_settings_name_the_missing_variable(tmp_path, monkeypatch):
    from ctr_foundation.errors import ConfigError
    from elastic_control.training.settings import Hyperparameters, role_settings_from_env

    with pytest.raises(ConfigError, match="TRAINING_ROLE must be set"):
        role_settings_from_env(Hyperparameters(), environ={})
    with pytest.raises(ConfigError, match="WORKER.*must be PSERVER or TRAINER"):
        role_settings_from_env(Hyperparameters(), environ={"TRAINING_ROLE": "WORKER"})


def test_coordinator_barrier_collects_every_rank(tmp_path):
    import threading

    from elastic_control.local.ports import free_ports
    from elastic_control.training.coordinator import Coordinator, CoordinatorClient

    (port,) = free_ports(1)
    coord = Coordinator(2, hello=lambda: {"resume_after": None})
    coord.serve_in_thread("127.0.0.1", port)
    try:
        client = CoordinatorClient("127.0.0.1", port, connect_timeout=5)
        got = {}
        t = threading.Thread(target=lambda: got.setdefault(1, client.barrier("b", 1, 2, {"n": 1})))
        t.start()
        got[0] = client.barrier("b", 0, 2, {"n": 0})
        t.join(5)
        assert got[0] == got[1] == {"0": {"n": 0}, "1": {"n": 1}}
        assert client.hello() == {"resume_after": None}
        assert not client.status()["finished"]
        client.finish(0)
        client.finish(1)
        assert coord.wait_all_finished(1) and client.status()["finished"]
    finally:
        coord.close()


@pytest.mark.e2e
@pytest.mark.slow  # the default suite guards quality with test_model_quality's real logs
def test_quick_training_clearly_beats_the_positive_rate_constant(tmp_path):
    """Fast quality guard: 1 trainer, 2 small hours; the next (unseen) hour is scored from the saved pass."""
    from elastic_control.data.hourly_writer import hour_dir
    from elastic_control.data.synth import generate, read_truth
    from elastic_control.metrics import auc, log_loss

    job = write_job(tmp_path, slots=SLOTS, hours=2)
    generate(job.data, slots=SLOTS, hours=3, lines_per_hour=12_000, seed=5, start=START)
    result = run_training(job, trainers=1, timeout=400)
    lines, truth = read_truth(hour_dir(job.data, START + dt.timedelta(hours=2)))
    labels = labels_of(lines)
    probs = score_pass(job.models / result.passes[-1], lines)
    constant = np.full(len(labels), labels.mean())
    print(f"held-out AUC {auc(labels, probs):.4f} (Bayes-optimal {auc(labels, truth):.4f})")
    assert auc(labels, probs) > 0.70
    assert log_loss(labels, probs) < log_loss(labels, constant) - 0.01


@pytest.mark.slow
@pytest.mark.e2e
def test_synthetic_heldout_auc_close_to_bayes_optimal(tmp_path):
    from elastic_control.data.hourly_writer import hour_dir
    from elastic_control.data.synth import generate, read_truth
    from elastic_control.metrics import auc

    hours = 4
    job = write_job(tmp_path, slots=SLOTS, hours=hours)
    generate(job.data, slots=SLOTS, hours=hours + 1, lines_per_hour=25_000, seed=3, start=START, vocab=50)
    result = run_training(job, trainers=2, timeout=1200)
    lines, truth = read_truth(hour_dir(job.data, START + dt.timedelta(hours=hours)))  # the held-out hour
    labels = labels_of(lines)
    model_auc, bayes_auc = auc(labels, score_pass(job.models / result.passes[-1], lines)), auc(labels, truth)
    print(f"held-out AUC {model_auc:.4f}, Bayes-optimal {bayes_auc:.4f}")
    assert model_auc >= bayes_auc - 0.03


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.needs_criteo
def test_criteo_beats_the_positive_rate_constant(tmp_path):
    from elastic_control.data.criteo import convert_file
    from elastic_control.data.hourly_writer import hour_dir
    from elastic_control.data.synth import read_truth  # noqa: F401  (same hour layout)
    from elastic_control.metrics import auc, log_loss

    job = write_job(tmp_path, slots=range(1, 40), hours=3)
    convert_file(CRITEO_FILE, job.data, hours=4, start=START)
    result = run_training(job, trainers=2, timeout=1800)
    held = hour_dir(job.data, START + dt.timedelta(hours=3))
    lines = [ln for p in sorted(held.glob("part-*")) for ln in p.read_text().splitlines() if ln]
    labels = labels_of(lines)
    probs = score_pass(job.models / result.passes[-1], lines)
    constant = np.full(len(labels), labels.mean())
    print(
        f"Criteo held-out AUC {auc(labels, probs):.4f}, log loss {log_loss(labels, probs):.4f} "
        f"vs constant {log_loss(labels, constant):.4f}"
    )
    assert auc(labels, probs) > 0.6
    assert log_loss(labels, probs) < log_loss(labels, constant)
