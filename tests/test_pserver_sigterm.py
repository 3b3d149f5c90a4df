"""The pserver as PID 1 of a container ends on SIGTERM (training/pserver.exit_on_sigterm), even while it
blocks in C holding the GIL as fleet.run_server() does. Needs root for the PID namespace (unshare -p)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare for a PID namespace"
)

# PID 1 of a new PID namespace, blocked in a C call that holds the GIL (ctypes.PyDLL keeps it), as run_server.
PROGRAM = """
import ctypes, os, sys
from elastic_control.training.pserver import exit_on_sigterm
assert os.getpid() == 1
installed = exit_on_sigterm() if sys.argv[1] == "on" else False
print("ready", installed, flush=True)
ctypes.PyDLL(None).pause()
"""


def _pid_one(mode: str):
    proc = subprocess.Popen(
        ["unshare", "-p", "-f", "--kill-child", sys.executable, "-c", PROGRAM, mode],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().split()[0] == "ready"
    (child,) = psutil.Process(proc.pid).children()  # PID 1 inside, seen from here
    return proc, child


def _ended_within(child: psutil.Process, seconds: float) -> bool:
    try:
        child.wait(seconds)  # not our child: psutil polls until it is gone
        return True
    except psutil.TimeoutExpired:
        return False


def test_sigterm_ends_the_pserver_process_as_pid_one():
    proc, child = _pid_one("on")
    t0 = time.monotonic()
    child.send_signal(signal.SIGTERM)
    assert _ended_within(child, 5), "PID 1 ignored SIGTERM"
    # unshare -f exits with its child's status: _exit(15), the signal's number.
    assert proc.wait(10) == signal.SIGTERM and time.monotonic() - t0 < 5


def test_without_it_pid_one_ignores_sigterm():
    # The fault the handler fixes: the default action is not taken for PID 1.
    proc, child = _pid_one("off")
    try:
        child.send_signal(signal.SIGTERM)
        assert not _ended_within(child, 1.5)
    finally:
        proc.kill()  # --kill-child takes PID 1 with it
        proc.wait(10)
