"""The local backend through the command line: -r, the plan it renders, clear messages for wrong orders,
per-verb help, `status` outputs and exit codes, and -l's component, --tail and --since filters.

Fast: nothing here starts the pipeline's components.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers_local import write_complete_hours

from ctr_foundation.names import StateFolder
from elastic_control.cli.exit_codes import EXIT_NOT_RUNNING, EXIT_USAGE_ERROR
from elastic_control.local import runtime as rt
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


# ---- the command line as an operator uses it: per-verb help, status outputs and exit codes, -l filters ----

VERB_OPTIONS = {
    "-r": ("--cpu", "--trainer", "--cube", "--slot_conf", "--backend", "--storage-class", "--promotion-gate"),
    "-a": ("--dry-run",),
    "-l": ("--tail", "--since", "--follow", "--raw"),
    "-c": (),
}


@pytest.mark.parametrize("verb", list(VERB_OPTIONS))
def test_each_verb_has_its_own_help(tmp_path, verb):
    for args in ((verb, "-h"), ("--help", verb)):
        res = cli(*args, cwd=tmp_path)
        assert res.returncode == 0 and res.stderr == "", res.stderr
        text = res.stdout
        assert text.startswith(f"Usage: elastic-control {verb} [OPTIONS]"), text
        assert "--state-dir" in text and "-h, --help" in text and "Example: elastic-control " + verb in text
        for other, options in VERB_OPTIONS.items():
            for option in options:
                assert (option in text) == (other == verb), (verb, option)
        assert "Commands:" not in text
    # The flags themselves are unchanged, and -h alone still lists everything.
    res = cli("-h", cwd=tmp_path)
    assert all(o in res.stdout for options in VERB_OPTIONS.values() for o in options)
    assert "Commands:" in res.stdout and "elastic-control -r -h" in res.stdout


def test_status_outputs_and_exit_code_of_a_pipeline_never_started(rendered):
    cwd, state = rendered
    docs = {}
    for args in (("-o", "json"), ("--json",), ("-o", "yaml")):
        res = cli("status", *args, "--state-dir", "st", cwd=cwd)
        assert res.returncode == EXIT_NOT_RUNNING, res.stderr
        docs[args] = yaml.safe_load(res.stdout) if "yaml" in args else json.loads(res.stdout)
    for doc in docs.values():
        assert doc["health"] == "not running" and doc["state"] == "never started" and len(doc["components"]) == 14
    assert docs[("-o", "yaml")] == {**docs[("-o", "json")], "probed_at": docs[("-o", "yaml")]["probed_at"]}
    # text and wide: one line per component, whatever the width.
    for output in ("text", "wide"):
        res = cli("status", "-o", output, "--state-dir", "st", cwd=cwd)
        assert res.returncode == EXIT_NOT_RUNNING
        assert "health: not running" in res.stdout
        rows = [ln for ln in res.stdout.splitlines() if "│" in ln]
        assert [r.split()[0] for r in rows] == [c["name"] for c in docs[("--json",)]["components"]], res.stdout


def test_status_errors_are_documents_under_json_and_yaml(tmp_path):
    """No plan: under -o json|yaml the error is a document on stdout, with the usual exit code (2)."""
    for args in (("--json",), ("-o", "json"), ("-ojson",), ("--output=json",)):
        res = cli("status", *args, "--state-dir", "nothing", cwd=tmp_path)
        assert res.returncode == EXIT_USAGE_ERROR and res.stderr == "", (args, res.stderr)
        doc = json.loads(res.stdout)
        assert doc["kind"] == "UsageError" and "no plan in nothing/" in doc["error"] and "-r" in doc["error"]
    res = cli("status", "-o", "yaml", "--state-dir", "nothing", cwd=tmp_path)
    assert res.returncode == EXIT_USAGE_ERROR and yaml.safe_load(res.stdout)["kind"] == "UsageError"
    # A bad flag value too.
    res = cli("status", "-o", "json", "--interval", "soon", cwd=tmp_path)
    assert res.returncode == EXIT_USAGE_ERROR and "--interval" in json.loads(res.stdout)["error"]
    # Without a document output, errors stay one line on stderr and stdout stays empty.
    res = cli("status", "--state-dir", "nothing", cwd=tmp_path)
    assert res.returncode == EXIT_USAGE_ERROR and res.stdout == "" and res.stderr.count("\n") == 1
    res = cli("status", "--json", "-o", "wide", cwd=tmp_path)
    assert res.returncode == EXIT_USAGE_ERROR and "different outputs" in res.stderr


def test_status_watch_shows_updates_until_ctrl_c(rendered):
    cwd, state = rendered
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("ELASTIC_CTR_STATE_DIR", None)
    watch = subprocess.Popen(
        [sys.executable, "-m", "elastic_control", "status", "--watch", "--interval", "0.2", "-o", "yaml"],
        cwd=cwd / "st" / "..",
        env={**env, "ELASTIC_CTR_STATE_DIR": str(state)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal's Ctrl-C
    )
    seen = 0
    while seen < 3:
        line = watch.stdout.readline()
        assert line, watch.stderr.read()
        seen += line == "---\n"
    watch.send_signal(signal.SIGINT)
    out, err = watch.communicate(timeout=30)
    assert watch.returncode == EXIT_NOT_RUNNING and "Traceback" not in err, err  # the last status's code


def _stopped_pipeline_with_logs(state: Path) -> StateFolder:
    """The state of a pipeline that ran and stopped: its logs stay readable."""
    layout = StateFolder.of(state)
    rt.write_runtime(layout, {"state": rt.STOPPED, "components": {}})
    layout.logs_dir.mkdir(parents=True, exist_ok=True)
    old = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(time.time() - 3600))
    new = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(time.time() - 60))
    glog = time.strftime("I%m%d %H:%M:%S.000000", time.localtime(time.time() - 1800))
    layout.log_path("trainer-1").write_text(
        "".join(f"step {i} loss 0.5\n" for i in range(10))
        + f"[supervisor {old}] training job failed: restarting\n"
        + f"{glog}  1234 brpc_ps_client.cc:100] connected\n"
        + "step 10 loss 0.4\n"
        + f"{new} INFO trainer 1 writes pass 2\n"
        + "step 11 loss 0.3\n"
    )
    layout.log_path("cube-server-0").write_text(f"{old} cube-server loaded pass-1\n")
    return layout


def test_logs_of_named_components_with_tail_and_since(rendered):
    cwd, state = rendered
    _stopped_pipeline_with_logs(state)
    res = cli("-l", "trainer-1", "--tail", "3", "--state-dir", "st", cwd=cwd)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "trainer-1 | step 10 loss 0.4" and lines[2] == "trainer-1 | step 11 loss 0.3", lines
    assert len(lines) == 3 and lines[1].startswith("trainer-1 | ") and lines[1].endswith("writes pass 2")
    # --since: the lines of the last 10 minutes. The timeless "step 10" line came after an hour-old line and
    # before a recent one: it may be recent, so it stays; the hour-old lines go.
    res = cli("-l", "trainer-1", "cube-server-0", "--since", "10m", "--state-dir", "st", cwd=cwd)
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("trainer-1")]
    assert lines[0] == "trainer-1     | step 10 loss 0.4" and lines[2] == "trainer-1     | step 11 loss 0.3"
    assert len(lines) == 3 and "step 9 " not in res.stdout and "failed: restarting" not in res.stdout
    assert "cube-server-0 | (nothing since" in res.stdout and "loaded pass-1" not in res.stdout
    res = cli("-l", "trainer-1", "--since", "2h", "--tail", "100", "--raw", "--state-dir", "st", cwd=cwd)
    assert "step 0 loss" in res.stdout and "failed: restarting" in res.stdout and "brpc_ps_client" in res.stdout
    # Options after the components and before them alike; -l with other verbs keeps working.
    res = cli("--state-dir", "st", "-l", "--tail", "1", "trainer-1", cwd=cwd)
    assert res.returncode == 0 and res.stdout == "trainer-1 | step 11 loss 0.3\n", res.stdout


def test_logs_refuse_unknown_components_and_bad_durations(rendered):
    cwd, state = rendered
    _stopped_pipeline_with_logs(state)
    res = cli("-l", "trainer-7", "--state-dir", "st", cwd=cwd)
    assert res.returncode == EXIT_USAGE_ERROR and res.stderr.count("\n") == 1
    assert "no component 'trainer-7' in this plan; did you mean 'trainer-1'?" in res.stderr
    assert "(known: mlflow, fileserver, cube-server-0," in res.stderr and "trainer-1, supervisor)" in res.stderr
    res = cli("-l", "sevring", "--state-dir", "st", cwd=cwd)
    assert res.returncode == EXIT_USAGE_ERROR and "did you mean 'serving'?" in res.stderr
    for bad in ("10x", "-5m", "0"):
        res = cli("-l", "--since", bad, "--state-dir", "st", cwd=cwd)
        assert res.returncode == EXIT_USAGE_ERROR and "--since" in res.stderr and "duration" in res.stderr, bad
    res = cli("-l", "--tail", "-1", "--state-dir", "st", cwd=cwd)
    assert res.returncode == EXIT_USAGE_ERROR and "--tail" in res.stderr
    # A name that is a subcommand is still the subcommand; COMPONENTs only follow -l.
    res = cli("trainer-1", "--state-dir", "st", cwd=cwd)
    assert res.returncode == EXIT_USAGE_ERROR and "No such command" in res.stderr
