"""`tune` with a Kubernetes plan submits each candidate as the plan's Volcano training job and its evaluation
jobs, follows them, and builds the leaderboard from what the evaluation merged. Against the fake API server,
whose Volcano controller runs every pod's real command line as a local process (tests/helpers_kube_eval.py:
the claim and config mounts mapped to local folders, the job's host names to loopback): real pservers and
trainers write real passes on the "claim", real evaluation workers and merge judge them."""

from __future__ import annotations

import json
import signal
import sys

import pytest
from helpers_common import run_cli, wait_until
from helpers_kube import render_plan
from helpers_kube_api import VOLCANO, FakeKubeAPI, fake_cluster
from helpers_kube_eval import VolcanoEvalController, deployment_objects, local_pod_runner
from helpers_passes import write_data_config

from ctr_foundation.records import DonefileEntry
from elastic_control.config.data_config import load_data_config
from elastic_control.kube import adaptor
from elastic_control.kube import constants as k
from elastic_control.training.job_progress import JobProgressAnnotator
from elastic_control.tuning.candidates import CandidateFolder
from elastic_control.tuning.kube import start_candidate
from elastic_control.tuning.split import prepare_split

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
SLOTS = list(range(1, 9))


def test_tune_submits_each_candidate_and_judges_it_with_the_evaluation_jobs(tmp_path):
    claim, config = tmp_path / "claim", tmp_path / "config"
    config.mkdir()
    (config / "slot.conf").write_text("".join(f"{s}\n" for s in SLOTS))
    synth = run_cli("data", "synth", "--output", tmp_path / "data", "--hours", "3", "--lines-per-hour", "2000",
                    "--seed", "11", "-s", config / "slot.conf")  # fmt: skip
    assert synth.returncode == 0, synth.stderr
    # One data.config for the plan, the pods' mounted copy and tune: the data is on this machine's disk.
    write_data_config(config / "data.config", tmp_path / "data", "20191221/00", "20191221/02")
    plan, _ = render_plan(
        tmp_path / "state", trainers=1, pservers=1, cube_shards=1, slot_conf=str(config / "slot.conf"),
        data_config=str(config / "data.config"),
    )  # fmt: skip
    loopback = {}
    for n in range(2):  # the candidates' jobs: the svc plugin's host names, here loopback
        job = f"{plan.job_name}-t{n:03d}"
        for role in ("pserver", "trainer"):
            loopback[f"{job}-{role}-${{VC_TASK_INDEX}}.{job}"] = "127.0.0.1"
            loopback[f"{job}-{role}-0.{job}"] = "127.0.0.1"
    runner = local_pod_runner(
        {k.SHARED_MOUNT: claim, k.CONFIG_MOUNT: config, **loopback},
        env_overrides={"MLFLOW_TRACKING_URI": (tmp_path / "pod-mlruns").as_uri(), "MLFLOW_ALLOW_FILE_STORE": "true",
                       "POD_IP": "127.0.0.1",  # the downward API's status.podIP
                       "OMP_NUM_THREADS": "1"},
        timeout=240,
    )  # fmt: skip
    controller = VolcanoEvalController(runner)
    with FakeKubeAPI(on_volcano_job=controller, job_delete_delay=0.05) as api:
        deployment_objects(api)
        env = {"KUBECONFIG": str(api.write_kubeconfig(tmp_path / "kubeconfig")), "KUBERNETES_SERVICE_HOST": ""}
        res = run_cli(
            "tune", "-f", config / "data.config", "-s", config / "slot.conf", "--validation", "20191221/02",
            "--candidates", "2", "--max-epochs-cap", "1", "--output", tmp_path / "out", "--state-dir",
            tmp_path / "state", "--json", env_extra=env, timeout=800,
        )  # fmt: skip
        controller.join(30)
        jobs = {j["metadata"]["name"]: j["status"]["state"]["phase"] for j in api.items(VOLCANO, "jobs", "default")}
    worker_logs = "".join(p.read_text() for p in (tmp_path / "out" / "candidates").glob("*/worker.log"))
    assert res.returncode == 0, res.stderr[-3000:] + worker_logs[-3000:]
    board = json.loads(res.stdout)
    # Each candidate: its training job and its two evaluation jobs, all Completed in the plan's namespace.
    assert {name for name, phase in jobs.items() if phase == "Completed"} >= {
        f"{plan.job_name}-t000",
        f"{plan.job_name}-t001",
    }
    assert sum(1 for name in jobs if "-eval-" in name or "-merge-" in name) == 4  # workers and merge, each
    rows = board["candidates"]
    assert [r["state"] for r in rows] == ["done", "done"]
    for row in rows:
        assert 0.5 < row["validation"]["auc"] <= 1.0 and row["validation"]["examples"] == 2000
        # The judged pass is on the claim, as the pods wrote it.
        local = claim / row["pass"][len(k.SHARED_MOUNT) + 1 :]
        assert (local / "meta.json").exists() and (local / "golden.jsonl").exists()
    assert board["best"]["candidate"] in {r["candidate"] for r in rows} and board["best"]["why"]
    assert board["best"]["refit"] is None  # the validation hour lies outside the window: nothing to add
    # Every candidate's training pods kept their logs on the claim (the same role, two jobs).
    assert len(list((claim / "logs").glob("*/*-trainer.log"))) >= 2
    print(json.dumps(rows, indent=1), file=sys.stderr)


def test_a_candidate_job_feeds_the_pruner_and_a_stopped_worker_deletes_it(tmp_path, monkeypatch):
    """The passes trainer 0 publishes on the candidate's job reach the candidate's folder, where the pruner reads
    them (CandidateFolder.passes); stopping the worker as tune does (SIGTERM) deletes the job, so a pruned
    candidate frees its place in the queue."""
    config = tmp_path / "config"
    config.mkdir()
    (config / "slot.conf").write_text("".join(f"{s}\n" for s in SLOTS))
    write_data_config(config / "data.config", tmp_path / "data", "20191221/00", "20191221/03")
    with fake_cluster(tmp_path, monkeypatch) as api:
        plan, _ = render_plan(
            tmp_path / "state", trainers=1, pservers=1, cube_shards=1, slot_conf=str(config / "slot.conf"),
            data_config=str(config / "data.config"),
        )  # fmt: skip
        out = tmp_path / "out"
        split = prepare_split(config=load_data_config(config / "data.config"), output=out, validation="20191221/03")
        folder = CandidateFolder.of(out, 0)
        folder.path.mkdir(parents=True)
        proc = start_candidate(plan, folder, {"pass_hours": 1}, output=out, split=split)
        try:
            job = f"{plan.job_name}-t000"
            wait_until(lambda: api.get(VOLCANO, "jobs", "default", job), timeout=60, what="the candidate's job")
            assert folder.passes() == []
            # What trainer 0 sends from the candidate's pod after its second pass (training/job_progress.py).
            annotator = JobProgressAnnotator(adaptor.custom(), "default", job, every=0)
            annotator({"pass": "20191221-01", "epoch": 1}, force=True)
            annotator.passes_done(
                [DonefileEntry(f"pass-20191221-0{h}", "/shared/x", {"start": f"20191221/0{h}", "end": f"20191221/0{h}"},
                               "2026-01-01T00:00:00Z", {"logloss": 0.45 - h / 100}, {}) for h in range(2)]
            )  # fmt: skip
            passes = wait_until(folder.passes, timeout=30, what="passes.json")
            assert passes == [
                {"pass": "pass-20191221-00", "end": "20191221/00", "logloss": 0.45},
                {"pass": "pass-20191221-01", "end": "20191221/01", "logloss": 0.44},
            ]
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 130
            wait_until(lambda: api.get(VOLCANO, "jobs", "default", job) is None, timeout=30, what="job deleted")
            log = (folder.path / "worker.log").read_text()
            assert f"Volcano job default/{job} deleted" in log and "stopped" in log
        finally:
            if proc.poll() is None:
                proc.kill()
