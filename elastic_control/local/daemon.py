"""Starting the supervisor so that it outlives the command (and terminal) that started it.

Classic double fork: the CLI forks a child that calls setsid() (a new session,
no controlling terminal), which forks the supervisor and exits at once, so the
supervisor is adopted by init and never becomes a zombie of the CLI. The
supervisor then execs ``python -m elastic_control supervise``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ctr_foundation.names import StateFolder


def rotate_logs(layout: StateFolder) -> None:
    """Keep the previous run's logs as NAME.log.1 so -l shows only this run."""
    if not layout.logs_dir.is_dir():
        return
    for log in layout.logs_dir.glob("*.log"):
        os.replace(log, log.with_name(log.name + ".1"))


def spawn_supervisor(layout: StateFolder, *, python: str | None = None) -> int:
    """Start the detached supervisor on ``layout``; return its PID."""
    python = python or sys.executable
    argv = [python, "-m", "elastic_control", "supervise", "--state-dir", str(layout.state)]
    layout.logs_dir.mkdir(parents=True, exist_ok=True)
    log_path = str(layout.supervisor_log)
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the forked child, reported through the pipe
        try:
            os.close(read_end)
            os.setsid()
            grandchild = os.fork()
            if grandchild:
                os.write(write_end, str(grandchild).encode())
                os._exit(0)
            os.close(write_end)
            devnull = os.open(os.devnull, os.O_RDONLY)
            log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(devnull, 0)
            os.dup2(log_fd, 1)
            os.dup2(log_fd, 2)
            os.chdir(layout.state)  # stray files of any component land in the state folder
            os.execv(python, argv)
        except BaseException:  # noqa: BLE001 - the forked child must never return into the parent's code
            os._exit(127)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as r:
        data = r.read()
    os.waitpid(child, 0)
    if not data:
        raise OSError("could not start the supervisor process (fork failed)")
    return int(data.decode())


def tail_lines(path: Path, count: int = 20) -> list[str]:
    """The last ``count`` lines of a text file (empty if it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            block = min(size, 64 * 1024)
            f.seek(size - block)
            data = f.read()
    except FileNotFoundError:
        return []
    lines = data.decode("utf-8", "replace").splitlines()
    return lines[-count:]
