"""The Kubernetes backend (real `kubernetes` client) against a local server answering the API paths it uses."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml
from helpers_common import free_port
from helpers_kube import render_plan
from helpers_kube_api import VOLCANO, FakeKubeAPI, fake_cluster

from ctr_foundation.errors import ApplyError, ClusterUnavailableError, UsageError
from elastic_control.cli.status_view import print_status
from elastic_control.kube import adaptor
from elastic_control.kube.backend import KubeBackend, expected_pods

pytestmark = pytest.mark.e2e


@pytest.fixture()
def cluster(tmp_path, monkeypatch, request):
    """A fake API server (scenario from @pytest.mark.parametrize indirect or default) with KUBECONFIG set."""
    with fake_cluster(tmp_path, monkeypatch, **getattr(request, "param", {})) as api:
        yield api


def _plan(tmp_path, **kwargs):
    plan, _ = render_plan(tmp_path / "state", cpu=4, mem=20, trainers=2, pservers=2, cube_shards=2, **kwargs)
    return plan


def _calls(api, method=None, contains=""):
    return [(m, p, q) for m, p, q in api.requests if (method is None or m == method) and contains in p]


def test_detect_cluster_really_asks_the_api_server(cluster):
    ok, why = adaptor.detect_cluster(timeout=5)
    assert ok and "v1.33.1" in why
    assert _calls(cluster, "GET", "/version")


def test_detect_cluster_without_config_or_with_a_dead_server(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    adaptor.reset()
    assert adaptor.detect_cluster() == (False, "no kubeconfig or in-cluster config found")
    port = free_port()  # nothing listens there
    api = FakeKubeAPI()
    api.url = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("KUBECONFIG", str(api.write_kubeconfig(tmp_path / "kubeconfig")))
    adaptor.reset()
    ok, why = adaptor.detect_cluster(timeout=1)
    assert not ok and "did not answer" in why
    adaptor.reset()


def _writes(api):
    """Calls that change objects (an access review is a POST that stores nothing: -a's preflight asks it)."""
    return [
        (m, p)
        for m, p, _ in api.requests
        if m in ("POST", "PUT", "PATCH", "DELETE") and not p.endswith("/selfsubjectaccessreviews")
    ]


def _pod_uids(api):
    return {p["metadata"]["uid"] for p in api.pods()}


def test_apply_creates_everything_in_order(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_CTR_APPLY_TIMEOUT", "30")
    plan = _plan(tmp_path)
    KubeBackend().apply(plan).wait()
    # pservers, trainers, MLflow, file server, 2 shards, transfer, 2 serving replicas
    assert len(cluster.pods()) == expected_pods(plan) == 2 + 2 + 1 + 1 + 2 + 1 + 2
    assert cluster.get(VOLCANO, "jobs", "default", "elastic-ctr")["spec"]["minAvailable"] == 4
    paths = [p for _, p, _ in cluster.requests]
    assert (
        paths.index("/api/v1/namespaces/default")
        < paths.index("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/jobs.batch.volcano.sh")
        < paths.index("/apis/scheduling.volcano.sh/v1beta1/queues/default")
        < paths.index("/api/v1/namespaces/default/configmaps/elastic-ctr-config")
    )
    # Built-in kinds go through server-side apply, never PUT (which would reset what others set).
    patches = [(m, p, q) for m, p, q in cluster.requests if m == "PATCH"]
    assert patches and all(q.get("fieldManager") == "elastic-control" and q.get("force") == "true" for *_, q in patches)
    assert not _calls(cluster, "PUT")


def test_second_apply_of_an_unchanged_plan_writes_nothing_and_restarts_nothing(cluster, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ELASTIC_CTR_APPLY_TIMEOUT", "30")
    plan = _plan(tmp_path)
    KubeBackend().apply(plan).wait()
    job_uid = cluster.get(VOLCANO, "jobs", "default", "elastic-ctr")["metadata"]["uid"]
    pods, versions = _pod_uids(cluster), {k: o["metadata"]["resourceVersion"] for k, o in cluster.store.items()}
    cluster.requests.clear()
    capsys.readouterr()
    KubeBackend().apply(_plan(tmp_path)).wait()  # -r again with the same flags, then -a
    assert _writes(cluster) == []  # no DELETE, no PATCH, no POST: nothing to do
    assert cluster.get(VOLCANO, "jobs", "default", "elastic-ctr")["metadata"]["uid"] == job_uid
    assert _pod_uids(cluster) == pods and cluster.restarts == 0
    assert all(cluster.store[k]["metadata"]["resourceVersion"] == v for k, v in versions.items() if k in cluster.store)
    err = capsys.readouterr().err
    assert "Job default/elastic-ctr unchanged" in err and "nothing changed" in err


def test_changed_job_spec_recreates_the_job_delete_wait_create(cluster, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ELASTIC_CTR_APPLY_TIMEOUT", "30")
    KubeBackend().apply(_plan(tmp_path)).wait()
    first = cluster.get(VOLCANO, "jobs", "default", "elastic-ctr")["metadata"]["uid"]
    cluster.requests.clear()
    plan, _ = render_plan(tmp_path / "state", cpu=4, mem=20, trainers=3, pservers=2, cube_shards=2)
    KubeBackend().apply(plan).wait()
    job_calls = [m for m, p, _ in cluster.requests if "/jobs" in p and m != "GET"]
    assert job_calls == ["DELETE", "POST"]  # Volcano refuses updates: delete, wait for the pods, create
    job = cluster.get(VOLCANO, "jobs", "default", "elastic-ctr")
    assert job["metadata"]["uid"] != first and job["spec"]["minAvailable"] == 5
    assert "Job default/elastic-ctr recreated (its spec changed)" in capsys.readouterr().err
    assert cluster.restarts == 0  # nothing else changed, so no Deployment rolled


def test_config_change_rolls_exactly_the_pods_that_read_it(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_CTR_APPLY_TIMEOUT", "30")
    KubeBackend().apply(_plan(tmp_path)).wait()
    mlflow = {p["metadata"]["uid"] for p in cluster.pods(**{"app.kubernetes.io/component": "mlflow"})}
    serving = {p["metadata"]["uid"] for p in cluster.pods(**{"app.kubernetes.io/component": "serving"})}
    slot_conf = tmp_path / "slot.conf"
    slot_conf.write_text("1\n2\n3\n")
    cluster.requests.clear()
    KubeBackend().apply(_plan(tmp_path, slot_conf=str(slot_conf))).wait()
    assert cluster.get("v1", "configmaps", "default", "elastic-ctr-config")["data"]["slot.conf"] == "1\n2\n3\n"
    now_serving = {p["metadata"]["uid"] for p in cluster.pods(**{"app.kubernetes.io/component": "serving"})}
    assert now_serving and not now_serving & serving  # serving mounts the ConfigMap: rolled
    assert {p["metadata"]["uid"] for p in cluster.pods(**{"app.kubernetes.io/component": "mlflow"})} == mlflow
    patched = {p.rsplit("/", 1)[-1] for m, p in _writes(cluster) if m == "PATCH"}
    assert "elastic-ctr-mlflow" not in patched and "elastic-ctr-serving" in patched


def test_b5_then_b2_prunes_to_two_shards(cluster, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ELASTIC_CTR_APPLY_TIMEOUT", "30")
    plan, _ = render_plan(tmp_path / "state", cpu=4, mem=20, trainers=2, pservers=2, cube_shards=5)
    KubeBackend().apply(plan).wait()
    assert len(cluster.items("apps/v1", "deployments", "default")) == 3 + 5 + 1
    plan, _ = render_plan(tmp_path / "state", cpu=4, mem=20, trainers=2, pservers=2, cube_shards=2)
    capsys.readouterr()
    KubeBackend().apply(plan).wait()
    shards = sorted(
        d["metadata"]["name"]
        for d in cluster.items("apps/v1", "deployments", "default")
        if "-cube-" in d["metadata"]["name"] and "transfer" not in d["metadata"]["name"]
    )
    assert shards == ["elastic-ctr-cube-0", "elastic-ctr-cube-1"]
    services = {s["metadata"]["name"] for s in cluster.items("v1", "services", "default")}
    assert not {f"elastic-ctr-cube-{i}" for i in range(2, 5)} & services
    assert not {f"elastic-ctr-cube-agent-{i}" for i in range(2, 5)} & services
    assert len(cluster.pods(**{"app.kubernetes.io/component": "cube"})) == 2
    err = capsys.readouterr().err
    assert "Deployment default/elastic-ctr-cube-4 pruned (no longer rendered)" in err
    assert f"{expected_pods(plan)}/{expected_pods(plan)} pods running" in err
    # The plan's claims are never pruned, and the transfer's agent list follows the new shard count.
    assert len(cluster.items("v1", "persistentvolumeclaims", "default")) == 3


def test_scaled_deployment_keeps_its_replicas_until_the_plan_changes_them(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_CTR_APPLY_TIMEOUT", "30")
    KubeBackend().apply(_plan(tmp_path)).wait()
    serving = cluster.get("apps/v1", "deployments", "default", "elastic-ctr-serving")
    serving["spec"]["replicas"] = 5  # `kubectl scale` (or an HPA)
    slot_conf = tmp_path / "slot.conf"
    slot_conf.write_text("4\n5\n")
    KubeBackend().apply(_plan(tmp_path, slot_conf=str(slot_conf))).wait()  # serving's template changes: it is applied
    assert cluster.get("apps/v1", "deployments", "default", "elastic-ctr-serving")["spec"]["replicas"] == 5
    KubeBackend().apply(_plan(tmp_path, slot_conf=str(slot_conf), kube={"serving_replicas": 3})).wait()
    assert cluster.get("apps/v1", "deployments", "default", "elastic-ctr-serving")["spec"]["replicas"] == 3


def test_dry_run_server_sends_dry_run_all_and_changes_nothing(cluster, tmp_path):
    plan = _plan(tmp_path)
    KubeBackend().apply(plan, dry_run="server")
    writes = _calls(cluster, "POST") + _calls(cluster, "PATCH")
    writes = [(m, p, q) for m, p, q in writes if not p.endswith("/selfsubjectaccessreviews")]  # store nothing
    assert writes and all(q.get("dryRun") == "All" for _, _, q in writes)
    assert cluster.items("apps/v1", "deployments") == [] and cluster.items(VOLCANO, "jobs") == []


def test_dry_run_client_never_contacts_the_cluster(cluster, tmp_path, capsys):
    plan = _plan(tmp_path)
    cluster.requests.clear()
    KubeBackend().apply(plan, dry_run="client")
    assert cluster.requests == []
    assert "Job default/elastic-ctr (would be created, or updated if its spec changed)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "cluster, message",
    [
        (
            {"crd_installed": False},
            r"Volcano is not installed: the CRD jobs.batch.volcano.sh does not exist; install "
            r"Volcano from a pinned release",
        ),
        ({"queue_state": "Closed"}, r"Volcano queue 'default' is Closed, so it accepts no jobs: open it with `vcctl"),
        (
            {"namespaces": ("kube-system",)},
            r"namespace 'default' does not exist: create it with `kubectl create namespace",
        ),
    ],
    indirect=["cluster"],
)
def test_preflight_explains_how_to_fix(cluster, tmp_path, message):
    plan = _plan(tmp_path)
    with pytest.raises(ClusterUnavailableError, match=message):
        KubeBackend().apply(plan).wait()
    assert _calls(cluster, "POST") == []  # nothing was created


@pytest.mark.parametrize("cluster", [{"unschedulable": True}], indirect=True)
def test_unschedulable_pods_are_explained_from_events(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_CTR_APPLY_TIMEOUT", "1")
    plan = _plan(tmp_path)
    with pytest.raises(
        ApplyError,
        match=r"7/11 pods running, not running after 1s: pod elastic-ctr-pserver-0 cannot "
        r"be scheduled: 0/3 nodes are available: 3 Insufficient cpu; lower -u "
        r"\(now 4\), or add nodes",
    ):
        KubeBackend().apply(plan).wait()
    assert _calls(cluster, "GET", "/events")


def test_image_pull_failure_is_explained(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_CTR_APPLY_TIMEOUT", "30")
    plan = _plan(tmp_path, image="registry.invalid/elastic-ctr:nope")
    original = cluster._make_pod

    def pull_fails(ns, name, template, labels, **kw):
        pod = original(ns, name, template, labels, **kw)
        if "serving" in name:
            pod["status"] = {
                "phase": "Pending",
                "containerStatuses": [
                    {
                        "name": "serving",
                        "ready": False,
                        "restartCount": 0,
                        "image": template["spec"]["containers"][0]["image"],
                        "imageID": "",
                        "state": {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling"}},
                    }
                ],
            }
            cluster.event(ns, name, "Failed", "Failed to pull image: not found")
        return pod

    cluster._make_pod = pull_fails
    with pytest.raises(
        ApplyError,
        match=r"a pod cannot start: pod elastic-ctr-serving-.* cannot pull image "
        r"'registry.invalid/elastic-ctr:nope' \(ImagePullBackOff: Failed to pull image",
    ):
        KubeBackend().apply(plan).wait()


@pytest.mark.parametrize("cluster", [{"recreate_trainer": True}], indirect=True)
def test_logs_follow_reattaches_to_a_recreated_trainer(cluster, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ELASTIC_CTR_APPLY_TIMEOUT", "30")
    plan = _plan(tmp_path)
    KubeBackend().apply(plan).wait()
    capsys.readouterr()
    KubeBackend().attach(plan).stream_logs(follow=True, components=["trainer-0"])
    # (the fake cluster's file server has no endpoints: the kept logs of earlier trainers are said unavailable)
    out = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("[elastic-ctr-trainer-0 kept]")]
    assert out == [
        "[elastic-ctr-trainer-0] pass-20191221-00 step 10 loss 0.52",
        "[elastic-ctr-trainer-0] pass-20191221-00 step 20 loss 0.49",
        "[trainer-0] (pod recreated: reattached to elastic-ctr-trainer-0)",
        "[elastic-ctr-trainer-0] restarted by RestartJob, resuming from the last pass",
        "[elastic-ctr-trainer-0] pass-20191221-01 step 10 loss 0.47",
        "[elastic-ctr-trainer-0] training finished",
        "[trainer-0] (stream ended: pod elastic-ctr-trainer-0 Succeeded; job Completed)",
    ]
    # Two different pods were streamed (the second under the same name, new uid).
    assert cluster.trainer_generations == 2


def test_logs_show_trainer0_fileserver_and_transfer(cluster, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ELASTIC_CTR_APPLY_TIMEOUT", "30")
    plan = _plan(tmp_path)
    KubeBackend().apply(plan).wait()
    capsys.readouterr()
    KubeBackend().attach(plan).stream_logs()
    out = capsys.readouterr().out
    assert "[elastic-ctr-trainer-0] pass-20191221-00 step 10 loss 0.52" in out
    assert "[elastic-ctr-fileserver-" in out and "[elastic-ctr-cube-transfer-" in out
    trainer_query = next(
        q for m, p, q in cluster.requests if p.endswith("/pods") and "task-spec" in q.get("labelSelector", "")
    )
    # By name: the task-index label exists only since Volcano 1.9.
    assert trainer_query["labelSelector"] == "volcano.sh/job-name=elastic-ctr,volcano.sh/task-spec=trainer"
    assert trainer_query["fieldSelector"] == "metadata.name=elastic-ctr-trainer-0"


class _SlotConfServer(BaseHTTPRequestHandler):
    """Stands in for the file server behind a NodePort: serves config/slot.conf."""

    def do_GET(self):
        body = b"# published\n7\n9\n" if self.path == "/files/config/slot.conf" else b""
        self.send_response(200 if body else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture()
def slot_conf_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SlotConfServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_configure_client_via_nodeport_fetches_slot_conf(tmp_path, monkeypatch, slot_conf_server):
    monkeypatch.setenv("ELASTIC_CTR_APPLY_TIMEOUT", "30")
    with FakeKubeAPI(node_ports={"elastic-ctr-fileserver": slot_conf_server, "elastic-ctr-serving": 31010}) as api:
        monkeypatch.setenv("KUBECONFIG", str(api.write_kubeconfig(tmp_path / "kubeconfig")))
        adaptor.reset()
        plan = _plan(tmp_path, service_type="NodePort")
        KubeBackend().apply(plan).wait()
        path = KubeBackend().configure_client(plan)
    adaptor.reset()
    config = json.loads(path.read_text())
    assert config["serving_url"] == "http://127.0.0.1:31010"
    assert config["serving_grpc"] == "127.0.0.1:31010"  # the fake API gives every port of a Service that nodePort
    assert config["fileserver_url"] == f"http://127.0.0.1:{slot_conf_server}"
    assert config["slots"] == [7, 9]
    assert open(config["slot_conf"]).read() == "# published\n7\n9\n"


def test_configure_client_clusterip_prints_port_forward_and_falls_back(cluster, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ELASTIC_CTR_APPLY_TIMEOUT", "30")
    plan = _plan(tmp_path)
    KubeBackend().apply(plan).wait()
    capsys.readouterr()
    # Port 8080 on this machine may be anything; make sure the fetch cannot reach a stranger's server.
    monkeypatch.setattr(
        "elastic_control.kube.discover.fetch_slot_conf",
        lambda url, **_kw: (_ for _ in ()).throw(__import__("requests").ConnectionError("refused")),
    )
    path = KubeBackend().configure_client(plan)
    err = capsys.readouterr().err
    assert "kubectl port-forward -n default svc/elastic-ctr-serving 8010:8010" in err
    assert "svc/elastic-ctr-serving 8010:8010 8011:8011" in err  # one port-forward for both of serving's ports
    assert "using the copy in the state folder" in err
    config = json.loads(path.read_text())
    assert config["serving_url"] == "http://127.0.0.1:8010"
    assert config["serving_grpc"] == "127.0.0.1:8011"
    assert config["slots"] == list(range(1, 40))


def test_configure_client_before_apply_says_so(cluster, tmp_path):
    plan = _plan(tmp_path)
    with pytest.raises(
        ApplyError, match=r"Service default/elastic-ctr-serving: not found: run `elastic-control -a` first"
    ):
        KubeBackend().configure_client(plan)


def test_status_and_delete(cluster, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ELASTIC_CTR_APPLY_TIMEOUT", "30")
    plan = _plan(tmp_path)
    KubeBackend().apply(plan).wait()
    capsys.readouterr()
    print_status(KubeBackend().attach(plan).status())
    out = capsys.readouterr().out
    assert "Running (running 4)" in out and "elastic-ctr-cube-1" in out and "1/1" in out
    KubeBackend().attach(plan).delete()
    assert cluster.items(VOLCANO, "jobs") == [] and cluster.items("apps/v1", "deployments") == []
    assert cluster.items("v1", "services", "default") == [] and cluster.items("v1", "configmaps", "default") == []
    assert len(cluster.items("v1", "persistentvolumeclaims", "default")) == 3  # data stays
    assert cluster.items("policy/v1", "poddisruptionbudgets", "default") == []
    status = KubeBackend().attach(plan).status()
    assert status.state == "not deployed" and status.components[0].state == "missing"
    print_status(status)
    assert "absent" in capsys.readouterr().out


def test_unreachable_cluster_is_one_clear_error(tmp_path, monkeypatch):
    plan = _plan(tmp_path)
    port = free_port()
    api = FakeKubeAPI()
    api.url = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("KUBECONFIG", str(api.write_kubeconfig(tmp_path / "kubeconfig")))
    adaptor.reset()
    with pytest.raises(
        ClusterUnavailableError,
        match=rf"cannot reach the Kubernetes API server at "
        rf"http://127.0.0.1:{port} while reading namespace default",
    ):
        KubeBackend().apply(plan).wait()
    adaptor.reset()


# ---- why pods are missing: PodGroups, ReplicaSets, claims -------------------------------------------------------


@pytest.mark.parametrize("cluster", [{"podgroup_pending": True}], indirect=True)
def test_a_pending_podgroup_is_explained(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_CTR_APPLY_TIMEOUT", "2")
    with pytest.raises(ApplyError) as err:
        KubeBackend().apply(_plan(tmp_path)).wait()
    message = str(err.value)
    assert message.startswith("7/11 pods running, not running after 2s: PodGroup elastic-ctr-")
    assert "is Pending: 4/4 tasks in gang unschedulable" in message and "3 Insufficient cpu" in message
    assert "all 4 pods fit at once (gang scheduling): lower -t/-p or -u/-m" in message
    assert "not created yet" not in message


@pytest.mark.parametrize("cluster", [{"quota_exceeded": True}], indirect=True)
def test_a_quota_refusal_is_explained_at_once(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_CTR_APPLY_TIMEOUT", "120")
    started = time.monotonic()
    with pytest.raises(ApplyError, match=r"pods are refused: Deployment elastic-ctr-\S+ cannot create its pods: "
                       r"pods \"\S+\" is forbidden: exceeded quota: compute-resources.*a ResourceQuota refuses it: "
                       r"lower -u/-m, or ask for more quota"):  # fmt: skip
        KubeBackend().apply(_plan(tmp_path)).wait()
    assert time.monotonic() - started < 30  # a refusal does not wait out the timeout


@pytest.mark.parametrize("cluster", [{"job_pods_forbidden": True}], indirect=True)
def test_refused_job_pods_are_explained_at_once(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_CTR_APPLY_TIMEOUT", "120")
    started = time.monotonic()
    refused = (
        r"pods are refused: Volcano job elastic-ctr: FailedCreatePod: Error creating pods: .*violates PodSecurity.*; "
        r"the namespace's Pod Security admission refuses it"
    )
    with pytest.raises(ApplyError, match=refused):
        KubeBackend().apply(_plan(tmp_path)).wait()
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("cluster", [{"claims_pending": True, "unschedulable": True}], indirect=True)
def test_unbound_claims_are_explained_with_the_option_that_fixes_them(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_CTR_APPLY_TIMEOUT", "2")
    with pytest.raises(ApplyError):
        KubeBackend().apply(_plan(tmp_path)).wait()
    from elastic_control.kube.diagnose import claim_findings

    findings = [f.message for f in claim_findings("default", "elastic-ctr")]
    shared = next(f for f in findings if f.startswith("claim elastic-ctr-shared"))
    assert "(ReadWriteMany, class default) is Pending: no persistent volumes available for this claim" in shared
    assert "pass --storage-class NAME to -r" in shared and "--access-mode ReadWriteOnce" in shared


# ---- API errors are one line --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cluster, verb",
    [({"deny": {"GET /deployments": 403}}, "status"), ({"deny": {"DELETE /jobs": 403}}, "delete"),
     ({"deny": {"GET /pods": 401}}, "logs")],
    indirect=["cluster"],
)  # fmt: skip
def test_refused_api_calls_are_one_clear_error(cluster, tmp_path, verb):
    plan = _plan(tmp_path)
    with pytest.raises(ClusterUnavailableError) as err:
        handle = KubeBackend().attach(plan)
        {"status": handle.status, "delete": handle.delete, "logs": handle.stream_logs}[verb]()
    message = str(err.value)
    assert "\n" not in message and f"answered HTTP {401 if verb == 'logs' else 403}" in message
    hint = "credentials of the kubeconfig were refused" if verb == "logs" else "lacks the RBAC rights"
    assert hint in message


# ---- -l --follow: reattach, or say why it stopped ------------------------------------------------------------------


@pytest.mark.parametrize(
    "cluster",
    [{"end_stream_early": True, "trainer_log": [f"step {i} loss 0.{90 - i}" for i in range(8)]}],
    indirect=True,
)
def test_a_stream_closed_while_the_pod_runs_is_reopened_without_repeating_lines(cluster, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ELASTIC_CTR_APPLY_TIMEOUT", "30")
    plan = _plan(tmp_path)
    KubeBackend().apply(plan).wait()
    capsys.readouterr()
    KubeBackend().attach(plan).stream_logs(follow=True, components=["trainer-0"])
    out = capsys.readouterr().out.splitlines()
    steps = [line for line in out if " step " in line]
    assert steps == [f"[elastic-ctr-trainer-0] step {i} loss 0.{90 - i}" for i in range(8)]  # each once, in order
    assert "[trainer-0] (stream closed while elastic-ctr-trainer-0 runs: reattached)" in out
    assert out[-1] == "[trainer-0] (stream ended: pod elastic-ctr-trainer-0 Succeeded; job Completed)"


@pytest.mark.parametrize("cluster", [{"task_index_label": False}], indirect=True)
def test_trainer0_logs_on_volcano_before_1_9(cluster, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ELASTIC_CTR_APPLY_TIMEOUT", "30")
    plan = _plan(tmp_path)
    KubeBackend().apply(plan).wait()
    assert not any("volcano.sh/task-index" in p["metadata"]["labels"] for p in cluster.pods())
    capsys.readouterr()
    KubeBackend().attach(plan).stream_logs(components=["trainer-0"])
    assert "[elastic-ctr-trainer-0] pass-20191221-00 step 10 loss 0.52" in capsys.readouterr().out


# ---- the cluster a plan targets -----------------------------------------------------------------------------------


def _two_context_kubeconfig(path, url_a, url_b, namespace_b="team-b"):
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "a",
                "clusters": [{"name": "a", "cluster": {"server": url_a}}, {"name": "b", "cluster": {"server": url_b}}],
                "contexts": [
                    {"name": "a", "context": {"cluster": "a", "user": "u"}},
                    {"name": "b", "context": {"cluster": "b", "user": "u", "namespace": namespace_b}},
                ],
                "users": [{"name": "u", "user": {"token": "t"}}],
            }
        )
    )
    return path


def test_context_namespace_and_target_are_recorded_and_checked(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ELASTIC_CTR_APPLY_TIMEOUT", "30")
    with FakeKubeAPI(namespaces=("default", "team-b")) as b, FakeKubeAPI() as other:
        config = _two_context_kubeconfig(tmp_path / "kubeconfig", "http://127.0.0.1:9", b.url)
        monkeypatch.setenv("KUBECONFIG", str(config))
        adaptor.reset()
        plan = _plan(tmp_path, kube={"context": "b"})
        assert plan.namespace == "team-b"  # the context's namespace, not "default"
        assert plan.kube["context"] == "b" and plan.kube["cluster_server"] == b.url
        KubeBackend().apply(plan).wait()  # on b, though the current context is a
        assert b.items(VOLCANO, "jobs", "team-b") and not other.requests
        # The kubeconfig now points context b at another cluster: nothing is done there.
        _two_context_kubeconfig(config, "http://127.0.0.1:9", other.url)
        adaptor.reset()
        for call in (KubeBackend().attach, KubeBackend().apply):
            with pytest.raises(UsageError, match=rf"rendered for the cluster at {b.url} \(context b\), but the "
                               rf"kubeconfig now points at {other.url}"):  # fmt: skip
                call(plan)
        assert [r for r in other.requests if r[0] != "GET"] == []
    adaptor.reset()


def test_an_unknown_context_is_a_usage_error(tmp_path, monkeypatch):
    config = _two_context_kubeconfig(tmp_path / "kubeconfig", "http://127.0.0.1:9", "http://127.0.0.1:10")
    monkeypatch.setenv("KUBECONFIG", str(config))
    adaptor.reset()
    with pytest.raises(UsageError, match=r"--context 'c' is not in the kubeconfig .* \(contexts: a, b\)"):
        _plan(tmp_path, kube={"context": "c"})
    adaptor.reset()
