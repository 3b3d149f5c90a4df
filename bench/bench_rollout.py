"""Rollout time, full rebuild vs delta: from a pass's donefile line to every cube shard serving it.

    .venv/bin/python bench/bench_rollout.py            # 10M keys, 2 shards, a delta touching 1% of them
    .venv/bin/python bench/bench_rollout.py --quick    # 1M keys

Real processes on loopback: the project's file server, N cube-server + cube-agent
pairs and cube-transfer (``--poll-interval 0.2``, no gate, no compaction), fed
passes written in the product trainer's text layout (SparseAccessor, sparse Adam,
embedding dim 9: 37 columns per line, plain text parts) and the delta-pass layout of
docs/contracts.md. Three passes:

1. a base pass (10M keys) rolled out to empty shards (warm-up: builds, ships and
   loads everything);
2. a second base pass (the same 10M-key table under a new name): the FULL REBUILD
   measured: parse + shard + sort + write the whole table, publish it, every shard
   downloads and loads its whole shard;
3. a delta pass on pass 2 touching 1% of the keys (0.8% changed, 0.1% new, 0.1%
   deleted): the DELTA measured: build the delta version, publish it, every shard
   downloads its part of the delta and lays it over the version it serves.

Each time is measured from the moment the donefile line is appended to the moment
every shard's ``/v1/status`` reports the pass active (cube-transfer's own timings are
printed beside it), and the bytes the agents downloaded are taken from cube-transfer's
status. After the delta, answers are checked: changed keys answer their new values,
deleted keys are not found, a sample of the others their old values.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv

import numpy as np
import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from ctr_foundation.pass_format import SparseLayout  # noqa: E402
from cube.client import CubeClient  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
from bench_support import free_port  # noqa: E402

DIM = 9
TOKEN = "bench-rollout-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LAYOUT = SparseLayout(DIM, "adam")


# ---- passes in the trainer's layout ------------------------------------------------------------


def write_table(folder: Path, keys: np.ndarray, values: np.ndarray, parts: int) -> None:
    """Text parts with every column of the SparseAccessor/Adam layout (states as 0, embeddings as float32)."""
    folder.mkdir(parents=True, exist_ok=True)
    ncols = 1 + LAYOUT.value_columns
    emb = {int(c): j for j, c in enumerate(LAYOUT.embedding_column_indices())}
    zeros = pa.array(np.zeros(len(keys), np.int8))
    for p in range(parts):
        sl = slice(p * len(keys) // parts, (p + 1) * len(keys) // parts)
        cols = [pa.array(keys[sl])]
        for c in range(1, ncols):
            cols.append(pa.array(values[sl, emb[c]]) if c in emb else zeros[: sl.stop - sl.start])
        table = pa.table(cols, names=[f"c{c}" for c in range(ncols)])
        options = pacsv.WriteOptions(include_header=False, delimiter=" ", quoting_style="none")
        pacsv.write_csv(table, folder / f"part-{p:03d}", write_options=options)


def write_meta(pass_dir: Path, name: str, kind: str, parent: str | None) -> None:
    (pass_dir / "dense").mkdir(parents=True, exist_ok=True)
    for f in ("inference.pdmodel", "inference.pdiparams"):
        (pass_dir / "dense" / f).write_bytes(b"bench " + name.encode())
    meta = {
        "pass": name,
        "kind": kind,
        "parent": parent,
        "slots": [0, 1],
        "embedding_dim": DIM,
        "sparse_dim": None,
        "sparse_layout": {"accessor": "SparseAccessor", "optimizer": "adam"},
    }
    (pass_dir / "meta.json").write_text(json.dumps(meta))


def append_done(model_path: Path, name: str) -> float:
    t = time.time()
    line = json.dumps({"pass": name, "path": name, "window": {}, "time": t, "metrics": {}})
    fd = os.open(model_path / "donefile", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return t


# ---- processes ----------------------------------------------------------------------------------


class Procs:
    def __init__(self, work: Path):
        self.work, self.procs = work, []
        self.env = {**os.environ, "ELASTIC_CTR_TOKEN": TOKEN}

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.work / f"{name}.log", "ab")
        p = subprocess.Popen(argv, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append((name, p, log))
        return p

    def cube(self, kind: str, name: str, args: list[str]) -> str:
        ready = self.work / f"{name}.ready"
        p = self.start(name, [sys.executable, "-m", f"cube.{kind}", *args, "--ready-file", str(ready)])
        while not ready.exists():
            if p.poll() is not None:
                raise SystemExit(f"{name} exited: {(self.work / f'{name}.log').read_text()[-800:]}")
            time.sleep(0.05)
        return f"http://127.0.0.1:{json.loads(ready.read_text())['port']}"

    def cluster(self, shards: int, names: tuple[str, str] = ("server", "agent")) -> tuple[str, list[str], list[str]]:
        """The file server (``WORK/files``) and ``shards`` cube-server + cube-agent pairs; (fs_url, servers, agents)."""
        fs_port = free_port()
        self.start(
            "fileserver",
            [sys.executable, "-m", "elastic_control", "fileserver", "--root", str(self.work / "files"), "--host",
             "127.0.0.1", "--port", str(fs_port)],
        )  # fmt: skip
        fs_url = f"http://127.0.0.1:{fs_port}"
        wait_http(f"{fs_url}/healthz")
        servers, agents = [], []
        for i in range(shards):
            data = self.work / f"shard-{i}"
            data.mkdir()
            common = ["--host", "127.0.0.1", "--port", "0", "--shard", str(i), "--data", str(data)]
            servers.append(self.cube("server", f"{names[0]}-{i}", common))
            agents.append(
                self.cube("agent", f"{names[1]}-{i}", [*common, "--server", servers[-1], "--fileserver", fs_url])
            )
        return fs_url, servers, agents

    def transfer(
        self, models: Path, fs_url: str, agents: list[str], *extra: str, name: str = "transfer", timeout: int = 60
    ) -> str:
        """cube-transfer over ``models`` shipping to ``agents`` (built versions under WORK/built); its URL."""
        argv = ["--model-path", str(models), "--cube-root", str(self.work / "built"), "--fileserver", fs_url,
                "--agents", ",".join(agents), "--host", "127.0.0.1", "--port", "0", "--timeout", str(timeout),
                *extra]  # fmt: skip
        return self.cube("transfer", name, argv)

    def stop(self) -> None:
        for _, p, _ in self.procs:
            if p.poll() is None:
                p.terminate()
        for _, p, log in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
            log.close()


def wait_http(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(requests.RequestException):
            if requests.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.05)
    raise SystemExit(f"{url} did not answer")


def wait_all_active(servers: list[str], version: str, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        actives = set()
        for u in servers:
            with contextlib.suppress(requests.RequestException, ValueError):
                actives.add(requests.get(f"{u}/v1/status", timeout=2).json().get("active"))
        if actives == {version}:
            return time.time()
        time.sleep(0.02)
    raise SystemExit(f"not every shard serves {version} after {timeout}s")


def transfer_record(transfer_url: str, version: str) -> dict:
    for _ in range(100):
        active = requests.get(f"{transfer_url}/v1/status", timeout=5).json().get("active") or {}
        if active.get("version") == version:
            return active.get("timings", {})
        time.sleep(0.05)
    return {}


def roll(model_path, transfer_url, servers, name, timeout) -> dict:
    t0 = append_done(model_path, name)
    requests.post(f"{transfer_url}/v1/poll", headers=AUTH, timeout=5)
    done = wait_all_active(servers, name, timeout)
    timings = transfer_record(transfer_url, name)
    return {"seconds": done - t0, **timings}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1M keys")
    ap.add_argument("--keys", type=int, default=None, help="keys in the table (default 10M, --quick 1M)")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--delta", type=float, default=0.01, help="fraction of the keys a delta touches")
    ap.add_argument("--workdir", default=None, help="where passes and shards go (default: a temp folder)")
    args = ap.parse_args()
    n = args.keys or (1_000_000 if args.quick else 10_000_000)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-rollout-"))
    work.mkdir(parents=True, exist_ok=True)
    models = work / "models"
    models.mkdir()
    load0 = os.getloadavg()[0]
    rng = np.random.default_rng(0)
    t = time.time()
    keys = np.unique(rng.integers(1, 2**64 - 1, int(n * 1.001) + 10, dtype=np.uint64))[:n]
    keys = rng.permutation(keys)
    values = rng.standard_normal((n, DIM)).astype(np.float32)
    b1, b2, d3 = "pass-20240101-00", "pass-20240101-01", "pass-20240101-02"
    write_table(models / b1 / "sparse" / "000", keys, values, parts=8)
    write_meta(models / b1, b1, "base", None)
    (models / b2 / "sparse").mkdir(parents=True)
    os.symlink(models / b1 / "sparse" / "000", models / b2 / "sparse" / "000")  # the same table, a new pass
    write_meta(models / b2, b2, "base", None)
    touched = int(n * args.delta)
    n_change, n_new, n_del = touched * 8 // 10, touched // 10, touched // 10
    pick = rng.permutation(n)
    changed, deleted = keys[pick[:n_change]], keys[pick[n_change : n_change + n_del]]
    new_keys = rng.integers(1, 2**64 - 1, n_new, dtype=np.uint64)
    new_keys = new_keys[~np.isin(new_keys, keys)]
    d_keys = np.concatenate([changed, new_keys])
    d_values = rng.standard_normal((len(d_keys), DIM)).astype(np.float32)
    write_table(models / d3 / "sparse" / "000", d_keys, d_values, parts=1)
    (models / d3 / "deleted").mkdir()
    (models / d3 / "deleted" / "part-000").write_text("".join(f"{int(k)}\n" for k in deleted))
    write_meta(models / d3, d3, "delta", b2)
    text_bytes = sum(p.stat().st_size for p in (models / b1 / "sparse" / "000").iterdir())
    print(
        f"passes: {n:,} keys x dim {DIM} ({text_bytes / 1e9:.2f} GB of text), delta {len(d_keys):,} rows "
        f"+ {len(deleted):,} deletes, written in {time.time() - t:.0f}s; load average {load0:.1f}",
        flush=True,
    )

    procs = Procs(work)
    try:
        fs_url, servers, agents = procs.cluster(args.shards)
        transfer = procs.transfer(models, fs_url, agents, "--poll-interval", "0.2", "--compact-after", "0", timeout=600)
        warm = roll(models, transfer, servers, b1, 1800)
        print(f"warm-up (pass 1 to empty shards): {warm['seconds']:.1f}s", flush=True)
        full = roll(models, transfer, servers, b2, 1800)
        delta = roll(models, transfer, servers, d3, 600)
        check(servers, keys, values, changed, d_keys, d_values, deleted, rng)
    finally:
        procs.stop()
    report(n, args.shards, full, delta, load0)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


def check(servers, keys, values, changed, d_keys, d_values, deleted, rng) -> None:
    """The delta version answers the new values, not-found for deletes, the old values elsewhere."""
    with CubeClient(servers, timeout=30) as c:
        got, found, _ = c.lookup(d_keys)
        assert found.all() and np.array_equal(got, d_values), "changed or new keys do not answer their new values"
        _, found, _ = c.lookup(deleted)
        assert not found.any(), "deleted keys are still found"
        untouched = np.flatnonzero(~np.isin(keys, np.concatenate([changed, deleted])))
        sample = rng.choice(untouched, min(100_000, len(untouched)), replace=False)
        got, found, _ = c.lookup(keys[sample])
        assert found.all() and np.array_equal(got, values[sample]), "untouched keys changed"
    print(f"answers checked: {len(d_keys):,} changed/new, {len(deleted):,} deleted, {len(sample):,} untouched")


def report(n: int, shards: int, full: dict, delta: dict, load0: float) -> None:
    def line(label, r):
        parts = ", ".join(f"{k} {r[k]:.2f}s" for k in ("build_s", "publish_s", "prepare_s", "activate_s") if k in r)
        return (
            f"{label:13s} {r['seconds']:7.2f}s donefile line -> all {shards} shards serving | "
            f"shipped {r.get('shipped_bytes', 0) / 1e6:9.1f} MB | transfer: {parts}"
        )

    print(line("full rebuild", full))
    print(line("1% delta", delta))
    for label, r in (("full rebuild", full), ("1% delta", delta)):
        print(f"  {label} per shard (agent install / server load): {r.get('shard_timings')}")
    speedup = full["seconds"] / delta["seconds"]
    shipped = full.get("shipped_bytes", 0) / max(delta.get("shipped_bytes", 1), 1)
    print(
        f"\nsummary ({n:,} keys, {shards} shards): delta reaches every shard {speedup:.1f}x faster than a full "
        f"rebuild ({delta['seconds']:.2f}s vs {full['seconds']:.2f}s; goal >= 10x and <= 10 s: "
        f"{'met' if speedup >= 10 and delta['seconds'] <= 10 else 'NOT met'}), ships {shipped:.0f}x fewer bytes; "
        f"load average {os.getloadavg()[0]:.1f} now, {load0:.1f} at the start"
    )


if __name__ == "__main__":
    main()
