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
    from ctr_foundation.http_server import serve_in_thread
    from elastic_control.fileserver.server import DEFAULT_MAX_BYTES, make_fileserver

    server = make_fileserver(root=root, host="127.0.0.1", port=0, token=token, max_bytes=max_bytes or DEFAULT_MAX_BYTES)
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


CRITEO = REPO.parent / "shared" / "data" / "criteo" / "criteo_real_distinct.txt"
CRITEO_SLOTS = list(range(1, 40))


def criteo_slot_lines(start: int, count: int) -> list[str]:
    """``count`` real Criteo lines from line ``start`` on, converted to the slot format by the project's converter."""
    import itertools

    import pytest

    if not CRITEO.exists():
        pytest.skip(f"real Criteo lines not found at {CRITEO}")
    try:
        from elastic_control.data.criteo import CriteoConverter
    except ImportError as e:
        pytest.skip(f"the Criteo converter is not available: {e}")
    conv = CriteoConverter()
    with open(CRITEO, encoding="utf-8") as f:
        return [conv.convert_line(raw) for raw in itertools.islice(f, start, start + count)]


def train_criteo_pass(
    model_path: Path,
    name: str,
    *,
    seed: int,
    sparse_dim: int | None = None,
    train_lines: int = 3000,
    golden_lines: int = 300,
    offset: int = 0,
) -> Path:
    """A real pass from a short PS run (one pserver, one trainer) on real Criteo lines, recorded in the donefile.

    Uses the evaluation engineer's fixture trainer (tests/helpers_eval.py) until
    ``elastic-control train`` can be driven from tests; all 39 Criteo slots.
    """
    import json as _json

    import helpers_eval

    from ctr_foundation.atomic import append_line_durably

    lines = criteo_slot_lines(offset, train_lines + golden_lines)
    saved = helpers_eval.SLOTS
    helpers_eval.SLOTS = CRITEO_SLOTS  # train_pass reads the module's slot list
    try:
        pass_dir = helpers_eval.train_pass(
            model_path / name, lines[:train_lines], lines[train_lines:], epochs=1, seed=seed, sparse_dim=sparse_dim
        )
    finally:
        helpers_eval.SLOTS = saved
    append_line_durably(
        model_path / "donefile",
        _json.dumps(
            {
                "pass": name,
                "path": str(pass_dir),
                "window": {"start": "20200101/00", "end": "20200101/00"},
                "time": time.time(),
                "metrics": {},
            }
        ),
    )
    return pass_dir


def golden(pass_dir: Path) -> tuple[list[str], list[float]]:
    import json as _json

    rows = [_json.loads(ln) for ln in (pass_dir / "golden.jsonl").read_text().splitlines() if ln.strip()]
    return [r["line"] for r in rows], [r["prob"] for r in rows]


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
    import shutil as _shutil

    from cube.builder import build_version

    cube_root = fs_root / "cube"
    manifest = build_version(pass_dir=pass_dir, shards=shards, output=cube_root)
    version = manifest["version"]
    _shutil.copytree(pass_dir / "dense", cube_root / version / "dense")
    _shutil.copy(pass_dir / "meta.json", cube_root / version / "meta.json")
    if make_current:
        set_current(fs_root, pass_dir, version, shards)
    return version


def set_current(fs_root: Path, pass_dir: Path, version: str, shards: int) -> None:
    import json as _json

    from ctr_foundation.atomic import atomic_write_json

    meta = _json.loads((pass_dir / "meta.json").read_text())
    atomic_write_json(
        fs_root / "cube" / "current.json",
        {
            "version": version,
            "pass": version,
            "shards": shards,
            "dim": meta["embedding_dim"],
            "slots": meta["slots"],
            "sparse_dim": meta["sparse_dim"],
            "dense": f"cube/{version}/dense/",
            "activated_at": time.time(),
            "donefile_time": time.time(),
        },
    )


@contextlib.contextmanager
def cube_servers(cube_root: Path, shards: int, log_dir: Path, token: str = "t0ken"):
    """``shards`` real cube-server processes serving ``cube_root``; yields their URLs (shard order)."""
    with contextlib.ExitStack() as stack:
        urls = []
        for i in range(shards):
            port = free_port()
            proc = stack.enter_context(
                process(
                    [
                        PYTHON,
                        "-c",
                        "from cube.server import main; main()",
                        "--port",
                        str(port),
                        "--shard",
                        str(i),
                        "--data",
                        str(cube_root),
                        "--host",
                        "127.0.0.1",
                    ],
                    env_extra={"ELASTIC_CTR_TOKEN": token},
                    log_path=log_dir / f"cube-{i}.log",
                )
            )
            urls.append((f"http://127.0.0.1:{port}", proc))
        for url, proc in urls:
            wait_healthy(url, proc)
        yield [u for u, _ in urls]


def switch_cube_version(urls: list[str], version: str, token: str = "t0ken") -> None:
    """Two-phase: load ``version`` on every shard, then activate it on every shard (cube-transfer's job)."""
    headers = {"Authorization": f"Bearer {token}"}
    for step in ("load", "activate"):
        for url in urls:
            r = requests.post(f"{url}/v1/{step}", json={"version": version}, headers=headers, timeout=60)
            assert r.status_code == 200, (step, url, r.text)
