"""Shared helpers for the cube tests: real and synthetic passes, and real cube processes."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow  # noqa: F401  (before anything that may import paddle)

import numpy as np

from ctr_foundation.atomic import append_line_durably
from ctr_foundation.pass_format import SparseLayout

REPO = Path(__file__).resolve().parent.parent
PYTHON = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable
TOKEN = "cube-test-token"
PADDLE_JOB = Path(__file__).with_name("helpers_cube_paddle_job.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_real_paddle_pass(pass_dir: Path, seed: int = 7, timeout: float = 240) -> Path:
    """Run one pserver + one trainer of a short real Paddle PS job that saves ``pass_dir``."""
    port = free_port()
    env = {
        **os.environ,
        "PADDLE_PSERVERS_IP_PORT_LIST": f"127.0.0.1:{port}",
        "PADDLE_TRAINERS_NUM": "1",
        "PADDLE_TRAINER_ENDPOINTS": f"127.0.0.1:{free_port()}",
        "POD_IP": "127.0.0.1",
        "PADDLE_PORT": str(port),
        "OUT": str(pass_dir),
        "SEED": str(seed),
        "GLOG_v": "0",
    }
    pass_dir.mkdir(parents=True, exist_ok=True)
    logs = pass_dir.parent / f"{pass_dir.name}.logs"
    logs.mkdir(exist_ok=True)
    with open(logs / "pserver.log", "wb") as ps_log, open(logs / "trainer.log", "wb") as tr_log:
        ps = subprocess.Popen(
            [PYTHON, str(PADDLE_JOB)], env={**env, "TRAINING_ROLE": "PSERVER"}, stdout=ps_log, stderr=subprocess.STDOUT
        )
        try:
            tr = subprocess.run(
                [PYTHON, str(PADDLE_JOB)],
                env={**env, "TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": "0"},
                stdout=tr_log,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            )
        finally:
            ps.kill()
            ps.wait()
    if tr.returncode != 0 or not (pass_dir / "meta.json").exists():
        tail = (logs / "trainer.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"the Paddle fixture run failed (rc={tr.returncode}):\n{tail}")
    return pass_dir


def write_synthetic_pass(
    pass_dir: Path,
    keys: np.ndarray,
    values: np.ndarray,
    *,
    optimizer: str = "adam",
    sparse_dim: int | None = None,
    parts: int = 2,
) -> Path:
    """A pass folder whose sparse table is in Paddle's text layout (for fast rollout tests)."""
    dim = values.shape[1]
    layout = SparseLayout(dim, optimizer)
    cols = layout.embedding_column_indices()
    table = pass_dir / "sparse" / "000"
    table.mkdir(parents=True, exist_ok=True)
    rows = np.full((len(keys), 1 + layout.value_columns), "0.5", dtype=object)
    rows[:, 0] = [str(int(k)) for k in keys]
    for j, c in enumerate(cols):
        rows[:, c] = [repr(float(v)) for v in values[:, j]]
    for p in range(parts):
        with gzip.open(table / f"part-{p:03d}.gz", "wt") as f:
            for r in rows[p::parts]:
                f.write(" ".join(r) + "\n")
    dense = pass_dir / "dense"
    dense.mkdir(exist_ok=True)
    (dense / "inference.pdmodel").write_bytes(b"model-" + pass_dir.name.encode())
    (dense / "inference.pdiparams").write_bytes(b"params-" + pass_dir.name.encode())
    meta = {
        "pass": pass_dir.name,
        "slots": [0, 1],
        "embedding_dim": dim,
        "sparse_dim": sparse_dim,
        "sparse_layout": {"accessor": "SparseAccessor", "optimizer": optimizer},
    }
    (pass_dir / "meta.json").write_text(json.dumps(meta))
    return pass_dir


def add_done(model_path: Path, name: str, t: float | None = None) -> None:
    append_line_durably(
        model_path / "donefile",
        json.dumps({"pass": name, "path": name, "window": {}, "time": time.time() if t is None else t, "metrics": {}}),
    )


@contextlib.contextmanager
def cube_processes(
    specs: list[tuple[str, list[str], str]], log_dir: Path, env_extra: dict | None = None, timeout: float = 90
):
    """Start several ``cube-<kind>`` processes at once (each with ``--ready-file``); yield [(url, Popen)]."""
    env = {**os.environ, "ELASTIC_CTR_TOKEN": TOKEN, **(env_extra or {})}
    started = []
    try:
        for kind, args, name in specs:
            ready = log_dir / f"{name}.ready.json"
            ready.unlink(missing_ok=True)
            log = open(log_dir / f"{name}.log", "ab")
            proc = subprocess.Popen(
                [PYTHON, "-m", f"cube.{kind}", *args, "--ready-file", str(ready)],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            started.append((kind, name, ready, proc, log))
        deadline = time.monotonic() + timeout
        for kind, name, ready, proc, _ in started:
            while not ready.exists():
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"cube-{kind} exited with {proc.returncode}: {(log_dir / f'{name}.log').read_text()[-1500:]}"
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(f"cube-{kind} did not get ready in {timeout}s")
                time.sleep(0.05)
        yield [(f"http://127.0.0.1:{json.loads(r.read_text())['port']}", p) for _, _, r, p, _ in started]
    finally:
        for *_, proc, _ in started:
            if proc.poll() is None:
                proc.terminate()
        for *_, proc, log in started:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()


@contextlib.contextmanager
def cube_process(
    kind: str, args: list[str], log_dir: Path, name: str, env_extra: dict | None = None, timeout: float = 90
):
    """Start one ``cube-<kind>``; yield (url, Popen); stop it at exit."""
    with cube_processes([(kind, args, name)], log_dir, env_extra, timeout) as [one]:
        yield one


def server_args(data: Path, shard: int, *, port: int = 0, workers: int = 1, extra: list[str] | None = None):
    return [
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--shard",
        str(shard),
        "--data",
        str(data),
        "--workers",
        str(workers),
        *(extra or []),
    ]


def agent_args(data: Path, shard: int, server_url: str, fileserver: str | None = None, extra: list[str] | None = None):
    args = ["--port", "0", "--host", "127.0.0.1", "--shard", str(shard), "--data", str(data), "--server", server_url]
    args += ["--timeout", "10", "--reseed-interval", "0.5"]
    return args + (["--fileserver", fileserver] if fileserver else []) + (extra or [])


def cube_server(
    data: Path, shard: int, log_dir: Path, *, workers: int = 1, extra: list[str] | None = None, name: str | None = None
):
    return cube_process(
        "server", server_args(data, shard, workers=workers, extra=extra), log_dir, name or f"server-{shard}"
    )


def cube_agent(
    data: Path, shard: int, server_url: str, log_dir: Path, name: str | None = None, fileserver: str | None = None
):
    return cube_process("agent", agent_args(data, shard, server_url, fileserver), log_dir, name or f"agent-{shard}")


def fileserver(root: Path):
    """The project's real file server, in a thread, on a free loopback port, with the cube tests' token."""
    from helpers_serving import fileserver_in_thread

    return fileserver_in_thread(root, token=TOKEN)


def real_pass_dir(tmp_path_factory) -> Path:
    """One real Paddle pass per test session, shared by the cube test modules."""
    pass_dir = tmp_path_factory.getbasetemp() / "cube-real-paddle" / "pass-20240101-00"
    if not (pass_dir / "meta.json").exists():
        make_real_paddle_pass(pass_dir)
    return pass_dir
