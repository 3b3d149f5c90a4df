"""The main job on the real components, with the failures the local backend must absorb.

One small pipeline (synthetic data, 3 hourly passes, 2 trainers, 1 pserver,
2 cube shards) runs through `run_demo(keep=True)`; a trainer is killed
during the second pass. Then: served predictions match the last pass,
`status` / `-l` work, a killed cube server comes back with the active
version, a serving process killed during predictions loses none the client
reports, and `delete` leaves no process and keeps data and models.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
from helpers_common import wait_until
from helpers_local import alive, kill_everything_under, processes_under

from elastic_control.cli.exit_codes import EXIT_NOT_RUNNING

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

HOURS = 3
LINES_PER_HOUR = 3000


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "elastic_control", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "200"},
    )


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    from elastic_control.demo.run import run_demo

    workdir = tmp_path_factory.mktemp("pipeline") / "demo"
    killed: dict = {}

    def kill_trainer_during_second_pass(event, deployment):
        if killed:
            return
        victim = deployment.status(probe=False).component("trainer-1")
        time.sleep(0.5)  # into the next pass (the trainers move on right after the donefile line)
        killed.update(pid=victim.pid, after=event.name, at=time.time())
        os.kill(victim.pid, signal.SIGKILL)

    try:
        report = run_demo(
            workdir=str(workdir),
            hours=HOURS,
            lines_per_hour=LINES_PER_HOUR,
            trainers=2,
            pservers=1,
            shards=2,
            keep=True,
            show=False,
            timeout=780,
            on_pass=kill_trainer_during_second_pass,
        )
    except BaseException:
        kill_everything_under(workdir)
        raise
    yield report, killed, workdir
    kill_everything_under(workdir)


def state_of(pipeline):
    report, _, workdir = pipeline
    return Path(report.state_dir)


def test_trainer_killed_mid_pass_restarts_the_job_from_the_last_complete_pass(pipeline):
    report, killed, workdir = pipeline
    from ctr_foundation.records import read_donefile

    assert killed, "the trainer was never killed"
    assert report.job["state"] == "completed"
    assert report.job["restarts"] == 1 and report.job["attempt"] == 2
    assert "trainer-1" in report.job["reason"] and "SIGKILL" in report.job["reason"]
    entries = read_donefile(workdir / "models")
    names = [e.pass_name for e in entries]
    # Every hour trained once: the restart resumed after the last complete pass, it did not start over.
    assert names == ["pass-20191221-00", "pass-20191221-01", "pass-20191221-02"]
    first_done = entries[0]
    assert names.index(killed["after"]) == 0 and first_done.pass_name == killed["after"]


def test_served_predictions_match_the_last_pass(pipeline):
    report, _, workdir = pipeline
    assert report.served_version == "pass-20191221-02"
    assert report.golden_lines > 0 and report.golden_max_diff is not None and report.golden_max_diff < 1e-5
    assert report.predictions == LINES_PER_HOUR and 0.0 <= report.auc <= 1.0
    last = [r for r in report.rollouts if r["version"] == report.served_version]
    assert last and last[0]["freshness_s"] is not None and last[0]["freshness_s"] >= 0
    # Offline scoring of held-out lines with the pass itself (sparse table in memory, dense model) agrees too.
    import pyarrow  # noqa: F401  (before paddle)

    import numpy as np

    from ctr_foundation.pass_format import load_pass
    from elastic_control.demo.data import DEMO_START
    from elastic_control.demo.run import predict_through_client
    from elastic_control.inference.scoring import DenseModel, InMemoryTable, score_lines

    hour = workdir / "data" / f"{DEMO_START:%Y%m%d}" / f"{HOURS:02d}"
    lines = [ln for p in sorted(hour.glob("part-*")) for ln in p.read_text().splitlines() if ln.strip()][:300]
    info = load_pass(workdir / "models" / report.served_version)
    offline = score_lines(lines, info, InMemoryTable.from_pass(info).lookup, DenseModel.from_pass(info))
    served, versions, _ = predict_through_client(Path(report.state_dir), lines)
    assert {v[0] for v in versions} == {report.served_version}
    assert np.max(np.abs(served - offline)) < 1e-5


def test_client_json_names_serving_grpc_and_grpc_predictions_equal_http(pipeline):
    """-c writes serving_grpc (HOST:PORT) into client.json; `predict --transport grpc` answers what HTTP does."""
    report, _, _ = pipeline
    state = state_of(pipeline)
    config = json.loads((state / "client.json").read_text())
    assert config["serving_grpc"].startswith("127.0.0.1:"), config
    golden = [
        json.loads(ln)
        for ln in (Path(report.workdir) / "models" / report.served_version / "golden.jsonl").read_text().splitlines()
    ][:40]
    lines_file = state / "grpc-lines.txt"
    lines_file.write_text("".join(g["line"] + "\n" for g in golden))
    outs = {}
    for transport in ("http", "grpc"):
        out = cli("predict", str(lines_file), "--transport", transport, "--state-dir", str(state))
        assert out.returncode == 0, out.stderr
        outs[transport] = [float(x) for x in out.stdout.split()]
    assert max(abs(a - b) for a, b in zip(outs["http"], outs["grpc"], strict=True)) < 1e-6
    assert max(abs(a - g["prob"]) for a, g in zip(outs["grpc"], golden, strict=True)) < 1e-5


def test_status_and_logs_commands(pipeline):
    state = state_of(pipeline)
    res = cli("status", "--state-dir", str(state))
    assert res.returncode == 0, res.stderr
    text = res.stdout + res.stderr
    for expected in (
        "supervisor running",
        "trainer-0",
        "cube-server-1",
        "serving",
        "3/3 passes done",
        "job completed",
        "restarts 1/3",
        "pass-20191221-02",
        "freshness",
    ):
        assert expected in text, f"{expected!r} missing from status:\n{text}"
    res = cli("-l", "--state-dir", str(state))
    assert res.returncode == 0, res.stderr
    for prefix in ("trainer-0     |", "fileserver    |", "cube-transfer |"):
        assert prefix in res.stdout, f"{prefix!r} missing from -l output"
    # Paddle's glog lines stay in the log file, not in -l (they drown the pipeline's own); --raw shows them.
    glog = re.compile(r"^I\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+\.(cc|cpp|h):\d+\]", re.M)
    assert glog.search((state / "logs" / "trainer-0.log").read_text())
    assert "[trainer 0]" in res.stdout and not glog.search(re.sub(r"^\S+ +\| ", "", res.stdout, flags=re.M))
    assert "lines of Paddle's internal logging hidden" in res.stdout
    raw = cli("-l", "--raw", "--state-dir", str(state))
    assert raw.returncode == 0 and glog.search(re.sub(r"^\S+ +\| ", "", raw.stdout, flags=re.M))
    # One component, its last lines; the lines of the last minutes.
    res = cli("-l", "trainer-1", "--tail", "5", "--state-dir", str(state))
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stdout.splitlines() if not ln.startswith("trainer-1 | (")]
    assert 0 < len(lines) <= 5 and all(ln.startswith("trainer-1 | ") for ln in lines), res.stdout
    res = cli("-l", "serving", "--since", "30m", "--state-dir", str(state))
    assert res.returncode == 0 and res.stdout.startswith("serving | "), res.stdout
    assert (
        "was killed by SIGKILL" in (state / "logs" / "trainer-1.log").read_text()
        or "was killed by SIGKILL" in (state / "logs" / "supervisor.log").read_text()
    )


def test_status_probes_each_component_and_sees_a_stopped_one(pipeline):
    """status on the real components: per-shard versions, serving answering, JSON, and SIGSTOP seen as hung."""
    report, _, _ = pipeline
    state = state_of(pipeline)
    version = report.served_version
    res = cli("status", "--state-dir", str(state))
    assert res.returncode == 0 and f"serving answers with {version}" in res.stdout
    assert res.stdout.splitlines()[1] == "health: healthy"
    assert f"shards: 0 {version}, 1 {version}" in res.stdout
    assert "cube-server-0" not in res.stderr  # the data is on stdout, so `status > file` keeps it
    doc = json.loads(cli("status", "--json", "--state-dir", str(state)).stdout)
    comps = {c["name"]: c for c in doc["components"]}
    assert {c["state"] for n, c in comps.items() if not n.startswith(("pserver", "trainer"))} == {"running"}
    assert comps["cube-server-1"]["version"] == version and comps["serving"]["version"] == version
    assert all(c["address"] for c in comps.values()) and doc["serving"]["answers"] is True
    assert doc["training"]["passes_done"] == HOURS and doc["training"]["state"] == "completed"
    for victim in ("cube-agent-0", "cube-server-1"):
        pid = comps[victim]["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            doc = json.loads(cli("status", "--json", "--state-dir", str(state)).stdout)
            text = cli("status", "--state-dir", str(state)).stdout
        finally:
            os.kill(pid, signal.SIGCONT)
        now = {c["name"]: c for c in doc["components"]}
        assert now[victim]["state"] == "hung" and f"kill -CONT {pid}" in now[victim]["detail"]
        assert any(a.startswith(f"{victim} is hung") for a in doc["alerts"])
        if victim == "cube-server-1":
            assert doc["serving"]["answers"] is False and "serving answers with" not in text
            assert "cannot answer: cube-server-1 is hung" in text
    wait_until(
        lambda: json.loads(cli("status", "--json", "--state-dir", str(state)).stdout)["serving"]["answers"],
        timeout=30,
        what="serving answering again",
    )


def test_eval_submit_runs_where_the_plan_runs(pipeline):
    """`eval submit` through the backend interface: locally, worker processes on the pipeline's data and passes."""
    report, _, _ = pipeline
    state = state_of(pipeline)
    res = cli(
        "eval",
        "submit",
        "--state-dir",
        str(state),
        "--model",
        report.served_version,
        "--workers",
        "2",
        "--start",
        "20191221/00",
        "--end",
        "20191221/00",
        "--run",
        "t1",
        "--json",
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    metrics = json.loads(res.stdout.strip().splitlines()[-1])
    assert metrics["model"]["pass"] == report.served_version and metrics["data"]["lines"] == LINES_PER_HOUR
    assert 0.5 < metrics["model"]["auc"] <= 1.0
    out = state / "eval" / "t1" / "out"
    assert json.loads((out / "metrics.json").read_text())["model"]["auc"] == metrics["model"]["auc"]
    assert len(list((state / "eval" / "t1" / "partials").glob("share-*"))) == 2


def _record(state: Path) -> dict:
    return json.loads((state / "local" / "runtime.json").read_text())


def test_killed_cube_server_restarts_with_the_active_version(pipeline):
    report, _, _ = pipeline
    state = state_of(pipeline)
    from elastic_control.demo.run import predict_through_client

    comp = _record(state)["components"]["cube-server-0"]
    port, old_pid = comp["port"], comp["pid"]
    os.kill(old_pid, signal.SIGKILL)
    wait_until(
        lambda: (
            (c := _record(state)["components"]["cube-server-0"])["restarts"] == 1
            and c["state"] == "running"
            and c["pid"] != old_pid
        ),
        timeout=90,
        what="cube-server-0 restart",
    )
    status = requests.get(f"http://127.0.0.1:{port}/v1/status", timeout=5).json()
    assert report.served_version in json.dumps(status), status
    from ctr_foundation.records import GOLDEN_FILE, read_golden

    lines, probs = read_golden(Path(report.workdir) / "models" / report.served_version / GOLDEN_FILE)
    served, versions, _ = predict_through_client(state, lines[:50])
    assert {v[0] for v in versions} == {report.served_version}
    assert max(abs(s - p) for s, p in zip(served, probs[:50], strict=True)) < 1e-5


def test_serving_killed_during_predictions_loses_nothing(pipeline):
    report, _, workdir = pipeline
    state = state_of(pipeline)
    from client.api import ServingClient, resolve_client_settings

    hour = workdir / "data" / "20191221" / f"{HOURS:02d}"
    lines = [ln for p in sorted(hour.glob("part-*")) for ln in p.read_text().splitlines() if ln.strip()]
    client = ServingClient(resolve_client_settings(state_dir=state).serving_url, retry_for=120)
    reference = list(client.predict_lines(lines, batch_size=50))
    old_pid = _record(state)["components"]["serving"]["pid"]
    got: list[float] = []
    errors: list[BaseException] = []

    def predict_all():
        try:
            slow = ServingClient(client.url, retry_for=120)
            for i in range(0, len(lines), 25):
                got.extend(slow.predict_lines(lines[i : i + 25], batch_size=25))
                time.sleep(0.01)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    worker = threading.Thread(target=predict_all)
    worker.start()
    wait_until(lambda: len(got) >= 200, timeout=60, what="predictions under way")
    os.kill(old_pid, signal.SIGKILL)
    worker.join(timeout=240)
    assert not worker.is_alive() and not errors, errors
    assert len(got) == len(lines)
    assert max(abs(a - b) for a, b in zip(got, reference, strict=True)) < 1e-6
    c = _record(state)["components"]["serving"]
    assert c["restarts"] >= 1 and c["pid"] != old_pid


def test_apply_converges_then_delete_leaves_no_process(pipeline):
    report, _, workdir = pipeline
    state = state_of(pipeline)
    before = _record(state)
    # -a on the running pipeline with the same plan: nothing changes, and it says so.
    res = cli("-a", "--state-dir", str(state))
    assert res.returncode == 0 and "nothing to do" in res.stdout + res.stderr, res.stderr
    assert _record(state)["components"]["mlflow"]["pid"] == before["components"]["mlflow"]["pid"]
    # -r with a third cube shard while running, then -a: the shards grow, serving follows, the job is left alone.
    passes = (workdir / "models" / "donefile").read_text()
    render = ["-r", "--backend", "local", "-s", str(workdir / "slot.conf"), "-f", str(workdir / "data.config")]
    res = cli(*render, "-t", "2", "-p", "1", "-b", "3", "--state-dir", str(state))
    assert res.returncode == 0, res.stderr
    res = cli("-a", "--state-dir", str(state), timeout=400)
    text = res.stdout + res.stderr
    assert res.returncode == 0 and "cube-server-2 created" in text and "trainer-0" not in text, text
    after = _record(state)
    assert after["supervisor"]["pid"] == before["supervisor"]["pid"]
    assert after["components"]["cube-server-2"]["state"] == "running"
    for name in ("mlflow", "fileserver", "trainer-0"):
        assert after["components"][name]["pid"] == before["components"][name]["pid"], name
    assert after["job"]["state"] == "completed" and after["job"]["attempt"] == before["job"]["attempt"]
    assert (workdir / "models" / "donefile").read_text() == passes
    # Serving restarted on the three shards; cube-transfer re-splits the active version for them
    # (PASS.s3) and serving answers with it, the same probabilities as before. No version is lost.
    assert after["components"]["serving"]["pid"] != before["components"]["serving"]["pid"]
    assert sum(n.startswith("cube-server-") for n in after["components"]) == 3
    from ctr_foundation.records import GOLDEN_FILE, read_golden
    from elastic_control.demo.run import predict_through_client

    served_pass = report.served_version
    resharded = f"{served_pass}.s3"
    lines, probs = read_golden(Path(report.workdir) / "models" / served_pass / GOLDEN_FILE)

    def answers_resharded() -> bool:
        doc = json.loads(cli("status", "--json", "--state-dir", str(state)).stdout)
        return bool(doc["serving"].get("answers")) and doc["serving"].get("version") == resharded

    wait_until(answers_resharded, timeout=240, what=f"serving answering with {resharded}")
    served, got_versions, _ = predict_through_client(state, lines[:50])
    assert {v[0] for v in got_versions} == {resharded}
    assert max(abs(s - p) for s, p in zip(served, probs[:50], strict=True)) < 1e-5
    now = {p.name for p in (state / "cube").iterdir()}
    assert resharded in now and served_pass in now, sorted(now)
    res = cli("-a", "--state-dir", str(state))
    assert res.returncode == 0 and "nothing to do" in res.stdout + res.stderr, res.stderr
    pids = [c["pid"] for c in _record(state)["components"].values() if c["pid"]]
    res = cli("delete", "--state-dir", str(state))
    assert res.returncode == 0, res.stderr
    assert not any(alive(p) for p in pids)
    wait_until(lambda: processes_under(workdir) == [], timeout=20, what="no process left")
    assert (workdir / "models" / "donefile").exists() and (workdir / "data").is_dir()
    res = cli("status", "--state-dir", str(state))
    assert res.returncode == EXIT_NOT_RUNNING and "supervisor stopped" in res.stdout + res.stderr
