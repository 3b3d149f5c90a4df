"""The cluster evaluation: rendered Volcano jobs (strict schema, webhook rules, golden), and
`eval submit` against the fake API server with a fake Volcano controller, once with stub pods and once
running the rendered worker/merge command lines as real local processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml
from helpers_kube import REPO, render_plan
from helpers_kube_api import VOLCANO, FakeKubeAPI
from helpers_kube_eval import VolcanoEvalController, deployment_objects, local_pod_runner
from helpers_kube_schema import validate_volcano_job

from ctr_foundation.errors import UsageError
from elastic_control.kube import constants as k
from elastic_control.kube.eval_job import EvalJobRequest, render_eval_job
from elastic_control.kube.render import RenderInputs, load_manifests
from elastic_control.kube.volcano_rules import volcano_job_problems

GOLDEN = REPO / "tests" / "golden" / "eval-job"


@pytest.fixture(autouse=True)
def _stable_env(monkeypatch):
    monkeypatch.delenv("ELASTIC_CTR_DATASET", raising=False)
    monkeypatch.delenv("ELASTIC_CTR_MODELS", raising=False)


def _render(tmp_path, request: EvalJobRequest, **plan_flags):
    plan, _ = render_plan(tmp_path / "state", **plan_flags)
    inputs = RenderInputs(token=plan.token(), data_config=plan.data_config())
    return plan, render_eval_job(plan, inputs, request, plan.state_path)


def _entry(job):
    return job["spec"]["tasks"][0]["template"]["spec"]["containers"][0]["command"][2]


REQUESTS = [
    dict(model="pass-20191221-00", workers=1),
    dict(
        model="pass-20191221-05",
        baseline="pass-20191221-04",
        workers=8,
        group_slot=3,
        ndcg_k=5,
        start="20191221/06",
        end="20191221/07",
    ),
    dict(model="/var/lib/elastic-ctr/models/pass-20191221-00", workers=512, run="daily1"),
]


@pytest.mark.needs_volcano_schemas
@pytest.mark.parametrize("fields", REQUESTS, ids=["one", "baseline-group-window", "max-workers"])
def test_eval_jobs_validate_strictly_and_pass_the_webhook_rules(tmp_path, fields):
    _, files = _render(tmp_path, EvalJobRequest(**fields), job_name="a" * 40)
    for job in (files.workers_job, files.merge_job):
        validate_volcano_job(job)
        assert volcano_job_problems(job) == []
        assert job["metadata"]["labels"][k.LABEL_INSTANCE] == "a" * 40
    # What is on disk is what is applied.
    assert yaml.safe_load(files.workers_path.read_text()) == files.workers_job
    assert yaml.safe_load(files.merge_path.read_text()) == files.merge_job
    assert files.workers_path.parent == tmp_path / "state" / "eval" / files.run
    assert not list((tmp_path / "state" / "manifests").glob("*eval*"))  # -a never applies it


def test_worker_and_merge_jobs_follow_the_contract(tmp_path):
    request = EvalJobRequest(model="pass-20191221-05", baseline="pass-20191221-04", workers=6, group_slot=3)
    _, files = _render(tmp_path, request)
    spec = files.workers_job["spec"]
    (task,) = spec["tasks"]
    assert task["name"] == "worker" and task["replicas"] == 6
    assert spec["minAvailable"] == 1 and spec["minSuccess"] == 6 and spec["plugins"] == {"env": []}
    assert {(p["event"], p["action"]) for p in task["policies"]} == {
        ("PodFailed", "RestartTask"),
        ("PodEvicted", "RestartTask"),
    }
    entry = _entry(files.workers_job)
    root = f"/var/lib/elastic-ctr/eval/{files.run}"
    assert entry == (
        "exec elastic-control eval --model /var/lib/elastic-ctr/models/pass-20191221-05 "
        "--baseline /var/lib/elastic-ctr/models/pass-20191221-04 -f /etc/elastic-ctr/data.config "
        "--group-slot 3 --ndcg-k 10 "
        '--shard "${VC_TASK_INDEX:?the Volcano env plugin did not set VC_TASK_INDEX}/6" '
        f"--partial-out {root}/partials"
    )
    # The shell gives each worker its own share; nothing else differs between them.
    shards = [
        subprocess.run(
            ["/bin/sh", "-c", entry.replace("exec elastic-control", "echo")],
            env={"VC_TASK_INDEX": str(i), "PATH": os.environ["PATH"]},
            capture_output=True,
            text=True,
        ).stdout.split()
        for i in range(6)
    ]
    assert [s[s.index("--shard") + 1] for s in shards] == [f"{i}/6" for i in range(6)]
    assert len({tuple(x for x in s if "/6" not in x) for s in shards}) == 1
    missing = subprocess.run(["/bin/sh", "-c", entry], env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    assert missing.returncode != 0 and "did not set VC_TASK_INDEX" in missing.stderr
    merge = files.merge_job
    container = merge["spec"]["tasks"][0]["template"]["spec"]["containers"][0]
    assert container["command"][2] == (
        f"exec elastic-control eval merge --partial-out {root}/partials --output {root}/out --json"
    )
    assert {"name": "MLFLOW_TRACKING_URI", "value": "http://elastic-ctr-mlflow:8111"} in container["env"]
    # The same evaluation gets the same run (a resubmission reuses its partials); another one does not.
    _, again = _render(tmp_path / "again", request)
    _, other = _render(tmp_path / "other", EvalJobRequest(model="pass-20191221-05", workers=6))
    assert again.run == files.run != other.run


def test_cube_transfer_records_gate_decisions_on_the_mlflow_server(tmp_path):
    _, manifests = render_plan(tmp_path / "state")
    transfer = next(
        d
        for d in load_manifests(manifests)
        if d["kind"] == "Deployment" and d["metadata"]["name"] == "elastic-ctr-cube-transfer"
    )
    env = {e["name"]: e.get("value") for e in transfer["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["MLFLOW_TRACKING_URI"] == "http://elastic-ctr-mlflow:8111"


def test_golden_eval_job(tmp_path):
    request = EvalJobRequest(
        model="pass-20191221-05",
        baseline="pass-20191221-04",
        workers=4,
        group_slot=3,
        start="20191221/06",
        end="20191221/07",
        run="golden",
    )
    _, files = _render(tmp_path, request)
    for path in (files.workers_path, files.merge_path):
        golden = GOLDEN / path.name
        if os.environ.get("UPDATE_GOLDEN"):
            golden.parent.mkdir(parents=True, exist_ok=True)
            golden.write_text(path.read_text())
        assert golden.exists(), f"{golden} missing: run with UPDATE_GOLDEN=1"
        assert path.read_text() == golden.read_text(), f"{path.name} differs from {golden}; UPDATE_GOLDEN=1 if intended"


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(model="pass 1", workers=2), "must be a pass name"),
        (dict(model="../pass", workers=2), "must be a pass name"),
        (dict(model="p", workers=0), "between 1 and 512"),
        (dict(model="p", workers=513), "between 1 and 512"),
        (dict(model="p", workers=2, run="Nightly_1"), "short name"),
        (dict(model="p", workers=2, start="2019-12-21"), "YYYYMMDD/HH"),
        (dict(model="p", workers=2, start="20191221/05", end="20191221/04"), "before --start"),
    ],
)
def test_bad_requests_are_refused_before_rendering(tmp_path, fields, message):
    with pytest.raises(UsageError, match=message):
        _render(tmp_path, EvalJobRequest(**fields))


def test_pod_names_that_would_be_too_long_are_refused(tmp_path):
    with pytest.raises(UsageError, match=r"pod name .* is 6\d characters"):
        _render(tmp_path, EvalJobRequest(model="p", workers=512, run="a-long-name1"), job_name="a" * 40)


# ---- eval submit against the fake API server ------------------------------------------------------------------


def _submit(state, kubeconfig, *args, timeout=300):
    env = dict(os.environ, KUBECONFIG=str(kubeconfig), ELASTIC_CTR_STATE_DIR=str(state))
    env.pop("KUBERNETES_SERVICE_HOST", None)
    return subprocess.run(
        [sys.executable, "-m", "elastic_control", "eval", "submit", *map(str, args), "--poll-interval", "0.2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=REPO,
    )


def _stub_pods(worker_code=0, worker_log=("share scored",)):
    metrics = {
        "model": {"pass": "pass-20191221-00", "auc": 0.75, "logloss": 0.5, "examples": 10},
        "data": {"window": {"start": "20191221/00", "end": "20191221/01"}, "shares": 3},
    }

    def run(pod, kill_after=None):
        if kill_after is not None:
            return 137, ["Killed"]
        if pod["metadata"]["labels"]["volcano.sh/task-spec"] == "merge":
            return 0, ["merging", json.dumps(metrics), "✓ wrote metrics.json"]
        return worker_code, list(worker_log)

    return run


def test_submit_runs_workers_then_merge_and_survives_a_lost_worker(tmp_path):
    plan, _ = render_plan(tmp_path / "state")
    controller = VolcanoEvalController(_stub_pods(), fail_first={("worker", 2)})
    with FakeKubeAPI(on_volcano_job=controller, job_delete_delay=0.05) as api:
        deployment_objects(api)
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        r = _submit(plan.state_path, kubeconfig, "--model", "pass-20191221-00", "--workers", 3, "--run", "t1", "--json")
        controller.join()
        assert r.returncode == 0, r.stderr[-3000:]
        assert json.loads(r.stdout)["model"]["auc"] == 0.75
        assert "restarted the worker task" in r.stderr and "only the lost share" in r.stderr
        workers = api.get(VOLCANO, "jobs", "default", "elastic-ctr-eval-t1")
        assert workers["status"]["state"]["phase"] == "Completed" and workers["status"]["retryCount"] == 1
        # Lost worker 2 ran twice; Volcano's RestartTask recreated its siblings too (their shares exit at once).
        assert controller.attempts[("elastic-ctr-eval-t1", "worker", 2)] == 2
        # The merge job is created only after the worker job completed.
        assert controller.created == [
            ("elastic-ctr-eval-t1", {}),
            ("elastic-ctr-merge-t1", {"elastic-ctr-eval-t1": "Completed"}),
        ]
        assert api.get(VOLCANO, "jobs", "default", "elastic-ctr-merge-t1")["status"]["state"]["phase"] == "Completed"
        assert (plan.state_path / "eval" / "t1" / "10-eval-workers.yaml").exists()


def test_submit_reports_a_worker_that_keeps_failing(tmp_path):
    plan, _ = render_plan(tmp_path / "state")
    controller = VolcanoEvalController(
        _stub_pods(worker_code=1, worker_log=("scoring", "⨯ no complete hour in 20191221/00..20191221/01 under /data"))
    )
    with FakeKubeAPI(on_volcano_job=controller, job_delete_delay=0.05) as api:
        deployment_objects(api)
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        r = _submit(plan.state_path, kubeconfig, "--model", "pass-20191221-00", "--workers", 2, "--run", "t2")
        controller.join()
        assert r.returncode == 1 and "Traceback" not in r.stderr
        last = r.stderr.strip().splitlines()[-1]
        assert "elastic-ctr-eval-t2" in last and "Failed after 3 restart(s)" in last
        assert "worker-0 failed: ⨯ no complete hour" in last and "kubectl logs" in last
        assert api.get(VOLCANO, "jobs", "default", "elastic-ctr-merge-t2") is None  # never merged


def test_submit_errors_are_one_line(tmp_path):
    plan, _ = render_plan(tmp_path / "state")
    with FakeKubeAPI() as api:
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        r = _submit(plan.state_path, kubeconfig, "--model", "pass-20191221-00", "--workers", 2)
        assert r.returncode == 1 and "Traceback" not in r.stderr
        assert "ConfigMap default/elastic-ctr-config does not exist" in r.stderr and "-a` first" in r.stderr
        assert not [x for x in api.requests if x[0] == "POST"]
    local, _ = render_plan(tmp_path / "local", backend="local")
    r = _submit(local.state_path, tmp_path / "kubeconfig", "--model", "pass-1")
    assert r.returncode == 2 and "local backend" in r.stderr and "Traceback" not in r.stderr


# ---- the rendered command lines as real processes -------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.slow  # five evaluation processes on product-trained passes: 45-90 s on 2 busy cores
def test_rendered_workers_run_for_real_and_the_merge_equals_one_process(tmp_path, monkeypatch, synth_world):
    """Real passes, real `elastic-control eval --shard` workers started from the manifest's own shell lines
    (mount points mapped to local folders), worker 1 killed once and redone, then the real merge."""
    from helpers_passes import GROUP_SLOT, LINES_PER_HOUR, write_data_config

    shared, config = tmp_path / "shared", tmp_path / "config"
    synth_world.copy_models(shared / "models")
    model, baseline = synth_world.passes[-1].name, synth_world.passes[0].name
    pass_dir = shared / "models" / model
    first, last = synth_world.holdout
    config.mkdir()
    write_data_config(config / "data.config", synth_world.data, first, last)
    mlruns = tmp_path / "mlruns"
    runner = local_pod_runner(
        {k.SHARED_MOUNT: shared, k.CONFIG_MOUNT: config},
        env_overrides={
            "MLFLOW_TRACKING_URI": mlruns.as_uri(),
            "MLFLOW_ALLOW_FILE_STORE": "true",
            "OMP_NUM_THREADS": "1",
        },
    )
    controller = VolcanoEvalController(runner, fail_first={("worker", 1)}, kill_after=1.0)
    plan, _ = render_plan(tmp_path / "state")
    with FakeKubeAPI(on_volcano_job=controller, job_delete_delay=0.05) as api:
        deployment_objects(api)
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        r = _submit(
            plan.state_path,
            kubeconfig,
            "--model",
            model,
            "--baseline",
            baseline,
            "--workers",
            2,
            "--group-slot",
            GROUP_SLOT,
            "--start",
            first,
            "--end",
            last,
            "--run",
            "real",
            "--json",
            timeout=400,
        )
        controller.join()
        assert r.returncode == 0, r.stderr[-3000:]
        merged = json.loads(r.stdout)
        logs = {p["metadata"]["name"]: api.logs[p["metadata"]["uid"]] for p in api.items("v1", "pods", "default")}
    assert controller.attempts[("elastic-ctr-eval-real", "worker", 1)] == 2
    # Worker 0's share survived the restart of the worker task: its second run kept it.
    assert any("already complete" in line for line in logs["elastic-ctr-eval-real-worker-0"])
    out = shared / "eval" / "real" / "out"
    assert json.loads((out / "metrics.json").read_text())["model"] == merged["model"]
    assert (out / "scored.parquet").exists()

    from elastic_control.evaluation.parallel import evaluate
    from elastic_control.evaluation.shares import EvalSpec

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "unused").as_uri())
    spec = EvalSpec.create(
        model=pass_dir,
        baseline=shared / "models" / baseline,
        data_config=config / "data.config",
        shares=1,
        group_slot=GROUP_SLOT,
    )
    single = evaluate(spec, workers=1)
    for key in ("model", "baseline", "comparison"):
        assert merged[key] == json.loads(json.dumps(single.metrics[key])), key  # exact, not approximate
    assert merged["model"]["examples"] == 2 * LINES_PER_HOUR and merged["data"]["shares"] == 2
    assert min(merged["data"]["share_examples"]) > 0
    # The merge pod's MLFLOW_TRACKING_URI reached MLflow: the evaluation run is there.
    assert list(mlruns.glob("*/*/meta.yaml")), "no MLflow run recorded by the merge"
