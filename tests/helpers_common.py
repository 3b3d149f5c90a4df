"""The one copy of each helper every test module shares: paths, free ports, processes, a file server, CLI runs.

Environment-dependent skips are markers declared once in ``conftest.py``
(``needs_criteo``, ``needs_root``, ``needs_redis``, ...); nothing here skips.
A product failure (an import error, a process that does not come up) raises.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
# Real Criteo Display Advertising lines (read in place, never copied into the project).
CRITEO_FILE = REPO.parent / "shared" / "data" / "criteo" / "criteo_real_distinct.txt"
CRITEO_SLOTS = list(range(1, 40))


def free_port() -> int:
    """A free loopback port below the ephemeral range (the product's rule: elastic_control/local/ports.py)."""
    from elastic_control.local.ports import free_ports

    return free_ports(1)[0]


def wait_until(predicate, timeout: float = 30.0, poll: float = 0.1, what: str = "condition"):
    """The first truthy value of ``predicate()``; AssertionError with the last value after ``timeout``."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last value {last!r})")


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout: float = 60.0, path: str = "/healthz") -> None:
    """Until ``url + path`` answers 200; RuntimeError as soon as ``proc`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} was healthy")
        with contextlib.suppress(requests.RequestException):
            if requests.get(url + path, timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy after {timeout}s")


def stop_process(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """Terminate, then kill after ``grace`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def process(
    args: list,
    env_extra: dict | None = None,
    log_path: Path | None = None,
    *,
    env: dict | None = None,
    cwd: Path | None = None,
    **popen_kwargs,
):
    """Start a real process (cwd = the repo, output to ``log_path`` or nowhere); terminate it at the end.

    ``env`` replaces the environment (default: this one), ``env_extra`` adds to it.
    """
    full_env = {**(os.environ if env is None else env), **(env_extra or {})}
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    popen_kwargs.setdefault("stdout", log)
    popen_kwargs.setdefault("stderr", subprocess.STDOUT)
    try:
        proc = subprocess.Popen([str(a) for a in args], cwd=cwd or REPO, env=full_env, **popen_kwargs)
        try:
            yield proc
        finally:
            stop_process(proc)
    finally:
        if log_path:
            log.close()


def wait_ready_file(path: Path, proc: subprocess.Popen, log_path: Path | None, deadline: float) -> dict:
    """The JSON a component writes to ``--ready-file`` once it listens (``{"port", "pid"}``)."""
    while not path.exists():
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-1500:] if log_path and log_path.exists() else ""
            raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode} before it was ready: {tail}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{proc.args[:4]} did not write {path} in time")
        time.sleep(0.05)
    return json.loads(path.read_text())


def fileserver_in_thread(root, token: str | None = "t0ken", max_bytes: int | None = None, kept_logs=None):
    """The project's real file server bound to 127.0.0.1:0 in this process; a context yielding its base URL."""
    from elastic_control.fileserver.server import DEFAULT_MAX_BYTES
    from elastic_control.fileserver.server import fileserver_in_thread as serve

    return serve(root, token=token, max_bytes=max_bytes or DEFAULT_MAX_BYTES, kept_logs=kept_logs)


def run_cli(*args, env: dict | None = None, env_extra: dict | None = None, timeout: float = 300, cwd=None, stdin=None):
    """``python -m elastic_control ARGS`` as a real process; the CompletedProcess (text, captured)."""
    full_env = {**(os.environ if env is None else env), **(env_extra or {})}
    return subprocess.run(
        [PYTHON, "-m", "elastic_control", *map(str, args)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=cwd or REPO,
        input=stdin,
    )
