"""`elastic-control train` as users run it: the job under the local supervisor, its output, logs and exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers_local import alive, processes_under, wait_until

from ctr_foundation.records import read_donefile

PYTHON = sys.executable


def _job(tmp_path: Path, *, hours: int, dataset: str = "data") -> list[str]:
    (tmp_path / "slot.conf").write_text("".join(f"{s}\n" for s in range(1, 7)))
    end = f"20191221/{hours - 1:02d}"
    (tmp_path / "data.config").write_text(
        f'export START_DATE_HR=20191221/00\nexport END_DATE_HR={end}\nexport DATASET_PATH="{dataset}"\n'
        'export MODEL_PATH="models"\n'
    )
    return ["train", "-f", "data.config", "-s", "slot.conf", "-t", "1", "-p", "1"]


def _run(tmp_path: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL_PATH", "MLFLOW_TRACKING_URI")}
    return subprocess.run(
        [PYTHON, "-m", "elastic_control", *args], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=timeout
    )


def _synth(tmp_path: Path, hours: int, lines: int) -> None:
    res = _run(
        tmp_path,
        "data",
        "synth",
        "--output",
        "data",
        "--hours",
        str(hours),
        "--lines-per-hour",
        str(lines),
        "-s",
        "slot.conf",
    )
    assert res.returncode == 0, res.stderr


def test_train_without_a_complete_hour_fails_at_once_saying_how_to_make_data(tmp_path):
    args = _job(tmp_path, hours=2, dataset="nothing")
    res = _run(tmp_path, *args)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().count("\n") == 0, res.stderr
    assert "no complete hour in 20191221/00..20191221/01" in res.stderr and "elastic-control data synth" in res.stderr
    assert not (tmp_path / "models").exists()  # nothing started


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model", "dnn"], "--wide-prior 0.1 with MODEL=dnn: the prior pulls the per-key wide weight"),
        (["--l2-wide", "0"], "--wide-prior 0.1 with --l2-wide 0"),
    ],
)
def test_a_wide_prior_that_would_do_nothing_is_a_usage_error(tmp_path, flags, message):
    args = _job(tmp_path, hours=1)
    _synth(tmp_path, 1, 200)
    res = _run(tmp_path, *args, "--wide-prior", "0.1", *flags)
    assert res.returncode == 2 and "Traceback" not in res.stderr and message in res.stderr, res.stderr
    assert not (tmp_path / "models").exists()  # refused before any process started


@pytest.mark.e2e
def test_train_runs_the_job_under_the_local_supervisor(tmp_path):
    args = _job(tmp_path, hours=1)
    _synth(tmp_path, 1, 1500)
    res = _run(tmp_path, *args, "--log-every", "5")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines() == ["pass-20191221-00"]  # data on stdout: the last pass
    assert "training 6 slots, hours 20191221/00..20191221/00 with 1 trainer(s) and 1 pserver(s)" in res.stderr
    assert "[trainer 0]" in res.stderr and "training finished in" in res.stderr and "1 complete pass(es)" in res.stderr
    assert "I1201" not in res.stderr and "brpc" not in res.stderr  # progress lines only; the logs keep the rest
    logs = tmp_path / "models" / "logs"
    assert "[trainer 0] exported pass-20191221-00" in (logs / "train-trainer-0.log").read_text()
    assert "starting the training job (attempt 1)" in (logs / "train-supervisor.log").read_text()
    record = json.loads((logs / ".train-job" / "local" / "runtime.json").read_text())
    assert record["job"]["state"] == "completed" and record["state"] == "stopped"
    pserver = record["components"]["pserver-0"]
    assert pserver["last_exit"] == 0 and not pserver["stopped_by_supervisor"]  # trainer 0 stopped it, cleanly
    # Ports come from below the kernel's ephemeral range, pserver 0's barrier port (port + 1) with it.
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert max(p for c in record["components"].values() for p in c["ports"]) < low
    assert pserver["ports"] == [pserver["port"], pserver["port"] + 1]
    assert processes_under(tmp_path) == []


@pytest.mark.e2e
def test_interrupted_train_stops_every_role_and_exits_130(tmp_path):
    args = _job(tmp_path, hours=2)
    _synth(tmp_path, 2, 40_000)
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL_PATH", "MLFLOW_TRACKING_URI")}
    proc = subprocess.Popen(
        [PYTHON, "-m", "elastic_control", *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    runtime = tmp_path / "models" / "logs" / ".train-job" / "local" / "runtime.json"
    try:
        record = wait_until(
            lambda: (
                runtime.exists()
                and (r := json.loads(runtime.read_text()))["components"]["trainer-0"]["pid"]
                and alive(r["components"]["trainer-0"]["pid"])
                and r
            ),
            timeout=120,
            what="the trainer running",
        )
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    pids = [c["pid"] for c in record["components"].values() if c["pid"]]
    assert pids and not any(alive(p) for p in pids)
    wait_until(lambda: processes_under(tmp_path) == [], timeout=20, what="no process left")


def test_a_window_over_grouped_hours_is_a_usage_error(tmp_path):
    args = _job(tmp_path, hours=2)
    with open(tmp_path / "data.config", "a") as f:
        f.write("export PASS_HOURS=2\n")
    _synth(tmp_path, 2, 200)
    res = _run(tmp_path, *args, "--window-hours", "3")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "--window-hours 3 with PASS_HOURS=2" in res.stderr and "--window-hours 1" in res.stderr
    assert not (tmp_path / "models").exists()


@pytest.mark.e2e
def test_each_pass_also_trains_one_epoch_over_the_hour_before_it(tmp_path):
    args = _job(tmp_path, hours=3)
    _synth(tmp_path, 3, 1200)
    res = _run(tmp_path, *args, "--epochs", "2", "--no-early-stop", "--window-hours", "2")
    assert res.returncode == 0, res.stderr[-3000:]
    training = [
        json.loads((tmp_path / "models" / f"pass-20191221-0{h}" / "meta.json").read_text())["training"]
        for h in range(3)
    ]
    assert [t["window_hours"] for t in training] == [2, 2, 2]
    # The first hour has none before it in the window; the others get the whole hour before (one trainer).
    assert [t["window_lines"] for t in training] == [0, 1200, 1200]
    assert "also 1200 lines of 20191221/00 in its first epoch" in res.stderr
    # Its own epochs stay its hour's: two epochs of 1,200 lines plus one of the hour before, less held-out lines.
    metrics = read_donefile(tmp_path / "models")[1].metrics
    held = metrics["holdout_lines"]
    assert held > 0 and metrics["examples"] == 2 * (1200 - held) + 1200
