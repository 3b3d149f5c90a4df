"""A copy of a process's output kept on a volume that outlives its pod.

Kubernetes keeps a container's log only while its pod exists (and the one
instance before its last restart): when Volcano restarts the training job, or a
node is drained, the failed pod's log, the one that says why, goes with the
pod. ``keep_logs(DIR, pod, container)`` forks first thing: the parent stays the
container's main process (PID 1) and becomes the keeper, the child runs the
command with stdout and stderr on a pipe. The keeper writes every byte both to
its own stdout (what the kubelet logs, unchanged) and to
``DIR/POD/STAMP-CONTAINER.log`` (STAMP: the UTC second it started, so one pod
name's instances sort in time), forwards signals to the child, and exits with
the child's exit code (128+N when signal N ended it: 137 for the OOM killer).

The keeper is the parent, not a tee child, because the kernel kills every other
process of a PID namespace the moment its PID 1 exits: a tee child would lose
the last lines, the traceback that matters most. The child dies with the keeper
(PR_SET_PDEATHSIG), so a SIGKILL of the container leaves no orphan either.
A file grows to MAX_FILE_BYTES, then moves to ``.1`` (the one older part kept).
"""

from __future__ import annotations

import ctypes
import datetime as dt
import os
import re
import select
import signal
import sys
import time
from pathlib import Path

MAX_FILE_BYTES = 16 << 20
# Signals a container's main process gets from the kubelet or a person, passed on to the command.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
# After the command exited, its own children may still hold the pipe: drain this long, not forever.
DRAIN_AFTER_EXIT = 2.0
_PR_SET_PDEATHSIG = 1


STAMP_FORMAT = "%Y%m%dT%H%M%SZ"  # the UTC second a keeper started: what -l compares with a container's start


def stamp(when: float | None = None) -> str:
    return time.strftime(STAMP_FORMAT, time.gmtime(when))


def kept_log_path(root: str | os.PathLike, pod: str, container: str, when: float | None = None) -> Path:
    return Path(root, pod, f"{stamp(when)}-{container}.log")


_KEPT_NAME = re.compile(r"(?P<stamp>\d{8}T\d{6}Z)-(?P<container>[a-z0-9-]+)\.log(?:\.1)?")


def parse_kept_log_name(name: str) -> tuple[dt.datetime, str] | None:
    """(when its keeper started, UTC; container) of a kept log's file name (``.1``: its older part); None for
    any other name."""
    m = _KEPT_NAME.fullmatch(name)
    if m is None:
        return None
    return dt.datetime.strptime(m["stamp"], STAMP_FORMAT).replace(tzinfo=dt.timezone.utc), m["container"]


def keep_logs(root: str | os.PathLike, pod: str, container: str) -> None:
    """Return in the child that runs the command (its output kept under ``root``); the parent never returns.

    If the folder cannot be written, say so and return without forking: the log is the kubelet's alone."""
    path = kept_log_path(root, pod, container)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        out = open(path, "ab", buffering=0)  # noqa: SIM115 - the keeper owns it until it exits
    except OSError as e:
        print(f"{container}: cannot keep a copy of this log in {path}: {e}; going on without", file=sys.stderr)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    keeper = os.getpid()
    child = os.fork()
    if child == 0:
        out.close()
        os.close(read_end)
        os.dup2(write_end, 1)
        os.dup2(write_end, 2)
        os.close(write_end)
        _die_with(keeper)
        for sig in FORWARDED:  # the keeper may have had PID 1's handlers; the command gets the defaults
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        return
    os.close(write_end)
    code = 1
    try:
        code = _keep(child, read_end, _RollingFile(out, path))
    finally:
        os._exit(code)  # never back into the caller's stack: that is the child's


def _die_with(parent: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the keeper died before the line above: nobody would keep this output
        os._exit(1)


class _RollingFile:
    def __init__(self, out, path: Path):
        self.out, self.path, self.size, self.broken = out, path, os.fstat(out.fileno()).st_size, False

    def write(self, data: bytes) -> None:
        if self.broken:
            return
        try:
            while data:
                if self.size >= MAX_FILE_BYTES:
                    self.out.close()
                    os.replace(self.path, self.path.with_name(self.path.name + ".1"))
                    self.out, self.size = open(self.path, "ab", buffering=0), 0  # noqa: SIM115
                piece, data = data[: MAX_FILE_BYTES - self.size], data[MAX_FILE_BYTES - self.size :]
                self.out.write(piece)
                self.size += len(piece)
        except OSError as e:  # a full claim must not take the command's output down with it
            self.broken = True
            _write_all(2, f"log keeper: stopped copying the log to {self.path}: {e}\n".encode())


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except OSError:
            return  # nobody reads our stdout any more: the copy on the volume still gets everything


def _keep(child: int, fd: int, copy: _RollingFile) -> int:
    def forward(sig, _frame):
        try:
            os.kill(child, sig)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    status, drain_until = None, None
    while True:
        if status is None:
            done, st = os.waitpid(child, os.WNOHANG)
            if done:
                status, drain_until = st, time.monotonic() + DRAIN_AFTER_EXIT
        wait = 0.5 if drain_until is None else max(0.0, drain_until - time.monotonic())
        ready, _, _ = select.select([fd], [], [], wait)
        if ready:
            data = os.read(fd, 1 << 16)
            if not data:  # every writer is gone
                break
            _write_all(1, data)
            copy.write(data)
        elif drain_until is not None and time.monotonic() >= drain_until:
            break
    if status is None:
        _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code
