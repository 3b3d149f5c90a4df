"""`status` reads what the components answer, not just whether their processes live.

The components here are small stand-in HTTP servers (under the real
supervisor) answering the same endpoints as cube-server, cube-transfer and
serving with answers the test sets, so each situation status must tell apart can
be staged exactly: a rollout in flight with shards on different versions, a
shard holding no version, serving with a model that cannot answer, a
SIGSTOPped component. The real components go through the same probes in
tests/test_local_pipeline.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers_local import kill_everything_under, wait_until

from ctr_foundation.names import StateFolder
from ctr_foundation.records import CURRENT_FILE
from elastic_control.backends import status as st
from elastic_control.local import lifecycle
from elastic_control.local import runtime as rt
from elastic_control.local.ports import free_ports
from elastic_control.local.spec import ComponentSpec, LocalPlan, save_local_plan
from elastic_control.local.status import collect_status

pytestmark = pytest.mark.e2e

# Answers GET PATH with what ANSWERS_FILE says for it ({path: [code, body]}), re-read on every request.
STAND_IN = r"""
import http.server, json, sys
port, answers = int(sys.argv[1]), sys.argv[2]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        table = json.load(open(answers))
        code, body = table.get(self.path, [200, {"status": "ok"}] if self.path == "/healthz" else [404, {}])
        data = json.dumps(body).encode()
        self.send_response(code); self.send_header("Content-Length", str(len(data))); self.end_headers()
        self.wfile.write(data)
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""

NAMES = ("cube-server-0", "cube-server-1", "cube-transfer", "serving")


@pytest.fixture
def pipeline(tmp_path):
    layout = StateFolder.of(tmp_path / "state")
    layout.local_dir.mkdir(parents=True)
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    ports = free_ports(len(NAMES))
    comps = []
    for name, port in zip(NAMES, ports, strict=True):
        (tmp_path / f"{name}.json").write_text("{}")
        comps.append(
            ComponentSpec(
                name=name,
                kind=name.rsplit("-", 1)[0] if name.startswith("cube-server") else name,
                port=port,
                ready="http:/healthz",
                argv=[sys.executable, str(script), str(port), str(tmp_path / f"{name}.json")],
            )
        )
    save_local_plan(LocalPlan(components=comps, stop_grace=3.0), layout.components_file)
    (layout.state / "token").write_text("t\n")
    layout.slot_conf.write_text("1\n")
    (layout.local_dir / "data.config").write_text("export START_DATE_HR=20200101/00\n")
    lifecycle.apply(layout, show_progress=False)

    def answer(name: str, table: dict) -> None:
        path = tmp_path / f"{name}.json"
        path.with_suffix(".tmp").write_text(json.dumps(table))
        os.replace(path.with_suffix(".tmp"), path)

    def activate(version: str) -> None:
        layout.cube_root.mkdir(parents=True, exist_ok=True)
        (layout.cube_root / CURRENT_FILE).write_text(json.dumps({"version": version, "shards": 2, "dim": 9}))

    yield layout, answer, activate
    try:
        lifecycle.delete(layout)
    finally:
        kill_everything_under(layout.state)


def _serving(version: str | None, ready: bool = True, monitor: dict | None = None) -> dict:
    table = {
        "/readyz": [200, {"ready": True}] if ready else [503, {"error": "cube shard 1 does not answer"}],
        "/v1/status": [200, {"model_version": version, "cube_version": version, "ready": ready}],
    }
    if monitor is not None:
        table["/v1/monitor"] = [200, monitor]
    return table


def _shard(active, prepared=None, previous=None) -> dict:
    return {"/v1/status": [200, {"active": active, "prepared": prepared, "previous": previous, "error": None}]}


def _cli(layout: StateFolder, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "elastic_control", "status", "--state-dir", str(layout.state), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=str(layout.state.parent),
    )


def _plan_json(layout: StateFolder) -> None:
    """`elastic-control status` needs plan.json; a local one pointing at this state folder."""
    from elastic_control.config import Resources
    from elastic_control.plan import Plan

    plan = Plan(
        backend="local",
        backend_reason="test",
        resources=Resources(trainers=1, pservers=1, cube_shards=2),
        slot_conf_text="1\n",
        data_config_path=str(layout.local_data_config),
        state_dir=str(layout.state),
    )
    (layout.state / "plan.json").write_text(json.dumps(plan.to_json()))


def test_a_rollout_in_flight_shows_each_shard_version_and_serving_still_answers(pipeline):
    layout, answer, activate = pipeline
    activate("pass-A")
    answer("cube-server-0", _shard("pass-B", previous="pass-A"))  # already switched
    answer("cube-server-1", _shard("pass-A", prepared="pass-B"))  # prepared, not switched yet
    flight = {"version": "pass-B", "previous": "pass-A", "phase": "activating", "started_at": 1.0}
    answer("cube-transfer", {"/v1/status": [200, {"in_flight": flight, "last_error": None}]})
    answer("serving", _serving("pass-A"))
    status = collect_status(layout)
    cube = status.cube
    assert [(s["shard"], s["active"], s["prepared"]) for s in cube["shards"]] == [
        (0, "pass-B", None),
        (1, "pass-A", "pass-B"),
    ]
    assert cube["rollout"] == flight and not cube["consistent"]
    # Serving's version is still held by every shard (as previous on shard 0): it can answer.
    assert status.serving["answers"] and status.serving["version"] == "pass-A"
    assert status.component("serving").state == st.RUNNING
    assert not [a for a in status.alerts if "disagree" in a]
    # The same shards with nothing in flight are a problem worth an alert.
    answer("cube-transfer", {"/v1/status": [200, {"in_flight": None, "last_error": "activate failed: shard 1"}]})
    status = collect_status(layout)
    assert any("shards disagree" in a and "cube-server-0 pass-B" in a for a in status.alerts), status.alerts
    assert any("activate failed: shard 1" in a for a in status.alerts)
    assert status.component("cube-server-0").state == st.DEGRADED  # serves B while A is active


def test_a_shard_holding_no_version_means_serving_cannot_answer(pipeline, capsys):
    layout, answer, activate = pipeline
    activate("pass-A")
    answer("cube-server-0", _shard("pass-A"))
    answer("cube-server-1", _shard(None))  # restarted empty (its damaged files dropped)
    answer("cube-transfer", {"/v1/status": [200, {"in_flight": None}]})
    answer("serving", _serving("pass-A"))
    status = collect_status(layout)
    shard = status.component("cube-server-1")
    assert shard.state == st.DEGRADED and "holds no version while pass-A is active" in shard.detail
    assert not status.serving["answers"] and status.component("serving").state == st.DEGRADED
    assert "cube-server-1 does not hold pass-A" in status.serving["reason"]
    from elastic_control.cli.status_view import print_status

    print_status(status)
    out = capsys.readouterr().out
    assert "serving answers with" not in out and "cannot answer" in out
    # Serving whose own readiness fails (it probes its cube) is not answering either, whatever the shards say.
    answer("cube-server-1", _shard("pass-A"))
    answer("serving", _serving("pass-A", ready=False))
    status = collect_status(layout)
    assert not status.serving["answers"] and "not ready" in status.serving["reason"]
    # All well: it answers.
    answer("serving", _serving("pass-A"))
    status = collect_status(layout)
    assert status.serving["answers"] and status.component("serving").detail == "answering with pass-A"
    assert [c.state for c in status.components] == [st.RUNNING] * 4
    # Before the first rollout nothing is loaded anywhere: starting, not broken.
    (layout.cube_root / CURRENT_FILE).unlink()
    answer("cube-server-0", _shard(None))
    answer("cube-server-1", _shard(None))
    answer("serving", {"/readyz": [503, {"error": "no model version is active yet"}], "/v1/status": [200, {}]})
    status = collect_status(layout)
    assert {c.state for c in status.components if c.name != "cube-transfer"} == {st.STARTING}
    assert not status.alerts


def test_a_sigstopped_component_is_hung_not_running_and_recovers(pipeline):
    layout, answer, activate = pipeline
    activate("pass-A")
    for shard in (0, 1):
        answer(f"cube-server-{shard}", _shard("pass-A"))
    answer("serving", _serving("pass-A"))
    pid = rt.read_runtime(layout)["components"]["cube-server-1"]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        status = collect_status(layout, timeout=1.0)
        shard = status.component("cube-server-1")
        assert shard.state == st.HUNG and f"kill -CONT {pid}" in shard.detail
        assert not status.serving["answers"] and "cube-server-1 is hung" in status.serving["reason"]
        assert any(a.startswith("cube-server-1 is hung") for a in status.alerts)
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_until(lambda: collect_status(layout).component("cube-server-1").state == st.RUNNING, what="running again")


def test_status_data_goes_to_stdout_and_json_is_one_document(pipeline):
    layout, answer, activate = pipeline
    _plan_json(layout)
    activate("pass-A")
    for shard in (0, 1):
        answer(f"cube-server-{shard}", _shard("pass-A"))
    monitor = {
        "arms": [{"arm": "control", "version": "pass-A", "count": 1200, "ctr": 0.031, "calibration": 1.02}],
        "alerts": ["calibration of arm challenger 1.31 is outside 0.8..1.2"],
    }
    answer("serving", _serving("pass-A", monitor=monitor))
    res = _cli(layout)
    assert res.returncode == 0, res.stderr
    assert "serving answers with pass-A" in res.stdout and "cube-server-1" in res.stdout
    assert "control" in res.stdout and "1200" in res.stdout  # the arms table
    assert "outside 0.8..1.2" in res.stdout
    assert "cube-server" not in res.stderr and "pass-A" not in res.stderr  # nothing of the data on stderr
    res = _cli(layout, "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["backend"] == "local" and doc["format"] == st.STATUS_FORMAT
    by_name = {c["name"]: c for c in doc["components"]}
    assert by_name["cube-server-0"]["version"] == "pass-A" and by_name["serving"]["address"].startswith("127.0.0.1:")
    assert doc["serving"]["arms"] == monitor["arms"] and doc["serving"]["live"] == monitor
    assert any("outside 0.8..1.2" in a for a in doc["alerts"])
    assert [s["active"] for s in doc["cube"]["shards"]] == ["pass-A", "pass-A"]


def test_status_of_a_pipeline_never_started_is_data_too(tmp_path):
    layout = StateFolder.of(tmp_path / "state")
    layout.local_dir.mkdir(parents=True)
    save_local_plan(
        LocalPlan(components=[ComponentSpec(name="x", kind="fileserver", argv=["true"], ready="none")]),
        layout.components_file,
    )
    status = collect_status(layout)
    assert status.state == "never started" and status.components[0].state == st.MISSING
    assert Path(status.state_dir) == layout.state


def test_exit_code_follows_the_pipeline_health(pipeline):
    """healthy 0, degraded 3, starting 6, then not running 5 once deleted; -o json and -o yaml carry the same."""
    from elastic_control.cli import exit_codes as ec

    layout, answer, activate = pipeline
    _plan_json(layout)
    activate("pass-A")
    for shard in (0, 1):
        answer(f"cube-server-{shard}", _shard("pass-A"))
    answer("cube-transfer", {"/v1/status": [200, {"in_flight": None}]})
    answer("serving", _serving("pass-A"))

    def check(code: int, health: str) -> dict:
        res = _cli(layout, "-o", "json")
        assert res.returncode == code, (res.stdout, res.stderr)
        doc = json.loads(res.stdout)
        assert doc["health"] == health, doc["health_reason"]
        res = _cli(layout, "-o", "yaml")
        assert res.returncode == code and yaml.safe_load(res.stdout)["health"] == health
        return doc

    check(ec.EXIT_HEALTHY, st.HEALTH_HEALTHY)
    answer("cube-server-1", _shard(None))  # restarted empty: serving cannot answer
    doc = check(ec.EXIT_DEGRADED, st.HEALTH_DEGRADED)
    assert "cube-server-1 degraded" in doc["health_reason"] and "serving degraded" in doc["health_reason"]
    res = _cli(layout)  # text says so too, on the second line
    assert res.returncode == ec.EXIT_DEGRADED and res.stdout.splitlines()[1].startswith("health: degraded (")
    # Before the first rollout nothing is loaded: starting, not broken.
    (layout.cube_root / CURRENT_FILE).unlink()
    answer("cube-server-0", _shard(None))
    answer("serving", {"/readyz": [503, {"error": "no model version is active yet"}], "/v1/status": [200, {}]})
    check(ec.EXIT_STARTING, st.HEALTH_STARTING)
    lifecycle.delete(layout)
    check(ec.EXIT_NOT_RUNNING, st.HEALTH_NOT_RUNNING)


def test_a_failed_training_job_exits_failed(tmp_path):
    from helpers_local import simple_plan

    from elastic_control.cli.exit_codes import EXIT_FAILED

    layout = StateFolder.of(tmp_path / "state")
    layout.local_dir.mkdir(parents=True)
    simple_plan(layout, services=1, trainers=1, max_job_restarts=0, member_env={"ALWAYS_FAIL": "1"})
    _plan_json(layout)
    try:
        lifecycle.apply(layout, show_progress=False)
        wait_until(lambda: (rt.read_runtime(layout)["job"] or {}).get("state") == rt.J_FAILED, what="job failure")
        res = _cli(layout, "--json")
        assert res.returncode == EXIT_FAILED, res.stderr
        doc = json.loads(res.stdout)
        assert doc["health"] == st.HEALTH_FAILED and "trainer-0 failed" in doc["health_reason"]
    finally:
        lifecycle.delete(layout)
        kill_everything_under(layout.state)


def test_text_keeps_one_line_per_component_and_wide_shows_the_whole_log_line(capsys, monkeypatch):
    from elastic_control.cli.status_view import print_status

    long_line = "2024-05-01 12:00:00 serving GET /v1/predict 200 " + "x" * 300
    names = ["mlflow", "fileserver", *(f"{k}-{i}" for i in range(3) for k in ("cube-server", "cube-agent"))]
    names += ["cube-transfer", "serving", *(f"{role}-{i}" for role in ("pserver", "trainer") for i in range(4))]
    status = st.PipelineStatus(backend="local", state_dir="/somewhere/.elastic-ctr", target="local", state="running")
    status.components = [
        st.ComponentStatus(name=n, kind=n.rsplit("-", 1)[0], state=st.RUNNING, detail="answering with pass-A",
                           address="127.0.0.1:40000", pid=4242, version="pass-A", last_line=long_line)
        for n in names
    ]  # fmt: skip
    assert len(names) == 18
    for columns in (100, 160):
        monkeypatch.setenv("COLUMNS", str(columns))
        print_status(status)
        lines = capsys.readouterr().out.splitlines()
        assert len(lines) == 2 + 2 + 18 and max(len(ln) for ln in lines) <= columns, lines
        assert all(ln.rstrip().endswith("…") for ln in lines[4:]) and "x" * 300 not in "".join(lines)
    print_status(status, wide=True)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 + 2 + 18 and all(long_line in ln for ln in lines[4:])
