"""Shared helpers for the cube tests: synthetic passes (for fast rollout tests) and real cube processes.

Real passes come from the product trainer: the ``synth_world`` fixture (conftest.py).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import time
from pathlib import Path

import pyarrow  # noqa: F401  (before anything that may import paddle)

import numpy as np
from helpers_common import PYTHON, REPO, fileserver_in_thread, free_port, process, wait_ready_file

from ctr_foundation.pass_format import SparseLayout
from ctr_foundation.records import DonefileEntry, append_donefile, utc_now

TOKEN = "cube-test-token"
# PYTHON, REPO and free_port are re-exported (their one definition is in helpers_common).
__all__ = [
    "PYTHON",
    "REPO",
    "TOKEN",
    "add_done",
    "agent_args",
    "cube_agent",
    "cube_process",
    "cube_processes",
    "cube_server",
    "fileserver",
    "free_port",
    "real_pass_dir",
    "server_args",
    "write_synthetic_pass",
]


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
    """Record pass ``name`` as complete in MODEL_PATH/donefile (the trainer's record, written by records.py)."""
    import datetime as dt

    when = utc_now() if t is None else dt.datetime.fromtimestamp(t, dt.timezone.utc)
    append_donefile(model_path, DonefileEntry(pass_name=name, path=name, window={}, time=when))


@contextlib.contextmanager
def cube_processes(
    specs: list[tuple[str, list[str], str]], log_dir: Path, env_extra: dict | None = None, timeout: float = 90
):
    """Start several ``cube-<kind>`` processes at once (each with ``--ready-file``); yield [(url, Popen)]."""
    env_extra = {"ELASTIC_CTR_TOKEN": TOKEN, **(env_extra or {})}
    with contextlib.ExitStack() as stack:
        started = []
        for kind, args, name in specs:
            ready = log_dir / f"{name}.ready.json"
            ready.unlink(missing_ok=True)
            log = log_dir / f"{name}.log"
            argv = [PYTHON, "-m", f"cube.{kind}", *args, "--ready-file", ready]
            started.append((ready, log, stack.enter_context(process(argv, env_extra, log))))
        deadline = time.monotonic() + timeout
        urls = [f"http://127.0.0.1:{wait_ready_file(r, p, log, deadline)['port']}" for r, log, p in started]
        yield [(url, p) for url, (_, _, p) in zip(urls, started, strict=True)]


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


def agent_args(data: Path, shard: int, server_url: str):
    return [
        "--port",
        "0",
        "--host",
        "127.0.0.1",
        "--shard",
        str(shard),
        "--data",
        str(data),
        "--server",
        server_url,
        "--timeout",
        "10",
    ]


def cube_server(
    data: Path, shard: int, log_dir: Path, *, workers: int = 1, extra: list[str] | None = None, name: str | None = None
):
    return cube_process(
        "server", server_args(data, shard, workers=workers, extra=extra), log_dir, name or f"server-{shard}"
    )


def cube_agent(data: Path, shard: int, server_url: str, log_dir: Path, name: str | None = None):
    return cube_process("agent", agent_args(data, shard, server_url), log_dir, name or f"agent-{shard}")


def fileserver(root: Path):
    """The project's real file server, in a thread, on a free loopback port, with the cube tests' token."""
    return fileserver_in_thread(root, token=TOKEN)


def real_pass_dir(tmp_path_factory) -> Path:
    """A pass `elastic-control train` wrote (the session's ``synth_world``; prefer that fixture)."""
    from helpers_passes import session_synth_world

    return session_synth_world(tmp_path_factory).passes[0]
