"""The local supervisor with small real child processes: start, policies, status, logs, delete, no orphans."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time

import pytest
import requests
from helpers_common import wait_until
from helpers_local import alive, component, processes_under, simple_plan, supervised_layout

from ctr_foundation.errors import ComponentError, UsageError
from elastic_control.local import lifecycle
from elastic_control.local import runtime as rt
from elastic_control.local.logs_view import show_logs
from elastic_control.local.ports import free_ports, port_is_free
from elastic_control.local.spec import save_local_plan

pytestmark = pytest.mark.e2e


@pytest.fixture
def layout(tmp_path):
    with supervised_layout(tmp_path) as lay:
        yield lay


def record_of(layout):
    return rt.read_runtime(layout)


def test_start_complete_status_delete_leaves_no_process(layout):
    simple_plan(layout, steps=10)
    record = lifecycle.apply(layout, show_progress=False)
    assert record["state"] == rt.RUNNING
    sup_pid = record["supervisor"]["pid"]
    svc_pids = [component(record, f"svc-{i}")["pid"] for i in range(2)]
    assert all(alive(p) for p in svc_pids)
    # The supervisor is detached: another session (no controlling terminal), not a child of this process.
    assert os.getsid(sup_pid) != os.getsid(0)
    import psutil

    assert psutil.Process(sup_pid).ppid() != os.getpid()

    # The job completes; its pserver is then stopped by the supervisor (CompleteJob).
    done = wait_until(
        lambda: (
            (r := record_of(layout))["job"]["state"] == rt.J_COMPLETED
            and component(r, "pserver-0")["state"] == rt.C_COMPLETED
            and component(r, "pserver-0")["pid"] is not None
            and r
        ),
        what="job completion",
    )
    assert done["job"]["attempt"] == 1 and done["job"]["restarts"] == 0
    assert component(done, "trainer-0")["last_exit"] == 0
    wait_until(lambda: not alive(component(record_of(layout), "pserver-0")["pid"]), what="pserver stopped")

    # Every exit is logged with its code, in the component's log.
    log = layout.log_path("trainer-1").read_text()
    assert "trainer finished" in log and "exited with code 0" in log
    assert "stopping pserver-0" in layout.log_path("pserver-0").read_text()

    stopped = lifecycle.delete(layout)
    assert any("supervisor" in s for s in stopped)
    assert not alive(sup_pid) and not any(alive(p) for p in svc_pids)
    assert processes_under(layout.state) == []
    assert record_of(layout)["state"] == rt.STOPPED
    # Data and logs stay.
    assert layout.log_path("svc-0").exists() and (layout.state / "progress.0").exists()


def test_killed_trainer_restarts_the_whole_job_which_then_finishes(layout):
    simple_plan(layout, steps=40)
    record = lifecycle.apply(layout, show_progress=False)
    wait_until(
        lambda: (layout.state / "progress.1").exists() and len((layout.state / "progress.1").read_text().split()) >= 5,
        what="trainer 1 progress",
    )
    r = record_of(layout)
    victim = component(r, "trainer-1")["pid"]
    other_trainer, pserver = component(r, "trainer-0")["pid"], component(r, "pserver-0")["pid"]
    os.kill(victim, signal.SIGKILL)
    # RestartJob: every member is stopped and started again.
    r2 = wait_until(lambda: (x := record_of(layout))["job"]["attempt"] == 2 and x, what="job restart")
    assert r2["job"]["restarts"] == 1
    assert "trainer-1" in r2["job"]["reason"] and "SIGKILL" in r2["job"]["reason"]
    assert not alive(other_trainer) and not alive(pserver)
    final = wait_until(
        lambda: (x := record_of(layout))["job"]["state"] == rt.J_COMPLETED and x,
        timeout=40,
        what="job completion after restart",
    )
    assert final["job"]["restarts"] == 1
    # Resumed: each step was done exactly once across both attempts.
    steps = (layout.state / "progress.1").read_text().split()
    assert steps == [str(i) for i in range(40)]
    assert "was killed by SIGKILL" in layout.log_path("trainer-1").read_text()
    # Services were not touched by the job restart.
    assert component(final, "svc-0")["pid"] == component(record, "svc-0")["pid"]


def test_job_fails_for_good_after_the_retry_limit_and_services_keep_running(layout):
    simple_plan(layout, max_job_restarts=1, member_env={"ALWAYS_FAIL": "1"})
    lifecycle.apply(layout, show_progress=False)
    r = wait_until(lambda: (x := record_of(layout))["job"]["state"] == rt.J_FAILED and x, what="job failure")
    assert r["job"]["restarts"] == 1 and r["job"]["attempt"] == 2
    assert "exited with code 7" in r["job"]["reason"]
    assert component(r, "svc-1")["state"] == rt.C_RUNNING and alive(component(r, "svc-1")["pid"])
    assert "training job failed after 1 restarts" in layout.log_path("trainer-0").read_text()


def test_killed_service_is_restarted(layout):
    simple_plan(layout, steps=5)
    record = lifecycle.apply(layout, show_progress=False)
    old = component(record, "svc-1")["pid"]
    os.kill(old, signal.SIGKILL)
    r = wait_until(
        lambda: (
            (x := record_of(layout))
            and component(x, "svc-1")["restarts"] == 1
            and component(x, "svc-1")["state"] == rt.C_RUNNING
            and x
        ),
        what="service restart",
    )
    new = component(r, "svc-1")["pid"]
    assert new != old and alive(new)
    assert "was killed by SIGKILL" in (layout.state / "logs" / "supervisor.log").read_text()


def test_second_apply_while_running_is_refused(layout):
    simple_plan(layout, steps=5)
    record = lifecycle.apply(layout, show_progress=False)
    with pytest.raises(UsageError, match="already running"):
        lifecycle.apply(layout, show_progress=False)
    assert record_of(layout)["supervisor"]["pid"] == record["supervisor"]["pid"]


def test_ports_in_use_are_named_and_nothing_starts(layout):
    plan = simple_plan(layout, steps=5)
    import socket

    blocker = socket.socket()
    blocker.bind(("127.0.0.1", plan.by_name("svc-1").port))
    blocker.listen()
    try:
        with pytest.raises(UsageError, match=rf"svc-1 port {plan.by_name('svc-1').port}.*-r"):
            lifecycle.apply(layout, show_progress=False)
    finally:
        blocker.close()
    assert record_of(layout) is None and processes_under(layout.state) == []


def test_service_failing_at_start_fails_apply_and_stops_everything(layout):
    simple_plan(layout, service_env={"FAIL_AT_START": "1"})
    with pytest.raises(ComponentError, match=r"svc-1 .*exited with code 3 while starting") as err:
        lifecycle.apply(layout, show_progress=False)
    assert "refusing to start" in str(err.value)  # the log's tail is in the message
    r = record_of(layout)
    assert r["state"] == rt.FAILED
    wait_until(lambda: processes_under(layout.state) == [], timeout=10, what="no processes left")


def test_logs_before_apply_then_after(layout):
    simple_plan(layout, steps=3)
    with pytest.raises(UsageError, match="run `elastic-control -a` first"):
        show_logs(layout, components=["trainer-0"])
    lifecycle.apply(layout, show_progress=False)
    wait_until(lambda: record_of(layout)["job"]["state"] == rt.J_COMPLETED, what="job completion")
    out = io.StringIO()
    show_logs(layout, components=["trainer-0", "svc-0"], out=out)
    text = out.getvalue()
    assert "trainer-0 | step 2" in text and "svc-0     | listening on" in text
    with pytest.raises(UsageError, match="unknown component"):
        show_logs(layout, components=["nope"])
    # --follow streams new lines until told to stop.
    out = io.StringIO()
    os.kill(component(record_of(layout), "svc-0")["pid"], signal.SIGKILL)
    show_logs(
        layout, components=["svc-0"], follow=True, out=out, tail=0, stop_when=lambda: "listening on" in out.getvalue()
    )
    assert "svc-0 | listening on" in out.getvalue()


def test_killed_supervisor_leaves_a_stale_state_that_delete_and_apply_handle(layout):
    simple_plan(layout, steps=200)
    record = lifecycle.apply(layout, show_progress=False)
    sup = record["supervisor"]["pid"]
    children = [c["pid"] for c in record["components"].values() if c["pid"]]
    os.kill(sup, signal.SIGKILL)
    wait_until(lambda: not alive(sup), what="supervisor gone")
    # Its children got the parent-death signal.
    wait_until(lambda: not any(alive(p) for p in children), timeout=10, what="children gone")
    from elastic_control.local.status import collect_status

    status = collect_status(layout, probe=False)
    assert status.controller["stale"] and status.state == "not running"
    assert any("without stopping cleanly" in a for a in status.alerts)
    # A new -a over the stale state works and starts fresh.
    record2 = lifecycle.apply(layout, show_progress=False)
    assert record2["supervisor"]["pid"] != sup
    lifecycle.delete(layout)
    assert processes_under(layout.state) == []


def test_supervisor_survives_the_terminal_closing(layout, tmp_path):
    """-a run from a shell that then goes away (SIGHUP to its session) leaves the pipeline running."""
    simple_plan(layout, steps=100)
    code = (
        "import sys; from elastic_control.local import lifecycle; from ctr_foundation.names import "
        f"StateFolder; lifecycle.apply(StateFolder.of({str(layout.state)!r}), show_progress=False)"
    )
    # A new session stands in for the terminal; the whole session gets SIGHUP when -a is done.
    proc = subprocess.Popen(
        [sys.executable, "-c", code + "; import os, signal; os.killpg(0, signal.SIGHUP)"],
        start_new_session=True,
        cwd=str(tmp_path),
    )
    proc.wait(timeout=60)
    r = record_of(layout)
    assert r and r["state"] == rt.RUNNING
    time.sleep(0.5)
    assert rt.supervisor_info(layout).alive
    os.kill(r["supervisor"]["pid"], signal.SIGHUP)
    time.sleep(0.3)
    assert rt.supervisor_info(layout).alive


def test_free_ports_are_free_and_distinct():
    ports = free_ports(20)
    assert len(set(ports)) == 20 and all(port_is_free(p) for p in ports)


def test_an_offline_job_that_wrote_no_pass_failed_and_says_why(layout):
    """Every hour missing means every trainer exits 0 with nothing written: that is a failure."""
    from elastic_control.local.status import collect_status

    models = layout.state / "models"
    window = {"start": "20191221/00", "end": "20191221/01", "dataset": "/data/nowhere"}
    simple_plan(layout, steps=3, model_path=str(models), training_window=window)
    lifecycle.apply(layout, show_progress=False)
    r = wait_until(lambda: (x := record_of(layout))["job"]["state"] in (rt.J_FAILED, rt.J_COMPLETED) and x, what="end")
    assert r["job"]["state"] == rt.J_FAILED and r["job"]["restarts"] == 0  # nothing to gain from a restart
    assert "without writing a pass" in r["job"]["reason"] and "/data/nowhere" in r["job"]["reason"]
    assert "elastic-control data synth --output /data/nowhere --start 20191221/00" in r["job"]["reason"]
    status = collect_status(layout, probe=False)
    assert status.training["state"] == "failed"
    assert any(a.startswith("training failed: the trainers finished without writing a pass") for a in status.alerts)
    # The same job with a pass of the window in the donefile has completed.
    lifecycle.delete(layout)
    from ctr_foundation.records import DonefileEntry, append_donefile, utc_now

    entry = DonefileEntry(
        "pass-20191221-01", str(models / "p"), {"start": "20191221/01", "end": "20191221/01"}, utc_now()
    )
    append_donefile(models, entry)
    lifecycle.apply(layout, show_progress=False)
    r = wait_until(lambda: (x := record_of(layout))["job"]["state"] in (rt.J_FAILED, rt.J_COMPLETED) and x, what="end")
    assert r["job"]["state"] == rt.J_COMPLETED, r["job"]


def test_components_get_only_their_planned_variables_and_secrets(layout, tmp_path):
    """A registry variable exported where -a runs never reaches a component unless its plan sets it (pods do not see
    that shell either); the token goes only to the components whose pods get it from the Secret."""
    from elastic_control.local.spec import JOB, ComponentSpec, LocalPlan, save_local_plan
    from elastic_control.local.supervisor import Supervisor

    dump = "import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], 'w'))"
    comps = [
        ComponentSpec(
            name=f"trainer-{i}",
            kind="trainer",
            group=JOB,
            ready="none",
            argv=[sys.executable, "-c", dump, str(tmp_path / f"env-{i}.json")],
            env={"ELASTIC_CTR_CUBE_SHARDS": "2"},
            secrets=["ELASTIC_CTR_TOKEN"] if i == 0 else [],
        )
        for i in range(2)
    ]
    plan = LocalPlan(components=comps, pserver_exit_grace=0.1)
    save_local_plan(plan, layout.components_file)
    outside = {
        **os.environ,
        "ELASTIC_CTR_CUBE_KEEP": "99",  # a registry variable the plan does not set
        "ELASTIC_CTR_CUBE_SHARDS": "5",  # one it sets differently
        "ELASTIC_CTR_TOKEN": "from-the-shell",
        "ELASTIC_CTR_DEBUG": "1",  # inherited on purpose (tracebacks), as are the test hooks
        "SOME_OTHER_VARIABLE": "kept",
    }
    sup = Supervisor(layout, plan, base_env=outside, secret_env={"ELASTIC_CTR_TOKEN": "the-token"})
    assert sup.run(until=lambda: sup.job.state == rt.J_COMPLETED) == 0
    import json

    first, second = (json.loads((tmp_path / f"env-{i}.json").read_text()) for i in range(2))
    for env in (first, second):
        assert "ELASTIC_CTR_CUBE_KEEP" not in env and env["ELASTIC_CTR_CUBE_SHARDS"] == "2"
        assert env["ELASTIC_CTR_DEBUG"] == "1" and env["SOME_OTHER_VARIABLE"] == "kept"
    assert first["ELASTIC_CTR_TOKEN"] == "the-token" and "ELASTIC_CTR_TOKEN" not in second


# A service that, like MLflow, serves from a child it forks (uvicorn): the child stays in the service's
# process group and answers GET /healthz with its own PID. Parent-death signals do not reach it.
FORKING_PARENT = r"""
import subprocess, sys
child = subprocess.Popen([sys.executable, sys.argv[1], sys.argv[2]])
sys.exit(child.wait())
"""
FORKED_SERVER = r"""
import http.server, os, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(str(os.getpid()).encode())
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _answering_pid(port: int) -> int | None:
    try:
        return int(requests.get(f"http://127.0.0.1:{port}/healthz", timeout=2).text)
    except (requests.RequestException, ValueError):
        return None


def test_a_service_killed_outright_leaves_no_orphan_holding_its_port(layout):
    """kill -9 of a parent whose child serves the port: the supervisor stops the child (the rest of the
    parent's process group) before restarting, so the restart binds the port; delete then leaves nothing."""
    plan = simple_plan(layout, services=1, steps=2000)
    scripts = layout.state / "scripts"
    (scripts / "service.py").write_text(FORKING_PARENT)
    (scripts / "child.py").write_text(FORKED_SERVER)
    svc = plan.components[0]
    svc.argv[1:] = [str(scripts / "service.py"), str(scripts / "child.py"), str(svc.port)]
    save_local_plan(plan, layout.components_file)
    record = lifecycle.apply(layout, show_progress=False)
    parent = component(record, "svc-0")["pid"]
    child = wait_until(lambda: _answering_pid(svc.port), what="the forked server answering")
    assert child != parent and alive(child)
    os.kill(parent, signal.SIGKILL)
    new_child = wait_until(
        lambda: (
            (r := record_of(layout))
            and component(r, "svc-0")["restarts"] == 1
            and component(r, "svc-0")["state"] == rt.C_RUNNING
            and (pid := _answering_pid(svc.port)) not in (None, child)
            and pid
        ),
        timeout=30,
        what="a restarted service answering from a new child",
    )
    assert not alive(child), "the orphan of the killed parent is still alive"
    lifecycle.delete(layout)
    assert port_is_free(svc.port) and _answering_pid(svc.port) is None
    assert not alive(new_child) and processes_under(layout.state) == []
