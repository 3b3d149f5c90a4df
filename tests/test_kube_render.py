"""Rendered manifests: schema-valid (strict), admissible by Volcano's webhook, stable (golden), and wired right."""

from __future__ import annotations

import copy
import os

import jsonschema
import pytest
import yaml
from helpers_kube import EXAMPLE_DATA_CONFIG, REPO, render_plan
from helpers_kube_schema import validate_builtin, validate_manifest, validate_volcano_job

from ctr_foundation.errors import UsageError
from ctr_foundation.names import DATA_CONFIG_FILE
from elastic_control.kube import constants as k
from elastic_control.kube.render import MANIFEST_FILES, load_manifests
from elastic_control.kube.volcano_rules import volcano_job_problems

GOLDEN = REPO / "tests" / "golden"
COMBINATIONS = [
    dict(cpu=4, mem=20, trainers=2, pservers=2, cube_shards=5),  # the documented example
    dict(cpu=1, mem=1, trainers=1, pservers=1, cube_shards=1),
    dict(
        cpu=16,
        mem=64,
        trainers=8,
        pservers=4,
        cube_shards=3,
        namespace="ctr-prod",
        image="reg.io/ctr:1.2",
        queue="ads",
        job_name="ctr-daily",
        service_type="LoadBalancer",
        kube={"data_secrets": ("s3-data",)},  # envFrom in the Volcano job's tasks, against its real schema
    ),
    dict(
        cpu=2, mem=4, trainers=512, pservers=256, cube_shards=2, service_type="NodePort", hdfs_address="hdfs://nn:9000"
    ),
    dict(
        cpu=2,
        mem=8,
        trainers=2,
        pservers=1,
        cube_shards=2,
        image="reg.io/ctr@sha256:" + "0" * 64,
        kube={
            "serving_replicas": 4,
            "max_retry": 0,
            "storage_class": "standard-rwo",
            "access_mode": "ReadWriteOnce",
            "image_pull_secrets": ("regcred", "mirror"),
            "pod_overlay": str(REPO / "tests" / "data" / "pod-overlay.yaml"),
        },
    ),
]


@pytest.fixture(autouse=True)
def _stable_env(monkeypatch):
    # examples/data.config expands these; keep the rendered text independent of the caller's shell.
    monkeypatch.delenv("ELASTIC_CTR_DATASET", raising=False)
    monkeypatch.delenv("ELASTIC_CTR_MODELS", raising=False)


def _by_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def _job(docs):
    return _by_kind(docs, "Job")[0]


def _env(container):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


@pytest.mark.needs_volcano_schemas
@pytest.mark.parametrize("flags", COMBINATIONS, ids=lambda f: "-".join(f"{k}{v}" for k, v in list(f.items())[:5]))
def test_every_manifest_validates_strictly(tmp_path, flags):
    _, manifests = render_plan(tmp_path / "state", **flags)
    docs = load_manifests(manifests)
    shards = flags["cube_shards"]
    # shared (ConfigMap, token and credentials Secrets, claim) + (claim, deploy, svc) mlflow + (claim, deploy, svc)
    # file server + (deploy, lookup svc, agent svc) per shard + the shards' PDB + transfer 2 + serving 3
    # + serving's alerting rules (ConfigMap) + job and its progress account (ServiceAccount, Role, RoleBinding)
    # + NetworkPolicies (instance only, serving's clients, and the file server's when its Service is exposed)
    policies = 2 + (flags.get("service_type", "ClusterIP") != "ClusterIP")
    assert len(docs) == 4 + 3 + 3 + 3 * shards + 1 + 2 + 3 + 1 + (1 + 3) + policies
    for doc in docs:
        validate_manifest(doc)
        labels = doc["metadata"]["labels"]
        assert labels[k.LABEL_NAME] == "elastic-ctr"
        assert labels[k.LABEL_INSTANCE] == flags.get("job_name", "elastic-ctr")
        assert labels[k.LABEL_COMPONENT] in k.COMPONENTS + ("training",)
        assert doc["metadata"]["namespace"] == flags.get("namespace", "default")
    assert volcano_job_problems(_job(docs)) == []


def test_volcano_job_matches_the_design(tmp_path):
    _, manifests = render_plan(tmp_path / "state", cpu=4, mem=20, trainers=3, pservers=2, cube_shards=5)
    job = _job(load_manifests(manifests))
    spec = job["spec"]
    assert job["apiVersion"] == "batch.volcano.sh/v1alpha1"
    assert spec["minAvailable"] == 5 and spec["schedulerName"] == "volcano" and spec["queue"] == "default"
    # The instance's NetworkPolicies decide who reaches the job's pods, not the svc plugin's own.
    assert spec["plugins"] == {"svc": ["--disable-network-policy"], "env": []}
    # In order (Volcano takes the first match): a configuration error aborts before PodFailed restarts.
    assert spec["policies"] == [
        {"exitCode": 2, "action": "AbortJob"},
        {"event": "PodEvicted", "action": "RestartJob"},
        {"event": "PodFailed", "action": "RestartJob"},
    ]
    assert spec["maxRetry"] == 3
    tasks = {t["name"]: t for t in spec["tasks"]}
    assert tasks["pserver"]["replicas"] == 2 and tasks["trainer"]["replicas"] == 3
    assert tasks["trainer"]["policies"] == [{"event": "TaskCompleted", "action": "CompleteJob"}]
    for role, task in tasks.items():
        container = task["template"]["spec"]["containers"][0]
        assert container["resources"]["requests"] == {"cpu": "4", "memory": "20Gi"}
        env = _env(container)
        assert env["TRAINING_ROLE"] == role.upper()
        assert (
            env["PADDLE_PSERVERS_IP_PORT_LIST"]
            == "elastic-ctr-pserver-0.elastic-ctr:30240,elastic-ctr-pserver-1.elastic-ctr:30240"
        )
        assert env["PADDLE_TRAINERS_NUM"] == "3"
        assert env["MLFLOW_TRACKING_URI"] == "http://elastic-ctr-mlflow:8111"
        assert env["MODEL_PATH"] == k.POD_MODEL_PATH
        assert env["ELASTIC_CTR_TOKEN"] == {"secretKeyRef": {"name": "elastic-ctr-token", "key": "token"}}
        shell = container["command"][2]
        # The trainer id comes from the env plugin at run time, in the shell (not $(VC_TASK_INDEX)).
        # Trainers check the window first: an offline one with no complete hour is a configuration error.
        # Every role keeps a copy of its log on the shared claim (-l shows it once Volcano deleted the pod).
        check = " --check-window" if role == "trainer" else ""
        entry = f"exec elastic-control role{check} --keep-logs {k.KEPT_LOGS}"
        assert 'PADDLE_TRAINER_ID="${VC_TASK_INDEX' in shell and shell.endswith(entry)
    pserver_shell = tasks["pserver"]["template"]["spec"]["containers"][0]["command"][2]
    assert 'POD_IP="elastic-ctr-pserver-${VC_TASK_INDEX}.elastic-ctr"' in pserver_shell


def test_entry_shell_really_sets_the_trainer_id(tmp_path):
    """Run the trainer's entry shell with VC_TASK_INDEX as Volcano's env plugin sets it."""
    import subprocess

    _, manifests = render_plan(tmp_path / "state")
    tasks = {t["name"]: t for t in _job(load_manifests(manifests))["spec"]["tasks"]}
    for role, expected in (("trainer", "1 "), ("pserver", "1 elastic-ctr-pserver-1.elastic-ctr")):
        shell = tasks[role]["template"]["spec"]["containers"][0]["command"][2]
        probe = shell[: shell.index("exec elastic-control role")] + 'echo "$PADDLE_TRAINER_ID ${POD_IP:-}"'
        out = subprocess.run(
            ["/bin/sh", "-c", probe],
            env={"VC_TASK_INDEX": "1", "PATH": os.environ["PATH"]},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert out == expected.strip()
    # Without the plugin the trainer refuses to start rather than all claiming id 0.
    trainer = tasks["trainer"]["template"]["spec"]["containers"][0]["command"][2]
    bad = subprocess.run(["/bin/sh", "-c", trainer], env={"PATH": os.environ["PATH"]}, capture_output=True, text=True)
    assert bad.returncode != 0 and "VC_TASK_INDEX" in bad.stderr


def test_components_get_their_contract_variables(tmp_path):
    _, manifests = render_plan(tmp_path / "state", cube_shards=3)
    docs = load_manifests(manifests)
    deployments = {d["metadata"]["name"]: d for d in _by_kind(docs, "Deployment")}
    transfer = _env(deployments["elastic-ctr-cube-transfer"]["spec"]["template"]["spec"]["containers"][0])
    assert transfer["ELASTIC_CTR_CUBE_AGENTS"] == ",".join(f"http://elastic-ctr-cube-agent-{i}:8001" for i in range(3))
    assert transfer["ELASTIC_CTR_CUBE_SERVERS"] == ",".join(f"http://elastic-ctr-cube-{i}:8027" for i in range(3))
    assert transfer["ELASTIC_CTR_FILESERVER_URL"] == "http://elastic-ctr-fileserver:8080"
    server, agent = deployments["elastic-ctr-cube-2"]["spec"]["template"]["spec"]["containers"]
    assert server["command"] == ["cube-server", "--port", "8027", "--shard", "2", "--data", k.CUBE_DATA_DIR]
    assert _env(agent)["ELASTIC_CTR_CUBE_SHARD"] == "2"
    serving = deployments["elastic-ctr-serving"]["spec"]["template"]["spec"]["containers"][0]
    assert serving["command"] == ["elastic-control", "serve", "--port", "8010", "--drain-delay", "5"]
    assert _env(serving)["ELASTIC_CTR_SERVING_GRPC_PORT"] == "8011"
    assert [p["containerPort"] for p in serving["ports"]] == [8010, 8011]
    assert serving["readinessProbe"]["httpGet"]["path"] == "/readyz"
    fileserver = deployments["elastic-ctr-fileserver"]["spec"]["template"]["spec"]
    assert fileserver["containers"][0]["command"] == [
        "elastic-control",
        "fileserver",
        "--root",
        k.FILESERVER_ROOT,
        "--port",
        "8080",
        "--kept-logs",
        k.KEPT_LOGS,
    ]
    # The training pods' kept logs: the shared claim, read-only (the file server never writes it).
    shared = next(v for v in fileserver["volumes"] if v["name"] == "shared")
    assert shared["persistentVolumeClaim"] == {"claimName": "elastic-ctr-shared", "readOnly": True}
    mount = next(m for m in fileserver["containers"][0]["volumeMounts"] if m["name"] == "shared")
    assert mount == {"name": "shared", "mountPath": k.SHARED_MOUNT, "readOnly": True}
    # Every selector selects its own pod template, and every Service finds a Deployment's pods.
    for dep in deployments.values():
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for svc in _by_kind(docs, "Service"):
        assert any(
            svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
            for d in deployments.values()
        ), svc["metadata"]["name"]
    # The ConfigMap carries what -r validated, expanded for pods that lack the user's environment.
    config = _by_kind(docs, "ConfigMap")[0]["data"]
    assert config["slot.conf"].splitlines()[:3] == ["1", "2", "3"]
    assert 'export DATASET_PATH="/tmp/elastic-ctr/data"' in config["data.config"]
    assert f'export MODEL_PATH="{k.POD_MODEL_PATH}"' in config["data.config"]


def test_golden_manifests_for_the_documented_example(tmp_path):
    """`-r -u 4 -m 20 -t 2 -p 2 -b 5 -s examples/slot.conf -f examples/data.config`, fixed token.

    Regenerate after an intended change with UPDATE_GOLDEN=1.
    """
    _, manifests = render_plan(tmp_path / "state", cpu=4, mem=20, trainers=2, pservers=2, cube_shards=5)
    names = sorted(p.name for p in manifests.iterdir())
    assert names == sorted(f for f, _ in MANIFEST_FILES)
    for name in names:
        got = (manifests / name).read_text()
        golden = GOLDEN / name
        if os.environ.get("UPDATE_GOLDEN"):
            golden.write_text(got)
        assert golden.exists(), f"{golden} missing: run with UPDATE_GOLDEN=1"
        assert got == golden.read_text(), f"{name} differs from {golden}; if intended, run with UPDATE_GOLDEN=1"


def test_token_file_mode_and_secret(tmp_path):
    _, manifests = render_plan(tmp_path / "state", token="abc123")
    assert (manifests / "00-shared.yaml").stat().st_mode & 0o077 == 0  # holds the token
    assert (manifests / "30-cube.yaml").stat().st_mode & 0o044 == 0o044
    secret = _by_kind(load_manifests(manifests), "Secret")[0]
    assert secret["stringData"] == {"token": "abc123"}


def test_the_state_folders_data_config_is_readable_by_its_owner_only(tmp_path):
    """It may carry HDFS_UGI (user and password), whatever the mode of the file it was copied from."""
    source = tmp_path / "data.config"
    source.write_text(EXAMPLE_DATA_CONFIG.read_text() + 'export HDFS_UGI="alice,s3cr3t"\n')
    source.chmod(0o644)
    render_plan(tmp_path / "state", data_config=str(source))
    assert (tmp_path / "state" / DATA_CONFIG_FILE).stat().st_mode & 0o077 == 0


# ---- the strict schema and the webhook rules catch what they should ------------------------------------------


@pytest.fixture()
def rendered_job(tmp_path):
    _, manifests = render_plan(tmp_path / "state")
    return _job(load_manifests(manifests))


@pytest.mark.needs_volcano_schemas
def test_strict_schema_rejects_a_misspelt_field(rendered_job):
    bad = copy.deepcopy(rendered_job)
    bad["spec"]["minAvaliable"] = bad["spec"].pop("minAvailable")
    with pytest.raises(jsonschema.ValidationError, match="'minAvaliable' was unexpected"):
        validate_volcano_job(bad)
    bad = copy.deepcopy(rendered_job)
    bad["spec"]["tasks"][1]["template"]["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(jsonschema.ValidationError, match="'resource' was unexpected"):
        validate_volcano_job(bad)
    bad = copy.deepcopy(rendered_job)
    bad["spec"]["policies"][0]["event"] = "PodCrashed"
    with pytest.raises(jsonschema.ValidationError, match="PodCrashed"):
        validate_volcano_job(bad)


def test_strict_builtin_validation_rejects_a_misspelt_field(tmp_path):
    _, manifests = render_plan(tmp_path / "state")
    dep = copy.deepcopy(_by_kind(load_manifests(manifests), "Deployment")[0])
    dep["spec"]["replica"] = 2
    with pytest.raises(Exception, match="'replica' was unexpected"):
        validate_builtin(dep)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda s: s.update(minAvailable=99), "minAvailable 99 is above the sum of task replicas 4"),
        (lambda s: s["tasks"][1].update(name="pserver"), "task name 'pserver' is used twice"),
        (
            lambda s: s["policies"].append({"event": "OutOfSync", "action": "RestartJob"}),
            "policy event 'OutOfSync' is not allowed",
        ),
        (
            lambda s: s["policies"].append({"event": "TaskFailed", "action": "Reboot"}),
            "policy action 'Reboot' is not allowed",
        ),
        (
            lambda s: s["policies"].append({"event": "PodFailed", "action": "AbortJob"}),
            "policy event 'PodFailed' appears twice",
        ),
        (
            lambda s: s["tasks"][0].update(
                policies=[{"event": "*", "action": "AbortJob"}, {"event": "PodFailed", "action": "AbortJob"}]
            ),
            "the '\\*' event must stand alone",
        ),
        (lambda s: s["plugins"].update(gang=[]), "plugin 'gang' is not registered"),
        (lambda s: s["tasks"][0].update(replicas=10**50), "characters; Kubernetes allows 63"),
        (lambda s: s["tasks"].clear(), "at least one task"),
    ],
)
def test_webhook_rules(rendered_job, mutate, message):
    job = copy.deepcopy(rendered_job)
    mutate(job["spec"])
    assert any(__import__("re").search(message, p) for p in volcano_job_problems(job)), volcano_job_problems(job)


def test_long_job_name_is_refused_before_anything_is_written(tmp_path):
    state = tmp_path / "state"
    with pytest.raises(UsageError, match="job name 'x{41}' must .* at most 40 characters"):
        render_plan(state, job_name="x" * 41)
    assert not (state / "manifests").exists() and not (state / "plan.json").exists()


def test_rendered_yaml_is_plain_block_yaml(tmp_path):
    _, manifests = render_plan(tmp_path / "state")
    text = (manifests / "60-training-job.yaml").read_text()
    assert text.startswith("# Rendered by `elastic-control -r`")
    assert "{{" not in text and "{%" not in text
    assert [d["kind"] for d in yaml.safe_load_all(text)] == ["ServiceAccount", "Role", "RoleBinding", "Job"]
