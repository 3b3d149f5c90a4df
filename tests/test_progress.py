"""Per-pass training progress: trainer 0's progress document, status's training.progress, its text line, the demo."""

from __future__ import annotations

import json
import time

from helpers_local import simple_plan

from ctr_foundation.names import StateFolder
from ctr_foundation.progress import FIELDS, PROGRESS_FILE, PassProgress, describe, read_progress
from elastic_control.backends import status as st


def test_pass_progress_document_steps_planned_eta_and_finish(tmp_path):
    p = PassProgress(str(tmp_path), "20191221/00", write=True, epochs=2)
    p.start_epoch(1)
    doc = read_progress(str(tmp_path))
    assert set(FIELDS) <= set(doc) and doc["pass"] == "20191221/00" and doc["epoch"] == 1
    assert doc["steps_planned"] is None and doc["eta_seconds"] is None  # the epoch's steps not known yet
    for step in range(1, 11):
        p.step(step, step * 100)
    p.steps_per_epoch = 10  # the first epoch ran 10 steps
    p.start_epoch(2, 2)
    doc = read_progress(str(tmp_path))
    assert doc["epoch"] == 2 and doc["epochs"] == 2 and doc["steps"] == 10 and doc["steps_planned"] == 20
    assert doc["eta_seconds"] is not None and doc["eta_seconds"] >= 0 and doc["examples_per_sec"] > 0
    assert "(pass step 10/20, epoch 2/2, ETA" in p.suffix()
    assert describe(doc).startswith("pass 20191221/00: epoch 2/2, step 10/20, ") and "examples/s" in describe(doc)
    p.step(15, 1500)
    p.finish(2)  # an early stop after 15 steps: that is the pass
    doc = read_progress(str(tmp_path))
    assert doc["steps"] == doc["steps_planned"] == 15 and doc["eta_seconds"] == 0
    assert [f.name for f in tmp_path.iterdir()] == [PROGRESS_FILE]  # nothing left of the atomic writes


def test_share_lines_give_the_plan_before_the_first_epoch_and_only_trainer_0_writes(tmp_path):
    p = PassProgress(str(tmp_path), "h", write=True, epochs=1)
    p.expect(share_lines=1000, batch_size=64)
    assert p.steps_planned == 16
    PassProgress(str(tmp_path / "other"), "h", write=False).start_epoch(1)
    assert not (tmp_path / "other").exists()
    url = PassProgress("hdfs://nn:9000/models", "h", write=True)
    url.start_epoch(1)  # a URL MODEL_PATH: no document, no error
    assert read_progress("hdfs://nn:9000/models") is None


def test_status_carries_the_progress_and_the_text_view_prints_one_line(tmp_path, capsys):
    from elastic_control.cli.status_view import print_status
    from elastic_control.local.status import collect_status

    layout = StateFolder.of(tmp_path / "state")
    layout.local_dir.mkdir(parents=True)
    models = tmp_path / "models"
    models.mkdir()
    simple_plan(layout, model_path=str(models))
    status = collect_status(layout, probe=False)
    assert status.training["progress"] is None
    doc = {"pass": "20191221/01", "epoch": 1, "epochs": 1, "steps": 40, "steps_planned": 120,
           "examples_per_sec": 3500.0, "eta_seconds": 12.0, "updated_at": time.time()}  # fmt: skip
    (models / PROGRESS_FILE).write_text(json.dumps(doc))
    status = collect_status(layout, probe=False)
    assert status.training["progress"] == doc
    assert json.loads(json.dumps(status.to_json()))["training"]["progress"]["steps_planned"] == 120
    status.training["state"] = "running"
    print_status(status)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("progress:")]
    assert lines == ["progress: pass 20191221/01: epoch 1/1, step 40/120, 3500 examples/s, ETA 12s"]
    status.training["state"] = "completed"  # the last pass's document is history then
    print_status(status)
    assert "progress:" not in capsys.readouterr().out


class _Steps:
    """A deployment whose status moves through the given training sections."""

    def __init__(self, trainings):
        self.trainings = list(trainings)

    def status(self, *, probe=False):
        training = self.trainings.pop(0) if len(self.trainings) > 1 else self.trainings[0]
        return st.PipelineStatus(backend="local", state_dir="s", target="t", state="running", training=training)

    def wait_for(self, condition, **kwargs):
        from elastic_control.backends.base import Deployment

        return Deployment.wait_for(self, condition, **{**kwargs, "poll": 0.0})


def test_the_demo_prints_the_pass_in_flight(monkeypatch, capsys):
    from elastic_control.demo import pipeline_watch

    monkeypatch.setattr(pipeline_watch, "PROGRESS_EVERY", 0.0)
    running = {"state": "running", "passes_done": 0, "restarts": 0, "passes": []}

    def moving(steps):
        doc = {"pass": "h0", "epoch": 1, "epochs": 1, "steps": steps, "steps_planned": 20,
               "examples_per_sec": 900.0, "eta_seconds": 20 - steps, "updated_at": float(steps)}  # fmt: skip
        return {**running, "progress": doc}

    finished = {"state": "completed", "passes_done": 1, "restarts": 0,
                "passes": [{"pass": "pass-h0", "auc": 0.7, "done_at": 1.0}]}  # fmt: skip
    deployment = _Steps([moving(5), moving(5), moving(10), finished])
    events = pipeline_watch.wait_for_training(deployment, expected_passes=1, timeout=30, show=True)
    assert [e.name for e in events] == ["pass-h0"]
    text = capsys.readouterr()
    lines = [ln.strip() for ln in (text.out + text.err).splitlines() if "step " in ln]
    assert lines == [
        "pass h0: epoch 1/1, step 5/20, 900 examples/s, ETA 15s",
        "pass h0: epoch 1/1, step 10/20, 900 examples/s, ETA 10s",
    ]
