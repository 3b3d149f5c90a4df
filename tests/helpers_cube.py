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


def agent_args(
    data: Path,
    shard: int,
    server_url: str,
    fileserver: str | None = None,
    extra: list[str] | None = None,
    port: int = 0,
):
    args = ["--port", str(port), "--host", "127.0.0.1", "--shard", str(shard), "--data", str(data)]
    args += ["--server", server_url]
    args += ["--timeout", "10", "--reseed-interval", "0.5"]
    return args + (["--fileserver", fileserver] if fileserver else []) + (extra or [])


def cube_server(
    data: Path, shard: int, log_dir: Path, *, workers: int = 1, extra: list[str] | None = None, name: str | None = None
):
    return cube_process(
        "server", server_args(data, shard, workers=workers, extra=extra), log_dir, name or f"server-{shard}"
    )


def shard_specs(root: Path, shards: int, fileserver_url: str, *, workers=(1,)) -> list[tuple[str, list[str], str]]:
    """``cube_processes`` specs of ``shards`` server + agent pairs, data in ``root/shard-I``, in the order server-0,
    agent-0, server-1, ...: the servers' ports are probed here, since all start at once and each agent must know
    its server's address up front. ``workers[I]`` (default 1) sets server I's workers."""
    ports = [free_port() for _ in range(shards)]
    specs = []
    for i in range(shards):
        data = root / f"shard-{i}"
        data.mkdir()
        n = workers[i] if i < len(workers) else 1
        specs.append(("server", server_args(data, i, port=ports[i], workers=n), f"server-{i}"))
        specs.append(("agent", agent_args(data, i, f"http://127.0.0.1:{ports[i]}", fileserver_url), f"agent-{i}"))
    return specs


def cube_agent(
    data: Path, shard: int, server_url: str, log_dir: Path, name: str | None = None, fileserver: str | None = None
):
    return cube_process("agent", agent_args(data, shard, server_url, fileserver), log_dir, name or f"agent-{shard}")


def fileserver(root: Path):
    """The project's real file server, in a thread, on a free loopback port, with the cube tests' token."""
    return fileserver_in_thread(root, token=TOKEN)


def real_pass_dir(tmp_path_factory) -> Path:
    """A pass `elastic-control train` wrote (the session's ``synth_world``; prefer that fixture)."""
    from helpers_passes import session_synth_world

    return session_synth_world(tmp_path_factory).passes[0]


class DeltaPasses:
    """A real saved pass as the base, and delta passes derived from it in the layout of docs/contracts.md
    ("Delta passes"), each with the full table it amounts to (``expected()``).

    The changed lines are the real table's lines (all 34 columns of the SparseAccessor/Adam layout) with
    new embedding values; added keys copy a real line under a new key; deleted keys are listed one per
    line in ``deleted/part-*`` (keys above 2**63 written as their int64 text, as Paddle prints them).
    """

    def __init__(self, real_pass: Path, model_path: Path, base_name: str):
        from ctr_foundation.pass_format import load_pass, sparse_part_files

        self.model_path = model_path
        info = load_pass(real_pass)
        self.layout = info.layout
        self.cols = list(self.layout.embedding_column_indices())
        self.lines: dict[int, list[str]] = {}
        for part in sparse_part_files(real_pass):
            opener = gzip.open if part.name.endswith(".gz") else open
            with opener(part, "rt") as f:
                for line in f:
                    toks = line.split()
                    if toks:
                        self.lines[int(toks[0]) % 2**64] = toks
        base = model_path / base_name
        import shutil

        shutil.copytree(real_pass, base)
        meta = {**info.meta, "pass": base_name, "kind": "base", "parent": None}
        (base / "meta.json").write_text(json.dumps(meta))
        self.meta = meta
        self.names = [base_name]
        self.gone: set[int] = set()  # keys deleted by some delta
        add_done(model_path, base_name)

    def delta(
        self, name: str, *, change: int, add: int, delete: int, seed: int, readd: int = 0, done: bool = True
    ) -> Path:
        """Write delta pass ``name`` on the last pass: ``change`` keys get new values, ``add`` new keys (and
        ``readd`` keys deleted earlier) appear, ``delete`` keys go."""
        rng = np.random.default_rng(seed)
        keys = np.array(sorted(self.lines), dtype=np.uint64)
        pick = rng.permutation(len(keys))
        changed, deleted = keys[pick[:change]], keys[pick[change : change + delete]]
        # Keys as the trainer writes them: below sparse_dim when the pass has one (the builder folds the rest).
        high = int(self.meta.get("sparse_dim") or 2**64 - 1)
        added = rng.integers(1, high, add, dtype=np.uint64)
        added = added[~np.isin(added, keys)]
        back = sorted(self.gone - set(self.lines))[:readd]
        added = np.concatenate([added, np.array(back, dtype=np.uint64)])
        self.gone.update(int(k) for k in deleted)
        out_lines = []
        for k in [*changed, *added]:
            k = int(k)
            toks = list(self.lines.get(k) or self.lines[int(keys[rng.integers(len(keys))])])
            toks[0] = str(k)
            for c in self.cols:
                toks[c] = repr(float(np.float32(rng.standard_normal())))
            self.lines[k] = toks
            out_lines.append(" ".join(toks))
        for k in deleted:
            del self.lines[int(k)]
        folder = self.model_path / name
        (folder / "sparse" / "000").mkdir(parents=True)
        with gzip.open(folder / "sparse" / "000" / "part-000-00000.gz", "wt") as f:
            f.write("".join(line + "\n" for line in rng.permutation(out_lines)))
        (folder / "deleted").mkdir()
        text = [str(int(np.uint64(k).view(np.int64))) if int(k) >= 2**63 else str(int(k)) for k in deleted]
        (folder / "deleted" / "part-00000").write_text("".join(t + "\n" for t in text))
        dense = self.model_path / self.names[0] / "dense"
        if dense.is_dir():
            import shutil

            shutil.copytree(dense, folder / "dense")
        meta = {**self.meta, "pass": name, "kind": "delta", "parent": self.names[-1]}
        (folder / "meta.json").write_text(json.dumps(meta))
        self.names.append(name)
        if done:
            add_done(self.model_path, name)
        return folder

    def expected(self) -> tuple[np.ndarray, np.ndarray]:
        """(sorted keys, values) of the full table after every pass so far."""
        keys = np.array(sorted(self.lines), dtype=np.uint64)
        values = np.array([[float(self.lines[int(k)][c]) for c in self.cols] for k in keys], dtype=np.float32)
        return keys, values
