"""Bad input on the command line: exit 2 (usage) or 1 (failure), one line naming the problem, no traceback,
and the state folder is either absent or exactly as before."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from elastic_control.cli import main

REPO = Path(__file__).resolve().parents[1]
GOOD = ["-s", "examples/slot.conf", "-f", "examples/data.config", "--backend", "k8s"]


@pytest.fixture()
def in_repo(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("ELASTIC_CTR_STATE_DIR", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))
    return tmp_path


def _files(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _run(args, capfd):
    with pytest.raises(SystemExit) as info:
        main(args)
    out, err = capfd.readouterr()
    return info.value.code, out, err


def _snapshot(folder: Path) -> dict:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


CASES = [
    (["-r", "-t", "abc"], 2, r"Invalid value for '-t' / '--trainer': 'abc' is not a valid integer"),
    (["-r", "-u", "4.5"], 2, r"Invalid value for '-u' / '--cpu': '4.5' is not a valid integer"),
    (["-r", "-t", "0"], 2, r"-t/--trainer 0 is out of range: trainers must be between 1 and 512"),
    (
        ["-r", "-m", "2000"],
        2,
        r"-m/--mem 2000 is out of range: GiB of memory per trainer/pserver pod must be "
        r"between 1 and 1024",
    ),
    (["-r", "-b", "-3"], 2, r"-b/--cube -3 is out of range"),
    (["-r", "--bogus"], 2, r"No such option '--bogus'"),
    (["-r", "-x"], 2, r"No such option '-x'"),
    (["-r", "--backend", "cloud"], 2, r"Invalid value for '--backend': 'cloud' is not one of"),
    (["-r", "--namespace", "Bad_NS"], 2, r"--namespace 'Bad_NS' is not a valid namespace name"),
    (["-r", "--job-name", "9lives"], 2, r"job name '9lives' must start with a letter"),
    (["-a"], 2, r"no plan in .*: run `elastic-control -r \.\.\.` first to configure resources"),
    (["-l"], 2, r"no plan in .*: run `elastic-control -r \.\.\.` first"),
    (["-c"], 2, r"no plan in .*: run `elastic-control -r \.\.\.` first"),
]


@pytest.mark.parametrize("args, code, message", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_flags(in_repo, capfd, args, code, message):
    state = in_repo / "state"
    extra = GOOD if args[0] == "-r" else []
    rc, out, err = _run([*extra, *args, "--state-dir", str(state)], capfd)
    assert rc == code
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("elastic-control: error: "), err
    assert __import__("re").search(message, lines[0]), lines[0]
    assert "Traceback" not in out + err
    assert not state.exists()


def _config_cases(tmp_path):
    good_data = (REPO / "examples" / "data.config").read_text()
    return [
        (
            ["-s", str(tmp_path / "missing.conf")],
            r"missing.conf: file not found \(pass the slot list with -s/--slot_conf\)",
        ),
        (["-s", _files(tmp_path, "empty.conf", "")], r"empty.conf: no slots listed"),
        (["-s", _files(tmp_path, "words.conf", "1\nclick\n")], r"words.conf:2: slot id 'click' is not an integer"),
        (["-f", str(tmp_path / "nope.config")], r"nope.config: file not found"),
        (
            ["-f", _files(tmp_path, "syntax.config", good_data + 'export ONLINE="1\n')],
            r"syntax.config:\d+: unterminated double quote",
        ),
        (
            ["-f", _files(tmp_path, "date.config", good_data.replace("20191221/01", "2019-12-21T01"))],
            r"date.config:\d+: END_DATE_HR='2019-12-21T01' is not a date and hour in the format YYYYMMDD/HH",
        ),
    ]


@pytest.mark.parametrize("case", range(6))
def test_bad_config_files_leave_no_state_folder(in_repo, capfd, case):
    override, message = _config_cases(in_repo)[case]
    state = in_repo / "state"
    args = [
        "-r",
        "-s",
        "examples/slot.conf",
        "-f",
        "examples/data.config",
        *override,
        "--backend",
        "k8s",
        "--state-dir",
        str(state),
    ]
    rc, out, err = _run(args, capfd)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and __import__("re").search(message, lines[0]), err
    assert not state.exists()


def test_a_failed_render_leaves_the_previous_state_untouched(in_repo, capfd):
    state = in_repo / "state"
    assert _run(["-r", *GOOD, "--state-dir", str(state)], capfd)[0] == 0
    before = _snapshot(state)
    rc, _, err = _run(
        ["-r", *GOOD, "-s", _files(in_repo, "empty.conf", "# nothing\n"), "--state-dir", str(state)], capfd
    )
    assert rc == 2 and "no slots listed" in err
    assert _snapshot(state) == before
    assert not [p for p in state.iterdir() if p.name.startswith(".")]  # no staging leftovers


@pytest.mark.e2e
@pytest.mark.parametrize(
    "args, message",
    [
        (["-r", "-t", "two", *GOOD], "Invalid value for '-t' / '--trainer': 'two' is not a valid integer"),
        (["-a"], "first to configure resources"),
    ],
)
def test_bad_input_through_the_bash_shim(tmp_path, args, message):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_CTR_")}
    env.update(ELASTIC_CTR_STATE_DIR=str(tmp_path / "state"), KUBECONFIG=str(tmp_path / "none"))
    proc = subprocess.run(
        ["bash", "elastic-control.sh", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "state").exists()
