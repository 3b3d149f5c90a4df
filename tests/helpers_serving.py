"""Helpers for the file-server, client and serving tests: real servers on free loopback ports."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def fileserver_in_thread(root, token: str | None = "t0ken", max_bytes: int | None = None):
    """A real file server bound to 127.0.0.1:0 in this process; yields its base URL."""
    from elastic_control.fileserver.server import DEFAULT_MAX_BYTES, make_fileserver, serve_in_thread

    server = make_fileserver(root=root, host="127.0.0.1", port=0, token=token,
                             max_bytes=max_bytes or DEFAULT_MAX_BYTES)
    serve_in_thread(server)
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} was healthy")
        with contextlib.suppress(requests.RequestException):
            if requests.get(url + "/healthz", timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy after {timeout}s")


@contextlib.contextmanager
def process(args: list[str], env_extra: dict | None = None, log_path: Path | None = None):
    """Start a real process (cwd = the repo); terminate it at the end."""
    env = {**os.environ, **(env_extra or {})}
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if log_path:
            log.close()


def raw_request(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send raw bytes (paths exactly as written, no client-side normalisation); return the reply."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while True:
            try:
                piece = s.recv(65536)
            except ConnectionResetError:
                break
            if not piece:
                break
            chunks.append(piece)
    return b"".join(chunks)


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])
