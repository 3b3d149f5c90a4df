"""What the rendered manifests promise a cluster: Pod Security "restricted", readiness meaning
"loaded", drains, disruption budgets, credentials only in Secrets, rolling on config changes, the
job's exit-code policies, and the -r options (replicas, retries, images, storage, pod overlay)."""

from __future__ import annotations

import copy

import pytest
import yaml
from helpers_kube import render_plan
from helpers_kube_schema import validate_builtin
from pod_harness.admission import restricted_violations
from pod_harness.node_agent import admitted_ports

from ctr_foundation.errors import ConfigError, UsageError
from elastic_control.config.data_config import parse_data_config
from elastic_control.kube import constants as k
from elastic_control.kube.eval_job import EvalJobRequest, render_eval_job
from elastic_control.kube.options import KubeOptions, pull_policy_for
from elastic_control.kube.pod_overlay import pod_templates
from elastic_control.kube.render import RenderInputs, load_manifests
from elastic_control.kube.volcano_rules import volcano_job_problems


@pytest.fixture(autouse=True)
def _stable_env(monkeypatch):
    monkeypatch.delenv("ELASTIC_CTR_DATASET", raising=False)
    monkeypatch.delenv("ELASTIC_CTR_MODELS", raising=False)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("HOME", "/nonexistent-home")  # no ~/.kube/config either


def docs_of(tmp_path, **kwargs) -> list[dict]:
    _, manifests = render_plan(tmp_path / "state", **kwargs)
    return load_manifests(manifests)


def eval_docs(plan) -> list[dict]:
    inputs = RenderInputs(
        token=plan.token(), data_config=plan.data_config(), service_type=plan.service_type,
        options=KubeOptions.from_json(plan.kube),
    )  # fmt: skip
    files = render_eval_job(plan, inputs, EvalJobRequest(model="pass-20191221-00", workers=2), plan.state_path)
    return [files.workers_job, files.merge_job]


def all_pod_templates(tmp_path, **kwargs) -> list[tuple[str, dict]]:
    plan, manifests = render_plan(tmp_path / "state", **kwargs)
    out = []
    for doc in load_manifests(manifests) + eval_docs(plan):
        out += [(doc["metadata"]["name"], t) for t in pod_templates(doc)]
    return out


def by_name(docs, kind, name):
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def containers(template) -> list[dict]:
    return (template["spec"].get("initContainers") or []) + template["spec"]["containers"]


# ---- Pod Security "restricted" ----------------------------------------------------------------------------------


@pytest.mark.parametrize("flags", [{}, {"trainers": 3, "cube_shards": 3, "kube": {"access_mode": "ReadWriteOnce"}}])
def test_every_container_of_every_pod_passes_pod_security_restricted(tmp_path, flags):
    templates = all_pod_templates(tmp_path, **flags)
    assert len(templates) >= 9  # mlflow, file server, shards, transfer, serving, pserver, trainer, eval, merge
    for owner, template in templates:
        spec = template["spec"]
        assert restricted_violations(spec) == [], owner
        pod_sc = spec["securityContext"]
        assert pod_sc["runAsNonRoot"] is True and pod_sc["runAsUser"] == 10001 and pod_sc["runAsGroup"] == 10001
        assert pod_sc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["enableServiceLinks"] is False, owner
        # Only the trainers call the API (their job's progress annotation, as an account that may patch that one
        # job: tests/test_kube_progress.py); every other pod has no token to steal.
        trainer = [c["name"] for c in spec["containers"]] == ["trainer"]
        assert spec["automountServiceAccountToken"] is trainer, owner
        for c in containers(template):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, (owner, c["name"])
            assert sc["capabilities"] == {"drop": ["ALL"]}, (owner, c["name"])
            assert "privileged" not in sc and not any(p.get("hostPort") for p in c.get("ports", []))
            # Resources on every container, init containers too (a ResourceQuota refuses pods without them).
            for side in ("requests", "limits"):
                assert set(c["resources"][side]) == {"cpu", "memory"}, (owner, c["name"])
        assert all(
            set(v) - {"name"} <= {"configMap", "secret", "emptyDir", "persistentVolumeClaim"}
            for v in spec.get("volumes", [])
        )


@pytest.mark.parametrize(
    "breaks, rule",
    [
        (lambda s: s["containers"][0]["securityContext"].pop("allowPrivilegeEscalation"), "allowPrivilegeEscalation"),
        (lambda s: s["containers"][0]["securityContext"]["capabilities"].update(drop=[]), "drop ALL"),
        (lambda s: s["containers"][0]["securityContext"]["capabilities"].update(add=["NET_ADMIN"]), "NET_ADMIN"),
        (lambda s: s["securityContext"].pop("seccompProfile"), "seccompProfile"),
        (lambda s: s["securityContext"].pop("runAsNonRoot"), "runAsNonRoot"),
        (lambda s: s["securityContext"].update(runAsUser=0), "runAsUser=0"),
        (lambda s: s.update(hostNetwork=True), "hostNetwork"),
        (lambda s: s["volumes"].append({"name": "h", "hostPath": {"path": "/"}}), "hostPath"),
        (lambda s: s["containers"][0]["securityContext"].update(privileged=True), "privileged"),
        (lambda s: s["securityContext"].update(seLinuxOptions={"user": "system_u"}), "seLinuxOptions.user"),
        (lambda s: s["containers"][0]["securityContext"].update(appArmorProfile={"type": "Unconfined"}), "AppArmor"),
    ],
)
def test_the_restricted_check_catches_each_rule(tmp_path, breaks, rule):
    _, template = next(t for t in all_pod_templates(tmp_path) if t[0] == "elastic-ctr-serving")
    spec = copy.deepcopy(template["spec"])
    breaks(spec)
    assert any(rule in problem for problem in restricted_violations(spec)), restricted_violations(spec)


# ---- readiness, drains, ports, disruption budgets ----------------------------------------------------------------


def test_readiness_means_loaded_and_pods_drain_before_sigterm(tmp_path):
    docs = docs_of(tmp_path, cube_shards=2)
    serving = by_name(docs, "Deployment", "elastic-ctr-serving")
    assert serving["spec"]["replicas"] == 2 and serving["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pod = serving["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}  # a model loaded, cube answering
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["/bin/sh", "-c", f"sleep {k.PRESTOP_SLEEP_SECONDS}"]
    assert pod["terminationGracePeriodSeconds"] > k.PRESTOP_SLEEP_SECONDS + 10
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 8010, "grpc": 8011}
    shard = by_name(docs, "Deployment", "elastic-ctr-cube-1")["spec"]["template"]["spec"]
    server, agent = shard["containers"]
    assert server["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "cube"}  # nothing loaded: not ready
    assert agent["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "agent"}  # holds the active version
    assert server["lifecycle"]["preStop"]["exec"]["command"][-1] == f"sleep {k.CUBE_PRESTOP_SLEEP_SECONDS}"
    assert shard["terminationGracePeriodSeconds"] > k.CUBE_PRESTOP_SLEEP_SECONDS + 5
    # Lookups only reach ready shards; the agents (how a first version gets in) are reachable before.
    lookup, control = (
        by_name(docs, "Service", "elastic-ctr-cube-1"),
        by_name(docs, "Service", "elastic-ctr-cube-agent-1"),
    )
    assert not lookup["spec"].get("publishNotReadyAddresses") and control["spec"]["publishNotReadyAddresses"] is True
    assert [p["targetPort"] for p in lookup["spec"]["ports"]] == ["cube"]
    assert [p["targetPort"] for p in control["spec"]["ports"]] == ["agent"]
    # Every named port a probe or a Service uses exists in the pods it points at.
    for doc in docs:
        for template in pod_templates(doc):
            names = {p["name"] for c in containers(template) for p in c.get("ports", [])}
            for c in containers(template):
                for probe in ("readinessProbe", "livenessProbe"):
                    if probe in c:
                        assert c[probe]["httpGet"]["port"] in names
        if doc["kind"] == "Service":
            pods = [
                t for d in docs for t in pod_templates(d)
                if doc["spec"]["selector"].items() <= t["metadata"]["labels"].items()
            ]  # fmt: skip
            assert pods, doc["metadata"]["name"]
            for port in doc["spec"]["ports"]:
                assert all(
                    port["targetPort"] in {p["name"] for c in containers(t) for p in c.get("ports", [])} for t in pods
                )


def test_every_container_has_a_read_only_root_and_a_private_tmp(tmp_path):
    templates = all_pod_templates(tmp_path)
    assert len(templates) >= 8
    for name, template in templates:
        spec = template["spec"]
        assert {"name": "tmp", "emptyDir": {}} in spec["volumes"], name
        for c in spec.get("initContainers", []) + spec["containers"]:
            assert c["securityContext"]["readOnlyRootFilesystem"] is True, (name, c["name"])
            assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"], (name, c["name"])


def test_every_long_running_container_has_readiness_and_liveness(tmp_path):
    docs = docs_of(tmp_path, cube_shards=2)
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    assert len(deployments) == 2 + 2 + 1 + 1  # mlflow, file server, 2 shards, cube-transfer, serving
    for doc in deployments:
        for c in doc["spec"]["template"]["spec"]["containers"]:
            assert "readinessProbe" in c and "livenessProbe" in c, (doc["metadata"]["name"], c["name"])
            live = c["livenessProbe"]
            # Restarted only after a minute of silence: never for a slow answer during a long rollout.
            assert live["periodSeconds"] * live["failureThreshold"] >= 60


def test_disruption_budgets_for_serving_and_the_shards(tmp_path):
    docs = docs_of(tmp_path, cube_shards=3)
    pdbs = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "PodDisruptionBudget"}
    assert pdbs["elastic-ctr-serving"]["maxUnavailable"] == 1
    assert pdbs["elastic-ctr-cube"]["maxUnavailable"] == 1  # a drain takes one shard at a time
    shards = [by_name(docs, "Deployment", f"elastic-ctr-cube-{i}") for i in range(3)]
    selector = pdbs["elastic-ctr-cube"]["selector"]["matchLabels"]
    assert all(selector.items() <= s["spec"]["template"]["metadata"]["labels"].items() for s in shards)


@pytest.mark.parametrize("replicas", [1, 3])
def test_serving_replicas_option(tmp_path, replicas):
    docs = docs_of(tmp_path, kube={"serving_replicas": replicas})
    assert by_name(docs, "Deployment", "elastic-ctr-serving")["spec"]["replicas"] == replicas


@pytest.mark.parametrize("kube, message", [
    ({"serving_replicas": 0}, r"--serving-replicas 0 is out of range \(1-64\)"),
    ({"max_retry": -1}, r"--max-retry -1 is out of range"),
    ({"storage_class": "Fast_SSD"}, r"--storage-class 'Fast_SSD' is not a StorageClass name"),
    ({"access_mode": "ReadOnlyMany"}, r"--access-mode 'ReadOnlyMany' is not one of"),
    ({"image_pull_secrets": ("Bad Name",)}, r"--image-pull-secret 'Bad Name' is not a Secret name"),
])  # fmt: skip
def test_bad_options_are_refused_before_anything_is_written(tmp_path, kube, message):
    with pytest.raises(UsageError, match=message):
        render_plan(tmp_path / "state", kube=kube)
    assert not (tmp_path / "state" / "plan.json").exists()


# ---- credentials and config ---------------------------------------------------------------------------------------


def test_credentials_are_only_in_secrets(tmp_path):
    config = tmp_path / "data.config"
    config.write_text(
        "export HDFS_UGI='ads,pa$$w\"rd'\nexport START_DATE_HR=20191221/00\nexport END_DATE_HR=20191221/01\n"
        'export DATASET_PATH="hdfs://nn:9000/ctr"\n'
    )
    docs = docs_of(tmp_path, data_config=str(config))
    configmap = by_name(docs, "ConfigMap", "elastic-ctr-config")
    text = yaml.safe_dump(configmap)
    assert "pa$" not in text and "ads," not in text
    assert by_name(docs, "Secret", "elastic-ctr-credentials")["stringData"] == {"HDFS_UGI": 'ads,pa$$w"rd'}
    # Pods read data.config with HDFS_UGI in their environment (from the Secret): the credential comes back.
    parsed = parse_data_config(configmap["data"]["data.config"], env={"HDFS_UGI": 'ads,pa$$w"rd'})
    assert parsed.hdfs_ugi == 'ads,pa$$w"rd' and parsed.dataset_path == "hdfs://nn:9000/ctr"
    ref = {"name": "HDFS_UGI", "valueFrom": {"secretKeyRef": {"name": "elastic-ctr-credentials", "key": "HDFS_UGI"}}}
    readers = {"pserver", "trainer", "cube-transfer"}
    for doc in docs:
        for template in pod_templates(doc):
            for c in template["spec"]["containers"]:
                has = ref in c.get("env", [])
                assert has == (c["name"] in readers), c["name"]
    # Nothing but the ConfigMap's copy reaches the file server's root (its init container copies that).
    init = by_name(docs, "Deployment", "elastic-ctr-fileserver")["spec"]["template"]["spec"]["initContainers"][0]
    assert "/etc/elastic-ctr/data.config" in init["command"][-1] and not any(
        "HDFS" in str(e) for e in init.get("env", [])
    )


def test_no_credentials_secret_without_a_credential(tmp_path):
    config = tmp_path / "data.config"
    config.write_text(
        "export START_DATE_HR=20191221/00\nexport END_DATE_HR=20191221/01\nexport DATASET_PATH=s3://b/d\n"
    )
    docs = docs_of(tmp_path, data_config=str(config))
    assert not [d for d in docs if d["metadata"]["name"] == "elastic-ctr-credentials"]
    assert "HDFS_UGI" not in yaml.safe_dump(docs)


def test_values_survive_the_pods_parser(tmp_path):
    config = tmp_path / "data.config"
    config.write_text(
        "export START_DATE_HR=20191221/00\nexport END_DATE_HR=20191221/01\n"
        "export DATASET_PATH='/var/lib/elastic-ctr/data/$weird\"name'\n"
    )
    configmap = by_name(docs_of(tmp_path, data_config=str(config)), "ConfigMap", "elastic-ctr-config")
    parsed = parse_data_config(configmap["data"]["data.config"], env={})
    assert parsed.dataset_path == '/var/lib/elastic-ctr/data/$weird"name'


def test_a_config_change_rolls_exactly_the_pods_that_read_it(tmp_path):
    before = docs_of(tmp_path / "a")
    slot_conf = tmp_path / "slot.conf"
    slot_conf.write_text("3\n4\n")
    after = docs_of(tmp_path / "b", slot_conf=str(slot_conf))

    def checksums(docs):
        return {
            d["metadata"]["name"]: t["metadata"].get("annotations", {}).get(k.CONFIG_CHECKSUM_ANNOTATION)
            for d in docs for t in pod_templates(d)
        }  # fmt: skip

    old, new = checksums(before), checksums(after)
    assert old["elastic-ctr-mlflow"] is None and new["elastic-ctr-mlflow"] is None  # reads neither
    changed = {name for name in old if old[name] != new[name]}
    assert changed == set(old) - {"elastic-ctr-mlflow"}

    def hashes(docs):
        return {(d["kind"], d["metadata"]["name"]): d["metadata"]["annotations"][k.SPEC_HASH_ANNOTATION] for d in docs}

    assert hashes(before)[("Deployment", "elastic-ctr-mlflow")] == hashes(after)[("Deployment", "elastic-ctr-mlflow")]
    assert hashes(before)[("Job", "elastic-ctr")] != hashes(after)[("Job", "elastic-ctr")]
    # The checksum is keyed with the token: it says "changed" without letting anyone test a guess.
    other = docs_of(tmp_path / "c", token="another-token")
    assert checksums(other)["elastic-ctr-serving"] != old["elastic-ctr-serving"]


# ---- the training job's policies ----------------------------------------------------------------------------------


def test_configuration_errors_abort_the_job_and_the_retry_budget_is_an_option(tmp_path):
    job = by_name(docs_of(tmp_path, kube={"max_retry": 7}), "Job", "elastic-ctr")
    assert job["spec"]["maxRetry"] == 7
    first = job["spec"]["policies"][0]
    assert first == {"exitCode": 2, "action": "AbortJob"}  # before PodFailed: Volcano takes the first match
    bad = copy.deepcopy(job)
    bad["spec"]["policies"].insert(0, {"exitCode": 0, "action": "AbortJob"})
    assert any("exitCode 0 is not an error code" in p for p in volcano_job_problems(bad))


def test_online_jobs_get_a_larger_retry_budget(tmp_path):
    config = tmp_path / "data.config"
    config.write_text(
        "export START_DATE_HR=20191221/00\nexport END_DATE_HR=20191221/01\n"
        "export DATASET_PATH=s3://b/d\nexport ONLINE=1\n"
    )
    assert by_name(docs_of(tmp_path, data_config=str(config)), "Job", "elastic-ctr")["spec"]["maxRetry"] == 100


# ---- images, storage, the pod overlay --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "image, policy",
    [
        ("reg.io/ctr:1.2.0", "IfNotPresent"),
        ("reg.io/ctr:latest", "Always"),
        ("reg.io:5000/ctr", "Always"),
        ("reg.io/ctr@sha256:" + "a" * 64, "IfNotPresent"),
    ],
)
def test_pull_policy_fits_the_tag(image, policy):
    assert pull_policy_for(image) == policy


def test_image_pull_policy_and_secrets_reach_every_container(tmp_path):
    templates = all_pod_templates(
        tmp_path, image="reg.io/ctr:latest", kube={"image_pull_secrets": ("regcred",), "image_pull_policy": "Always"}
    )
    for owner, template in templates:
        assert template["spec"]["imagePullSecrets"] == [{"name": "regcred"}], owner
        assert all(c["image"] == "reg.io/ctr:latest" and c["imagePullPolicy"] == "Always" for c in containers(template))


def test_data_secrets_reach_exactly_the_pods_that_read_data(tmp_path):
    """--data-secret: the Secret's keys (AWS_* for s3://) become the environment of pservers, trainers,
    cube-transfer and the evaluation jobs, and of no other pod; a bad name is refused before -r writes."""
    templates = all_pod_templates(tmp_path, kube={"data_secrets": ("s3-data", "more-env")})
    readers = {"elastic-ctr", "elastic-ctr-cube-transfer"}  # the training job's two tasks, the transfer
    seen = set()
    for owner, template in templates:
        for c in containers(template):
            env_from = c.get("envFrom")
            if owner in readers or owner.startswith(("elastic-ctr-eval", "elastic-ctr-merge")):  # one template
                assert env_from == [{"secretRef": {"name": "s3-data"}}, {"secretRef": {"name": "more-env"}}], owner
                seen.add(owner)
            else:
                assert env_from is None, (owner, c["name"])
    assert readers <= seen and any(o.startswith("elastic-ctr-eval") for o in seen), seen
    assert all(c.get("envFrom") is None for _, t in all_pod_templates(tmp_path / "none") for c in containers(t))
    with pytest.raises(UsageError, match=r"--data-secret 'S3_Creds' is not a Secret name"):
        render_plan(tmp_path / "bad", kube={"data_secrets": ("S3_Creds",)})
    assert not (tmp_path / "bad" / "plan.json").exists()


def test_storage_class_and_a_read_write_once_shared_claim(tmp_path):
    docs = docs_of(tmp_path, kube={"storage_class": "fast-ssd", "access_mode": "ReadWriteOnce"})
    claims = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    assert {c["storageClassName"] for c in claims.values()} == {"fast-ssd"}
    assert claims["elastic-ctr-shared"]["accessModes"] == ["ReadWriteOnce"]
    # Every pod that mounts the shared claim must land on one node with it.
    for doc in docs:
        for template in pod_templates(doc):
            mounts_shared = any(
                (v.get("persistentVolumeClaim") or {}).get("claimName") == "elastic-ctr-shared"
                for v in template["spec"].get("volumes", [])
            )
            affinity = template["spec"].get("affinity", {}).get("podAffinity")
            assert bool(affinity) == mounts_shared, doc["metadata"]["name"]
            if mounts_shared:
                term = affinity["requiredDuringSchedulingIgnoredDuringExecution"][0]
                assert term["labelSelector"]["matchLabels"].items() <= template["metadata"]["labels"].items()


def test_pod_overlay_is_merged_into_every_pod(tmp_path):
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text(
        yaml.safe_dump(
            {
                "nodeSelector": {"pool": "ctr"},
                "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ctr", "effect": "NoSchedule"}],
                "labels": {"team": "ads"},
                "annotations": {"cost-center": "42"},
                "priorityClassName": "batch-high",
                "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
            }
        )
    )  # fmt: skip
    templates = all_pod_templates(
        tmp_path, kube={"pod_overlay": str(overlay), "access_mode": "ReadWriteOnce"}, cube_shards=2
    )
    for owner, template in templates:
        spec = template["spec"]
        assert spec["nodeSelector"] == {"pool": "ctr"} and spec["tolerations"][0]["key"] == "dedicated", owner
        assert template["metadata"]["labels"]["team"] == "ads" and spec["priorityClassName"] == "batch-high"
        assert template["metadata"]["labels"][k.LABEL_INSTANCE] == "elastic-ctr"  # ours stay
        assert "nodeAffinity" in spec["affinity"]
    training = [t for owner, t in templates if owner == "elastic-ctr"]
    assert all("podAffinity" in t["spec"]["affinity"] for t in training)  # merged, not replaced


@pytest.mark.parametrize(
    "content, message",
    [
        ("nodeSelectr: {a: b}\n", r"unknown key 'nodeSelectr'; did you mean 'nodeSelector'\?"),
        ("labels: {app.kubernetes.io/instance: x}\n", r"set by elastic-control itself"),
        ("tolerations: {key: x}\n", r"tolerations must be a list"),
        ("- a\n", r"must be a mapping"),
    ],
)
def test_bad_pod_overlays_name_the_problem(tmp_path, content, message):
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text(content)
    with pytest.raises(ConfigError, match=message):
        render_plan(tmp_path / "state", kube={"pod_overlay": str(overlay)})


# ---- paths the pods can reach -----------------------------------------------------------------------------------


def _config(tmp_path, **values) -> str:
    lines = {"START_DATE_HR": "20191221/00", "END_DATE_HR": "20191221/01", **values}
    path = tmp_path / "data.config"
    path.write_text("".join(f'export {key}="{value}"\n' for key, value in lines.items()))
    return str(path)


def test_a_remote_model_path_is_refused_with_the_fix(tmp_path):
    with pytest.raises(UsageError, match=r"MODEL_PATH 'hdfs://nn/m' .* is remote: .* shared claim"):
        render_plan(
            tmp_path / "state", data_config=_config(tmp_path, DATASET_PATH="s3://b/d", MODEL_PATH="hdfs://nn/m")
        )
    assert not (tmp_path / "state" / "plan.json").exists()


@pytest.mark.parametrize(
    "dataset, hdfs, kube, warning",
    [
        ("/tmp/elastic-ctr/data", "", {}, "is a path on this machine, which pods cannot read"),
        ("file:///data/ctr", "", {}, "is a path on this machine"),
        ("/var/lib/elastic-ctr/data", "", {}, None),
        ("s3://bucket/ctr", "", {}, "pass --data-secret s3-data to -r"),
        ("s3://bucket/ctr", "", {"data_secrets": ("s3-data",)}, None),
        ("/ctr", "hdfs://nn:9000", {}, "needs a Java runtime and libhdfs"),
    ],
)
def test_data_paths_pods_cannot_reach_are_named_at_r(tmp_path, dataset, hdfs, kube, warning):
    plan, _ = render_plan(
        tmp_path / "state", data_config=_config(tmp_path, DATASET_PATH=dataset), hdfs_address=hdfs, kube=kube
    )
    warnings = KubeOptions.from_json(plan.kube).warnings
    found = [w for w in warnings if "DATASET_PATH" in w]
    if warning is None:
        assert found == []
    else:
        assert len(found) == 1 and warning in found[0]


# ---- network policies ------------------------------------------------------------------------------------------


def _admits(policies: list[dict], template: dict, source_labels: dict | None) -> set[str]:
    """The named ports of a pod template that a source (labels; None: no pod of the namespace) may reach,
    by the harness's one reading of NetworkPolicy (pod_harness.node_agent.admitted_ports)."""
    ports = {p["name"]: p["containerPort"] for c in containers(template) for p in c.get("ports", [])}
    view = {"labels": template["metadata"]["labels"], "ports": ports}
    numbers = admitted_ports([p["spec"] for p in policies], view, source_labels)
    return set(ports) if numbers is None else {name for name, n in ports.items() if n in numbers}


@pytest.mark.parametrize("service_type", ["ClusterIP", "LoadBalancer"])
def test_network_policies_admit_the_instance_and_serving_clients_only(tmp_path, service_type):
    docs = docs_of(tmp_path, service_type=service_type)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert policies and all(d["spec"]["policyTypes"] == ["Ingress"] for d in policies)
    instance = {k.LABEL_INSTANCE: "elastic-ctr"}
    outsider = {"app": "someone-else"}
    templates = [(d, t) for d in docs for t in pod_templates(d)]
    templates += [(d, t) for d in eval_docs(render_plan(tmp_path / "again", service_type=service_type)[0])
                  for t in pod_templates(d)]  # fmt: skip
    assert len(templates) > 6
    for doc, template in templates:
        labels = template["metadata"]["labels"]
        ports = {p["name"] for c in containers(template) for p in c.get("ports", [])}
        # Every pod is selected (none is left open) and the instance's own pods reach all its ports.
        assert any(p["spec"]["podSelector"]["matchLabels"].items() <= labels.items() for p in policies), labels
        assert instance.items() <= labels.items(), doc["metadata"]["name"]
        assert _admits(policies, template, labels) == ports
        component = labels[k.LABEL_COMPONENT]
        public = {"serving": {"http", "grpc"}}
        if service_type != "ClusterIP":
            public["fileserver"] = {"http"}
        for source in (outsider, None):
            assert _admits(policies, template, source) == public.get(component, set()), component
    for doc in policies:
        validate_builtin(doc)


def test_no_network_policy_renders_none(tmp_path):
    docs = docs_of(tmp_path, kube={"network_policy": False})
    assert not [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert by_name(docs, "Deployment", "elastic-ctr-serving")  # the rest is as before
    # Volcano's svc plugin then fences the training job with its own policy (the job's pods only).
    job = next(d for d in docs if d["kind"] == "Job")
    assert job["spec"]["plugins"]["svc"] == []
