"""The local backend through the command line: -r, the plan it renders, and clear messages for wrong orders.

Fast: nothing here starts the pipeline's components.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_local import write_complete_hours

from elastic_control.cli.exit_codes import EXIT_NOT_RUNNING
from elastic_control.local.spec import COMPONENTS_FORMAT

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("ELASTIC_CTR_STATE_DIR", None)
    return subprocess.run(
        [sys.executable, "-m", "elastic_control", *args], capture_output=True, text=True, timeout=120, cwd=cwd, env=env
    )


@pytest.fixture
def rendered(tmp_path):
    (tmp_path / "slot.conf").write_text("1\n2\n3\n")
    (tmp_path / "data.config").write_text(
        "export START_DATE_HR=20191221/00\nexport END_DATE_HR=20191221/01\n"
        'export DATASET_PATH="data"\nexport SPARSE_DIM="1000"\n'
    )
    write_complete_hours(tmp_path / "data", hours=1)  # -r wants at least one complete hour in the window
    res = cli(
        "-r",
        "--backend",
        "local",
        "-t",
        "2",
        "-p",
        "2",
        "-b",
        "3",
        "-s",
        "slot.conf",
        "-f",
        "data.config",
        "--state-dir",
        "st",
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    return tmp_path, tmp_path / "st"


def test_render_plans_every_component_on_distinct_free_ports(rendered):
    cwd, state = rendered
    plan = json.loads((state / "local" / "components.json").read_text())
    names = [c["name"] for c in plan["components"]]
    assert names == [
        "mlflow",
        "fileserver",
        "cube-server-0",
        "cube-agent-0",
        "cube-server-1",
        "cube-agent-1",
        "cube-server-2",
        "cube-agent-2",
        "cube-transfer",
        "serving",
        "pserver-0",
        "pserver-1",
        "trainer-0",
        "trainer-1",
    ]
    ports = [p for c in plan["components"] for p in ([c["port"]] if c["port"] else []) + c["extra_ports"]]
    assert len(ports) == len(set(ports)) == len(names) + 2  # + pserver 0's barrier port and serving's gRPC port
    # pserver 0 also listens on its port + 1 (the trainers' barrier service): planned, so never given away.
    pserver0 = next(c for c in plan["components"] if c["name"] == "pserver-0")
    assert pserver0["extra_ports"] == [pserver0["port"] + 1]
    # The offline window is recorded: a job that writes no pass of it fails.
    assert plan["training_window"] == {"start": "20191221/00", "end": "20191221/01", "dataset": str(cwd / "data")}
    # The components read an expanded data.config with absolute paths and MODEL_PATH set.
    text = (state / "local" / "data.config").read_text()
    assert f'DATASET_PATH="{cwd / "data"}"' in text and f'MODEL_PATH="{state.resolve() / "models"}"' in text
    # The token never lands in the local plan (the supervisor hands it to the children that need it;
    # tests/test_env_parity.py checks they are those whose pods get it).
    token = (state / "token").read_text().strip()
    assert token not in (state / "local" / "components.json").read_text()
    assert {c["name"] for c in plan["components"] if c["secrets"]} == set(names) - {"mlflow"}  # serving: split control
    # Every component listens on loopback only.
    for c in plan["components"]:
        if c["kind"] in ("mlflow", "fileserver", "cube-server", "cube-agent", "cube-transfer", "serving"):
            assert "--host" in c["argv"] and c["argv"][c["argv"].index("--host") + 1] == "127.0.0.1", c["name"]


def test_log_before_apply_and_delete_before_apply_are_clear(rendered):
    cwd, state = rendered
    res = cli("-l", "--state-dir", "st", cwd=cwd)
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "run `elastic-control -a` first" in res.stderr
    res = cli("-c", "--state-dir", "st", cwd=cwd)
    assert res.returncode == 2 and "not running" in res.stderr and "Traceback" not in res.stderr
    res = cli("delete", "--state-dir", "st", cwd=cwd)
    assert res.returncode == 0 and "nothing was running" in res.stderr
    res = cli("status", "--state-dir", "st", cwd=cwd)
    assert res.returncode == EXIT_NOT_RUNNING and "never started" in res.stdout + res.stderr


def test_state_folder_from_an_older_version_is_refused_clearly(rendered):
    cwd, state = rendered
    path = state / "local" / "components.json"
    plan = json.loads(path.read_text())
    plan["format"] = COMPONENTS_FORMAT - 1
    path.write_text(json.dumps(plan))
    for args in (("-a",), ("status",), ("-l",)):
        res = cli(*args, "--state-dir", "st", cwd=cwd)
        assert res.returncode == 2, (args, res.stderr)
        assert "older or newer version" in res.stderr and "run -r again" in res.stderr
        assert "Traceback" not in res.stderr
    # A state folder rendered before the local backend existed has no local plan at all.
    path.unlink()
    res = cli("-a", "--state-dir", "st", cwd=cwd)
    assert res.returncode == 2 and "not rendered for the local backend" in res.stderr
    # -r again repairs it.
    res = cli("-r", "--backend", "local", "-s", "slot.conf", "-f", "data.config", "--state-dir", "st", cwd=cwd)
    assert res.returncode == 0 and path.exists()


def test_runtime_record_of_an_older_version_does_not_break_status(rendered):
    cwd, state = rendered
    (state / "local" / "runtime.json").write_text(json.dumps({"format": 0, "pid": 12345}))
    res = cli("status", "--state-dir", "st", cwd=cwd)
    assert res.returncode == EXIT_NOT_RUNNING, res.stderr
    assert "Traceback" not in res.stderr


def test_dry_run_starts_nothing(rendered):
    cwd, state = rendered
    res = cli("-a", "--dry-run", "--state-dir", "st", cwd=cwd)
    assert res.returncode == 0 and "would start 14 local processes" in res.stderr
    assert not (state / "local" / "runtime.json").exists()


def test_render_without_data_in_the_window_fails_and_says_how_to_make_some(tmp_path):
    (tmp_path / "slot.conf").write_text("1\n2\n")
    (tmp_path / "data.config").write_text(
        'export START_DATE_HR=20191221/00\nexport END_DATE_HR=20191221/02\nexport DATASET_PATH="nothing-here"\n'
    )
    args = ("-r", "--backend", "local", "-s", "slot.conf", "-f", "data.config", "--state-dir", "st")
    res = cli(*args, cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    message = res.stderr.strip()
    assert message.count("\n") == 0, message
    assert "no complete hour in 20191221/00..20191221/02" in message and str(tmp_path / "nothing-here") in message
    assert f"elastic-control data synth --output {tmp_path / 'nothing-here'} --start 20191221/00 --hours 3" in message
    assert not (tmp_path / "st").exists()  # nothing half-rendered
    # An hour that exists but is not complete (no donefile) does not count either.
    (tmp_path / "nothing-here" / "20191221" / "01").mkdir(parents=True)
    (tmp_path / "nothing-here" / "20191221" / "01" / "part-00000").write_text("1 0 1:1\n")
    assert cli(*args, cwd=tmp_path).returncode == 2
    # ONLINE=1 waits for hours to arrive: an empty window is fine.
    with open(tmp_path / "data.config", "a") as f:
        f.write('export ONLINE="1"\n')
    res = cli(*args, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert json.loads((tmp_path / "st" / "local" / "components.json").read_text())["training_window"] is None
    # The documented data command makes the window trainable offline.
    with open(tmp_path / "data.config", "a") as f:
        f.write('export ONLINE="0"\n')
    res = cli(
        "data",
        "synth",
        "--output",
        "nothing-here",
        "--start",
        "20191221/00",
        "--hours",
        "3",
        "--lines-per-hour",
        "50",
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    assert cli(*args, cwd=tmp_path).returncode == 0
