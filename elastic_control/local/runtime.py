"""The supervisor's live record (local/runtime.json) and the lock that makes it the only one.

The supervisor rewrites runtime.json atomically whenever something changes
and at least every few seconds (``heartbeat``); every other command only
reads it, and trusts a PID only if that process still has the recorded start
time (PIDs are reused).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from dataclasses import dataclass

from ctr_foundation.atomic import atomic_write_json
from ctr_foundation.names import StateFolder
from elastic_control.local.process import is_same_process

RUNTIME_FORMAT = 1

# Supervisor states.
STARTING = "starting"  # services coming up
RUNNING = "running"  # everything started (training may still be running or done)
STOPPING = "stopping"
STOPPED = "stopped"
FAILED = "failed"  # could not start; everything it started was stopped

# Component states.
C_WAITING = "waiting"  # for the components it depends on
C_STARTING = "starting"  # started, not ready yet
C_RUNNING = "running"
C_BACKOFF = "backoff"  # exited, restart scheduled
C_COMPLETED = "completed"  # a job member that finished its work
C_FAILED = "failed"
C_STOPPED = "stopped"

# Training job states.
J_PENDING = "pending"
J_RUNNING = "running"
J_RESTARTING = "restarting"
J_COMPLETED = "completed"
J_FAILED = "failed"


def write_runtime(layout: StateFolder, record: dict) -> None:
    record = dict(record, format=RUNTIME_FORMAT, written_at=time.time())
    atomic_write_json(layout.runtime_file, record)


def read_runtime(layout: StateFolder) -> dict | None:
    """The last record the supervisor wrote, or None if it never ran here."""
    try:
        record = json.loads(layout.runtime_file.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError:
        return None  # cannot happen with atomic writes, but never crash a status command
    if record.get("format") != RUNTIME_FORMAT:
        return {"format": record.get("format"), "state": "unknown", "components": {}, "foreign_format": True}
    return record


@dataclass(frozen=True)
class SupervisorInfo:
    record: dict | None
    alive: bool

    @property
    def pid(self) -> int | None:
        return (self.record or {}).get("supervisor", {}).get("pid")


def supervisor_info(layout: StateFolder) -> SupervisorInfo:
    record = read_runtime(layout)
    if not record:
        return SupervisorInfo(None, False)
    sup = record.get("supervisor") or {}
    alive = is_same_process(sup.get("pid"), sup.get("started")) and lock_is_held(layout)
    return SupervisorInfo(record, alive)


def lock_is_held(layout: StateFolder) -> bool:
    """True if some process holds the supervisor lock (i.e. a supervisor runs on this state folder)."""
    if not layout.lock_file.exists():
        return False
    fd = os.open(layout.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


class SupervisorLock:
    """An exclusive flock held for the supervisor's lifetime; released by the kernel when it dies."""

    def __init__(self, layout: StateFolder):
        self.path = layout.lock_file
        self.fd: int | None = None

    def acquire(self) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return True

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
