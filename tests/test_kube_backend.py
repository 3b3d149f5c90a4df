"""The Kubernetes backend (real `kubernetes` client) against a local server answering the API paths it uses."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from helpers_kube import render_plan
from helpers_kube_api import VOLCANO, FakeKubeAPI

from ctr_foundation.errors import ApplyError, ClusterUnavailableError
from elastic_control.backends.kube_backend import KubeBackend, expected_pods
from elastic_control.cli.status_view import print_status
from elastic_control.kube import adaptor

pytestmark = pytest.mark.e2e


@pytest.fixture()
def cluster(tmp_path, monkeypatch, request):
    """A fake API server (scenario from @pytest.mark.parametrize indirect or default) with KUBECONFIG set."""
    options = getattr(request, "param", {})
    with FakeKubeAPI(**options) as api:
        monkeypatch.setenv("KUBECONFIG", str(api.write_kubeconfig(tmp_path / "kubeconfig")))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        adaptor.reset()
        yield api
        adaptor.reset()


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
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    api = FakeKubeAPI()
    api.url = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("KUBECONFIG", str(api.write_kubeconfig(tmp_path / "kubeconfig")))
    adaptor.reset()
    ok, why = adaptor.detect_cluster(timeout=1)
    assert not ok and "did not answer" in why
    adaptor.reset()


def test_apply_creates_everything_then_replaces_the_job_by_delete_wait_create(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_CTR_APPLY_TIMEOUT", "30")
    plan = _plan(tmp_path)
    backend = KubeBackend()
    backend.apply(plan).wait()
    assert len(cluster.pods()) == expected_pods(plan) == 2 + 2 + 1 + 1 + 2 + 1 + 1
    assert cluster.get(VOLCANO, "jobs", "default", "elastic-ctr")["spec"]["minAvailable"] == 4
    first_job_uid = cluster.get(VOLCANO, "jobs", "default", "elastic-ctr")["metadata"]["uid"]
    # Preflight came first: namespace, CRD, queue.
    paths = [p for _, p, _ in cluster.requests]
    assert (
        paths.index("/api/v1/namespaces/default")
        < paths.index("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/jobs.batch.volcano.sh")
        < paths.index("/apis/scheduling.volcano.sh/v1beta1/queues/default")
        < paths.index("/api/v1/namespaces/default/configmaps")
    )

    cluster.requests.clear()
    backend.apply(plan).wait()
    job_calls = [
        (m, q)
        for m, p, q in cluster.requests
        if "/jobs" in p or ("/pods" in p and "volcano.sh/job-name" in q.get("labelSelector", ""))
    ]
    methods = [m for m, _ in job_calls]
    # DELETE, then GETs until the job and its pods are gone, then POST.
    assert methods.index("DELETE") < methods.index("POST")
    assert cluster.get(VOLCANO, "jobs", "default", "elastic-ctr")["metadata"]["uid"] != first_job_uid
    puts = _calls(cluster, "PUT")
    assert {p.split("/")[-2] for _, p, _ in puts} == {"configmaps", "secrets", "deployments", "services"}
    assert not [c for c in _calls(cluster, "PUT") if "persistentvolumeclaims" in c[1]]  # claims are kept


def test_dry_run_server_sends_dry_run_all_and_changes_nothing(cluster, tmp_path):
    plan = _plan(tmp_path)
    KubeBackend().apply(plan, dry_run="server")
    posts = _calls(cluster, "POST")
    assert posts and all(q.get("dryRun") == "All" for _, _, q in posts)
    assert cluster.items("apps/v1", "deployments") == [] and cluster.items(VOLCANO, "jobs") == []


def test_dry_run_client_never_contacts_the_cluster(cluster, tmp_path, capsys):
    plan = _plan(tmp_path)
    cluster.requests.clear()
    KubeBackend().apply(plan, dry_run="client")
    assert cluster.requests == []
    assert "Job default/elastic-ctr (would be created or replaced)" in capsys.readouterr().out


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
        match=r"6/10 pods running, not running after 1s: pod elastic-ctr-pserver-0 cannot "
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
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "[elastic-ctr-trainer-0] pass-20191221-00 step 10 loss 0.52",
        "[elastic-ctr-trainer-0] pass-20191221-00 step 20 loss 0.49",
        "[trainer-0] (pod recreated: reattached to elastic-ctr-trainer-0)",
        "[elastic-ctr-trainer-0] restarted by RestartJob, resuming from the last pass",
        "[elastic-ctr-trainer-0] pass-20191221-01 step 10 loss 0.47",
        "[elastic-ctr-trainer-0] training finished",
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
    assert trainer_query["labelSelector"] == (
        "volcano.sh/job-name=elastic-ctr,volcano.sh/task-spec=trainer,volcano.sh/task-index=0"
    )


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
    assert "using the copy in the state folder" in err
    config = json.loads(path.read_text())
    assert config["serving_url"] == "http://127.0.0.1:8010"
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
    status = KubeBackend().attach(plan).status()
    assert status.state == "not deployed" and status.components[0].state == "missing"
    print_status(status)
    assert "absent" in capsys.readouterr().out


def test_unreachable_cluster_is_one_clear_error(tmp_path, monkeypatch):
    plan = _plan(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
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
