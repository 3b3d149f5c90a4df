"""What the benchmarks share: passes from the product pipeline and real components on loopback.

Everything goes through the product (the `elastic-control` CLI, cube-builder's
library, the file server, `records.py`); nothing here comes from ``tests/``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
PYTHON = sys.executable
CRITEO_FILE = REPO.parent / "shared" / "data" / "criteo" / "criteo_real_distinct.txt"
CRITEO_SLOTS = tuple(range(1, 40))
START = dt.datetime(2020, 1, 1, 0)


def free_port() -> int:
    """A free loopback port below the ephemeral range (the product's rule)."""
    from elastic_control.local.ports import free_ports

    return free_ports(1)[0]


def cli(*args, env: dict | None = None, quiet: bool = True) -> None:
    """``python -m elastic_control ARGS``; SystemExit with its stderr if it fails."""
    r = subprocess.run(
        [PYTHON, "-m", "elastic_control", *map(str, args)],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL if quiet else None,
        stderr=subprocess.PIPE,
        text=True,
    )
    if r.returncode:
        raise SystemExit(f"elastic-control {' '.join(map(str, args[:2]))} failed:\n{r.stderr[-3000:]}")


def write_job(root: Path, *, data: Path, slots, start: dt.datetime, hours: int, sparse_dim: int | None = None):
    """(data.config, slot.conf, MODEL_PATH) for hours START..START+hours-1 of ``data``."""
    root.mkdir(parents=True, exist_ok=True)
    end = start + dt.timedelta(hours=hours - 1)
    models = root / "models"
    config = root / "data.config"
    config.write_text(
        f"export START_DATE_HR={start:%Y%m%d/%H}\nexport END_DATE_HR={end:%Y%m%d/%H}\n"
        f'export DATASET_PATH="{data}"\nexport MODEL_PATH="{models}"\n'
        + (f"export SPARSE_DIM={sparse_dim}\n" if sparse_dim else "")
    )
    slot_conf = root / "slot.conf"
    slot_conf.write_text("".join(f"{s}\n" for s in slots))
    return config, slot_conf, models


def train(config: Path, slot_conf: Path, models: Path, *, trainers: int = 1, pservers: int = 1, args=()) -> list[Path]:
    """`elastic-control train` (the product's local job); the complete passes, oldest first."""
    from ctr_foundation.records import read_donefile

    env = {k: v for k, v in os.environ.items() if k not in ("MODEL_PATH", "MLFLOW_TRACKING_URI")}
    cli("train", "-f", config, "-s", slot_conf, "-t", trainers, "-p", pservers, *args, env=env)
    return [models / e.pass_name for e in read_donefile(models)]


def write_criteo_slice(path: Path, first: int, count: int) -> Path:
    """The raw Criteo lines ``first .. first + count`` of CRITEO_FILE written to ``path`` (for `data criteo`)."""
    if not CRITEO_FILE.exists():
        raise SystemExit(f"real Criteo lines not found at {CRITEO_FILE}")
    with open(CRITEO_FILE, encoding="utf-8") as f, open(path, "w", encoding="utf-8") as out:
        out.writelines(itertools.islice(f, first, first + count))
    return path


def criteo_slot_lines(first: int, count: int) -> list[str]:
    """The real Criteo lines ``first .. first + count`` in the slot format, converted in memory."""
    from elastic_control.data.criteo import CriteoConverter

    conv = CriteoConverter()
    with open(CRITEO_FILE, encoding="utf-8") as f:
        return [conv.convert_line(raw) for raw in itertools.islice(f, first, first + count)]


def criteo_pass(work: Path, lines: int, train_args=()) -> Path:
    """A pass of `elastic-control data criteo` + `elastic-control train [train_args]` on the first ``lines`` real
    Criteo lines."""
    if not CRITEO_FILE.exists():
        raise SystemExit(f"real Criteo lines not found at {CRITEO_FILE}; pass --pass PASS_DIR")
    print(f"training a pass on {lines} real Criteo lines (elastic-control data criteo + train)...", file=sys.stderr)
    work.mkdir(parents=True, exist_ok=True)
    raw, data = write_criteo_slice(work / "raw.txt", 0, lines), work / "data"
    cli("data", "criteo", "--input", raw, "--output", data, "--hours", 1, "--start", f"{START:%Y%m%d/%H}")
    return train(*write_job(work, data=data, slots=CRITEO_SLOTS, start=START, hours=1), args=train_args)[-1]


def golden(pass_dir: Path) -> tuple[list[str], list[float]]:
    from ctr_foundation.records import GOLDEN_FILE, read_golden

    return read_golden(Path(pass_dir) / GOLDEN_FILE)


def score_pass(pass_dir: Path, lines: list[str]):
    """Probabilities of ``lines`` under a pass, offline (the product's scoring path)."""
    import numpy as np

    from ctr_foundation.pass_format import load_pass
    from elastic_control.inference import scoring

    info = load_pass(pass_dir)
    table = scoring.InMemoryTable.from_pass(info)
    model = scoring.DenseModel.from_pass(info)
    out = [scoring.score_lines(lines[i : i + 4096], info, table.lookup, model) for i in range(0, len(lines), 4096)]
    return np.concatenate(out) if out else np.zeros(0)


def publish_version(fs_root: Path, pass_dir: Path, shards: int) -> str:
    """What cube-transfer publishes, done directly: shard files, dense model + meta, cube/current.json."""
    from ctr_foundation.pass_format import load_pass
    from ctr_foundation.records import CurrentVersion, utc_now, write_current
    from cube.builder import build_version

    cube_root = fs_root / "cube"
    manifest = build_version(pass_dir=pass_dir, shards=shards, output=cube_root)
    version = manifest["version"]
    shutil.copytree(pass_dir / "dense", cube_root / version / "dense")
    shutil.copy(pass_dir / "meta.json", cube_root / version / "meta.json")
    info = load_pass(pass_dir)
    now = utc_now()
    write_current(
        cube_root,
        CurrentVersion(
            version, version, shards, info.embedding_dim, tuple(info.slots), info.sparse_dim,
            f"cube/{version}/dense/", now, now,
        ),
    )  # fmt: skip
    return version


@contextlib.contextmanager
def process(args: list, env_extra: dict | None = None, log_path: Path | None = None):
    """A real process (cwd = the repo), terminated at the end."""
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(
        [str(a) for a in args], cwd=REPO, env={**os.environ, **(env_extra or {})}, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log_path:
            log.close()


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args[:4]} exited with {proc.returncode} before {url} was healthy")
        with contextlib.suppress(requests.RequestException):
            if requests.get(url + "/healthz", timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise SystemExit(f"{url} not healthy after {timeout}s")


@contextlib.contextmanager
def cube_servers(cube_root: Path, shards: int, log_dir: Path, token: str = "bench-token"):
    """``shards`` cube-server processes (port 0 + ready file) serving ``cube_root``; yields their URLs."""
    with contextlib.ExitStack() as stack:
        started = []
        for i in range(shards):
            ready = log_dir / f"cube-{i}.ready.json"
            argv = [PYTHON, "-m", "cube.server", "--port", 0, "--host", "127.0.0.1", "--shard", i]
            argv += ["--data", cube_root, "--ready-file", ready]
            proc = stack.enter_context(process(argv, {"ELASTIC_CTR_TOKEN": token}, log_dir / f"cube-{i}.log"))
            started.append((ready, proc))
        urls = []
        for ready, proc in started:
            deadline = time.monotonic() + 120
            while not ready.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"cube-server did not start; see {log_dir}")
                time.sleep(0.05)
            urls.append(f"http://127.0.0.1:{json.loads(ready.read_text())['port']}")
            wait_healthy(urls[-1], proc)
        yield urls


def fileserver_in_thread(root: Path, token: str = "bench-token"):
    """The product's file server on 127.0.0.1:0 in this process; a context yielding its URL."""
    from elastic_control.fileserver.server import fileserver_in_thread as serve

    return serve(root, token=token)
