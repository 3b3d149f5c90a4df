"""MLflow as the manifest starts it: it answers API calls addressed to its Service names, and the
trainer's tracker retries, then trains on without tracking, when a server refuses it.

MLflow 3.x refuses API calls whose Host header it does not know (DNS-rebinding
protection: ``403 Invalid Host header``), which is what a cluster's Service
names are unless the server is told about them. Both servers here really run
`mlflow server` with the rendered container command (only the address, port and
folders changed); one without the rendered `--allowed-hosts`, as the manifest
was before, shows what the flag fixes.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers_common import free_port
from helpers_kube import render_plan

from elastic_control.kube.render import load_manifests

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
API = "/api/2.0/mlflow/experiments/search"


def rendered_mlflow_command(tmp_path: Path) -> list[str]:
    _, manifests = render_plan(tmp_path / "state")
    docs = load_manifests(manifests)
    deployment = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "elastic-ctr-mlflow")
    return deployment["spec"]["template"]["spec"]["containers"][0]["command"]


def start(command: list[str], data: Path, *, host: str, port: int) -> subprocess.Popen:
    """The container command with only the bind address, port and data folder of this machine."""
    argv, i = [], 0
    replace = {"--host": host, "--port": str(port)}
    while i < len(command):
        arg = command[i]
        if arg in replace:
            argv += [arg, replace[arg]]
            i += 2
            continue
        argv.append(arg.replace("/var/lib/mlflow", str(data)))
        i += 1
    argv[0] = str(Path(sys.executable).parent / "mlflow")
    data.mkdir(parents=True)
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(data / "server.log", "wb"), env=env)


def call(port: int, host_header: str, *, connect: str = "127.0.0.1") -> tuple[int, str]:
    conn = http.client.HTTPConnection(connect, port, timeout=30)
    conn.request(
        "POST",
        API,
        body=json.dumps({"max_results": 1}),
        headers={"Host": host_header, "Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    return resp.status, resp.read().decode(errors="replace")


def wait_healthy(proc: subprocess.Popen, port: int, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-2000:]
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"mlflow did not answer /health within {timeout}s: {log.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The rendered command, and the same command without --allowed-hosts (started at once: they are slow)."""
    tmp = tmp_path_factory.mktemp("mlflow")
    command = rendered_mlflow_command(tmp)
    at = command.index("--allowed-hosts")
    before = command[:at] + command[at + 2 :]
    ports = free_port(), free_port()
    procs = [
        start(command, tmp / "rendered", host="127.0.0.1", port=ports[0]),
        start(before, tmp / "without-allowed-hosts", host="0.0.0.0", port=ports[1]),
    ]
    try:
        for proc, port, name in zip(procs, ports, ("rendered", "without-allowed-hosts"), strict=True):
            wait_healthy(proc, port, tmp / name / "server.log")
        yield {"rendered": ports[0], "without": ports[1], "command": command}
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.mark.parametrize(
    "host",
    [
        "elastic-ctr-mlflow:8111",
        "elastic-ctr-mlflow",
        "elastic-ctr-mlflow.default:8111",
        "elastic-ctr-mlflow.default.svc:8111",
        "elastic-ctr-mlflow.default.svc.cluster.local:8111",
        "localhost:8111",  # kubectl port-forward
        "10.244.3.7:8111",  # a pod IP
    ],
)
def test_rendered_server_answers_under_its_service_names(servers, host):
    status, body = call(servers["rendered"], host)
    assert status == 200, body
    assert "experiments" in json.loads(body)


def test_without_the_allowed_hosts_the_same_call_is_refused(servers):
    status, body = call(servers["without"], "elastic-ctr-mlflow:8111")
    assert status == 403 and "Invalid Host header" in body
    status, _ = call(servers["rendered"], "evil.example.com:8111")
    assert status == 403  # the protection stays on for other names


def test_tracker_retries_then_trains_on_without_tracking(servers, tmp_path, monkeypatch):
    from elastic_control.training.tracking import Tracker

    # 127.0.0.2 is this machine too, but not a name MLflow allows by default: every API call is a 403.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.2:{servers['without']}")
    warnings: list[str] = []
    started = time.monotonic()
    tracker = Tracker(tmp_path, run_name="train-test", warn=warnings.append, retry_for=3, retry_pause=1)
    assert 1.9 < time.monotonic() - started < 60  # attempts at 0, 1, 2 s; the next would pass 3 s
    assert not tracker.active
    assert "retrying for up to 3s" in warnings[0] and "Invalid Host header" in warnings[0]
    assert "training goes on without tracking" in warnings[-1]
    tracker.log_params({"a": 1})
    tracker.log_metrics({"loss": 0.5}, step=1)
    assert tracker.register_pass(tmp_path, pass_name="pass-x", window={"start": "a", "end": "b"}, metrics={}) is None
    tracker.finish()  # nothing raises: training is never stopped by tracking


def test_tracker_logs_once_the_server_accepts_it(servers, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from elastic_control.training.tracking import Tracker

    uri = f"http://127.0.0.1:{servers['rendered']}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    warnings: list[str] = []
    tracker = Tracker(tmp_path, run_name="train-ok", warn=warnings.append, retry_for=3)
    assert tracker.active and warnings == []
    tracker.log_metrics({"loss": 0.25}, step=3)
    tracker.finish()
    run = MlflowClient(uri).get_run(tracker.run_id)
    assert run.data.metrics["loss"] == 0.25 and run.info.status == "FINISHED"
