"""ctr_foundation/log_keeper.py: the keeper stays the main process, the command runs in its child; every byte
of the command's stdout and stderr reaches both the keeper's stdout and the kept file, also the last ones
before a SIGKILL; exit codes pass through (128+N for a signal), SIGTERM reaches the command."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)


def _script(tmp_path: Path, body: str, *, max_bytes: int | None = None) -> list[str]:
    cap = f"log_keeper.MAX_FILE_BYTES = {max_bytes}\n" if max_bytes else ""
    code = (
        "import os, signal, sys, time\n"
        "from ctr_foundation import log_keeper\n"
        f"{cap}"
        f"log_keeper.keep_logs({str(tmp_path / 'kept')!r}, 'job-trainer-0', 'trainer')\n" + textwrap.dedent(body)
    )
    return [sys.executable, "-c", code]


def _kept(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "kept" / "job-trainer-0").glob("*-trainer.log*"))


def test_output_reaches_stdout_and_the_kept_file_and_the_exit_code_passes_through(tmp_path):
    body = """
    print("to stdout", flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    os.write(2, b"straight to fd 2, as Paddle's C++ writes\\n")
    sys.exit(3)
    """
    proc = subprocess.run(_script(tmp_path, body), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 3
    for line in ("to stdout", "to stderr", "straight to fd 2, as Paddle's C++ writes"):
        assert line in proc.stdout  # the kubelet's log: everything on the container's stdout
    (kept,) = _kept(tmp_path)
    assert kept.read_text() == proc.stdout
    assert kept.name.endswith("-trainer.log") and len(kept.name) == len("20261206T101010Z-trainer.log")


def test_the_last_lines_before_a_sigkill_are_kept_and_the_exit_code_is_137(tmp_path):
    body = """
    for i in range(2000):
        print(f"step {i}", flush=True)
    print("MemoryError: the last line before the kill", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
    proc = subprocess.run(_script(tmp_path, body), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 137  # as the kubelet reports a container the OOM killer ended
    (kept,) = _kept(tmp_path)
    assert kept.read_text().splitlines()[-1] == "MemoryError: the last line before the kill"
    assert len(kept.read_text().splitlines()) == 2001


def test_sigterm_to_the_keeper_ends_the_command_with_its_default_action(tmp_path):
    body = """
    print("ready", flush=True)
    time.sleep(60)
    """
    proc = subprocess.Popen(_script(tmp_path, body), stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 128 + signal.SIGTERM
    assert time.monotonic() - started < 5


def test_the_command_dies_with_a_killed_keeper(tmp_path):
    body = """
    print(os.getpid(), flush=True)
    time.sleep(60)
    """
    proc = subprocess.Popen(_script(tmp_path, body), stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    assert child != proc.pid
    proc.kill()
    proc.wait(timeout=10)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{child}/stat") as f:  # a zombie of init's is gone as far as work goes
            if f.read().split(") ")[1].startswith("Z"):
                return
        time.sleep(0.05)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the command outlived its killed keeper")


def test_a_large_log_rolls_to_one_older_part(tmp_path):
    body = """
    for i in range(300):
        print(f"line {i:04d} " + "x" * 90, flush=True)
    """
    proc = subprocess.run(_script(tmp_path, body, max_bytes=10_000), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0
    current, older = _kept(tmp_path)
    assert older.name == current.name + ".1"
    assert len(current.read_bytes()) <= 10_000 and len(older.read_bytes()) <= 10_000
    assert current.read_text().splitlines()[-1].startswith("line 0299 ")
    assert proc.stdout.count("\n") == 300  # the kubelet's copy is whole


def test_an_unwritable_folder_is_said_and_the_command_runs_unkept(tmp_path):
    (tmp_path / "kept").write_text("a file where the folder should be")
    body = """
    print("still runs", flush=True)
    """
    proc = subprocess.run(_script(tmp_path, body), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and proc.stdout == "still runs\n"
    assert "trainer: cannot keep a copy of this log in" in proc.stderr and "going on without" in proc.stderr
