"""Starting and stopping one component's processes, leaving no orphans.

Each component runs in its own session (so its process group id is its PID
and every helper it forks, e.g. MLflow's uvicorn workers, is in that group),
with its output appended to its log file, and with a parent-death signal so
it does not outlive a supervisor that is killed outright.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil

_PR_SET_PDEATHSIG = 1


try:  # loaded once here: the child between fork and exec must not load libraries
    _prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: delete still stops the process group
    _prctl = None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def start_process(argv: list[str], *, env: dict[str, str], log_path: Path, cwd: str | None = None) -> subprocess.Popen:
    """Start ``argv`` in a new session with stdout and stderr appended to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab", buffering=0) as log:
        return subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            preexec_fn=_die_with_parent,
            close_fds=True,
        )


def process_identity(pid: int) -> float | None:
    """The process's start time, to tell it from a later process reusing the PID (None: gone)."""
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        return p.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def is_same_process(pid: int | None, started: float | None) -> bool:
    """True if ``pid`` is alive and is the process that started at ``started``."""
    if not pid:
        return False
    now = process_identity(pid)
    return now is not None and (started is None or abs(now - started) < 0.05)


def group_members(pgid: int) -> list[psutil.Process]:
    """Live processes whose process group is ``pgid``."""
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError, psutil.AccessDenied):
            continue
    return out


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def signal_component(pid: int, sig: int) -> None:
    """Send ``sig`` to the component's process group and to any descendant that left it."""
    targets = {p.pid: p for p in _tree(pid)}
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for p in targets.values():
        try:
            p.send_signal(sig)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def stop_components(
    pids: list[int], grace: float, popen: dict[int, subprocess.Popen] | None = None
) -> dict[int, int | None]:
    """Terminate every component (SIGTERM), wait up to ``grace`` seconds, then SIGKILL what is left.

    Stops whole process groups, including helpers whose parent already exited.
    Returns pid -> exit code where known (for children of this process).
    """
    popen = popen or {}
    members: dict[int, list[psutil.Process]] = {}
    for pid in pids:
        found = {p.pid: p for p in _tree(pid)}
        found.update({p.pid: p for p in group_members(pid)})
        members[pid] = list(found.values())
        signal_component(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    everyone = [p for ps in members.values() for p in ps]
    while time.monotonic() < deadline:
        for proc in popen.values():
            proc.poll()
        if not [p for p in everyone if _alive(p)]:
            break
        time.sleep(0.05)
    for pid in pids:
        leftovers = [p for p in members[pid] if _alive(p)] + group_members(pid)
        if leftovers:
            signal_component(pid, signal.SIGKILL)
            for p in leftovers:
                try:
                    p.kill()
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
    codes: dict[int, int | None] = {}
    for pid in pids:
        proc = popen.get(pid)
        if proc is not None:
            try:
                codes[pid] = proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                codes[pid] = None
        else:
            codes[pid] = None
    # Reap helpers that were our own children (not the usual case) and wait until the others are gone.
    psutil.wait_procs([p for p in everyone if _alive(p)], timeout=2)
    return codes


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def describe_exit(code: int | None) -> str:
    if code is None:
        return "exited (code unknown)"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
