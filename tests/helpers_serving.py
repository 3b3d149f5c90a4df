"""Helpers for the file-server, client and serving tests: real servers in-process or as processes.

Passes come from the product trainer (the session fixtures in conftest.py);
generic helpers (free ports, processes, the file server in a thread) are in
helpers_common.py.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import time
from pathlib import Path

import requests
from helpers_common import PYTHON, REPO, fileserver_in_thread, free_port, process, wait_healthy
from helpers_cube import cube_processes, server_args
from helpers_passes import criteo_slot_lines

from ctr_foundation.records import GOLDEN_FILE, CurrentVersion, read_golden, utc_now, write_current

# PYTHON, REPO, free_port, process, wait_healthy, fileserver_in_thread and criteo_slot_lines are re-exported
# (their one definition is in helpers_common / helpers_passes).
__all__ = [
    "PYTHON",
    "REPO",
    "SERVING_TOKEN",
    "criteo_slot_lines",
    "cube_servers",
    "fileserver_in_thread",
    "free_port",
    "golden",
    "process",
    "publish_version",
    "raw_request",
    "serving_in_thread",
    "set_current",
    "status_of",
    "switch_cube_version",
    "wait_healthy",
]

SERVING_TOKEN = "t0ken"


def golden(pass_dir: Path) -> tuple[list[str], list[float]]:
    """(lines, probabilities) of a pass's golden.jsonl, read by records.py (the format's owner)."""
    return read_golden(Path(pass_dir) / GOLDEN_FILE)


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


@contextlib.contextmanager
def serving_in_thread(source, wait_ready: bool = True, **kwargs):
    """A real serving HTTP server on 127.0.0.1:0 in this process.

    Ready (first version loaded) unless told not to wait.
    """
    from elastic_control.serving.app import ServingApp
    from elastic_control.serving.http_server import ServingServer

    app = ServingApp(source, poll_interval=kwargs.pop("poll_interval", 0.2), **kwargs)
    server = ServingServer(app, host="127.0.0.1", port=0).start_in_thread()
    try:
        deadline = time.monotonic() + 60
        while wait_ready and app.active is None and time.monotonic() < deadline:
            time.sleep(0.05)
        yield server
    finally:
        server.stop()


def publish_version(fs_root: Path, pass_dir: Path, shards: int, *, make_current: bool = True) -> str:
    """What cube-transfer does, done directly: build shards, copy dense + meta, record current.json."""
    from cube.builder import build_version

    cube_root = fs_root / "cube"
    manifest = build_version(pass_dir=pass_dir, shards=shards, output=cube_root)
    version = manifest["version"]
    shutil.copytree(pass_dir / "dense", cube_root / version / "dense")
    shutil.copy(pass_dir / "meta.json", cube_root / version / "meta.json")
    if make_current:
        set_current(fs_root, pass_dir, version, shards)
    return version


def set_current(fs_root: Path, pass_dir: Path, version: str, shards: int) -> None:
    """Record ``version`` as the active one in FS_ROOT/cube/current.json (the record records.py owns)."""
    from ctr_foundation.pass_format import load_pass

    info = load_pass(pass_dir)
    write_current(
        fs_root / "cube",
        CurrentVersion(
            version=version,
            pass_name=version,
            shards=shards,
            dim=info.embedding_dim,
            slots=tuple(info.slots),
            sparse_dim=info.sparse_dim,
            dense=f"cube/{version}/dense/",
            activated_at=utc_now(),
            donefile_time=utc_now(),
        ),
    )


@contextlib.contextmanager
def cube_servers(cube_root: Path, shards: int, log_dir: Path, token: str = SERVING_TOKEN):
    """``shards`` real cube-server processes serving ``cube_root``; yields their URLs (shard order)."""
    specs = [("server", server_args(cube_root, i), f"cube-{i}") for i in range(shards)]
    with cube_processes(specs, log_dir, env_extra={"ELASTIC_CTR_TOKEN": token}) as started:
        for url, proc in started:
            wait_healthy(url, proc)
        yield [url for url, _ in started]


def switch_cube_version(urls: list[str], version: str, token: str = SERVING_TOKEN) -> None:
    """Two-phase: load ``version`` on every shard, then activate it on every shard (cube-transfer's job)."""
    headers = {"Authorization": f"Bearer {token}"}
    for step in ("load", "activate"):
        for url in urls:
            r = requests.post(f"{url}/v1/{step}", json={"version": version}, headers=headers, timeout=60)
            assert r.status_code == 200, (step, url, r.text)
