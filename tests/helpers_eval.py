"""Helpers for the evaluation tests: planted synthetic data and real passes from a short PS run."""

from __future__ import annotations

import datetime as dt
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
PS_TRAIN_SCRIPT = Path(__file__).resolve().parent / "helpers_eval_ps_train.py"
SLOTS = [0, 1, 2, 3]
GROUP_SLOT = 3
EXTRA_SLOT = 9  # present in lines but not trained on: must be ignored


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PlantedModel:
    """Clicks drawn from a known logistic model over per-slot feasigns (some above 2**63)."""

    def __init__(self, seed: int = 7, vocab: int = 40):
        rng = np.random.default_rng(seed)
        self.vocab = vocab
        self.feasigns = {s: rng.integers(0, 2**64 - 1, size=vocab, dtype=np.uint64, endpoint=True) for s in SLOTS}
        self.weights = {s: rng.normal(0, 1.2, size=vocab) for s in SLOTS}

    def lines(self, n: int, seed: int) -> list[str]:
        rng = np.random.default_rng(seed)
        out = []
        for _ in range(n):
            logit, toks = -0.8, []
            for s in SLOTS:
                r = rng.random()
                if r < 0.05:
                    continue  # slot missing: padding key
                count = 2 if r > 0.93 and s != GROUP_SLOT else 1
                for _ in range(count):
                    v = int(rng.integers(self.vocab))
                    logit += self.weights[s][v]
                    toks.append(f"{int(self.feasigns[s][v])}:{s}")
            toks.append(f"{int(rng.integers(1, 2**64 - 1, dtype=np.uint64))}:{EXTRA_SLOT}")
            click = int(rng.random() < 1 / (1 + np.exp(-logit)))
            out.append(" ".join(["1", str(click)] + toks))
        return out


def write_hours(
    root: Path, first_hour: dt.datetime, hours: list[list[str]], files_per_hour: int = 2, gz_hour: int | None = None
) -> None:
    """Write slot lines in the hourly layout (part files + donefile); hour ``gz_hour`` gzipped."""
    import gzip

    for h, lines in enumerate(hours):
        t = first_hour + dt.timedelta(hours=h)
        d = root / f"{t:%Y%m%d}" / f"{t:%H}"
        d.mkdir(parents=True, exist_ok=True)
        for i in range(files_per_hour):
            part = lines[i::files_per_hour]
            text = "".join(ln + "\n" for ln in part)
            if gz_hour == h:
                with gzip.open(d / f"part-{i:05d}.gz", "wt") as f:
                    f.write(text)
            else:
                (d / f"part-{i:05d}").write_text(text)
        (d / "donefile").write_text("")


def write_data_config(
    path: Path, dataset: Path, start: str, end: str, model_path: Path | None = None, sparse_dim: int | None = None
) -> Path:
    text = f'export START_DATE_HR="{start}"\nexport END_DATE_HR="{end}"\nexport DATASET_PATH="{dataset}"\n'
    if sparse_dim:
        text += f'export SPARSE_DIM="{sparse_dim}"\n'
    if model_path:
        text += f'export MODEL_PATH="{model_path}"\n'
    path.write_text(text)
    return path


def train_pass(
    pass_dir: Path,
    train_lines: list[str],
    golden_lines: list[str],
    *,
    shuffle_labels: bool = False,
    epochs: int = 2,
    hidden: str = "32,32",
    emb: int = 9,
    seed: int = 0,
    sparse_dim: int | None = None,
    window: tuple[str, str] = ("20200101/00", "20200101/00"),
    timeout: float = 240,
) -> Path:
    """Run one pserver and one trainer (real processes on loopback) and return the pass folder."""
    work = pass_dir.parent / f".{pass_dir.name}.work"
    work.mkdir(parents=True, exist_ok=True)
    data, golden = work / "train.txt", work / "golden.txt"
    data.write_text("\n".join(train_lines) + "\n")
    golden.write_text("\n".join(golden_lines) + "\n")
    ps_port, tr_port = free_port(), free_port()
    env = dict(
        os.environ,
        PADDLE_PSERVERS_IP_PORT_LIST=f"127.0.0.1:{ps_port}",
        PADDLE_TRAINERS_NUM="1",
        PADDLE_TRAINER_ENDPOINTS=f"127.0.0.1:{tr_port}",
        POD_IP="127.0.0.1",
        PADDLE_PORT=str(ps_port),
        PYTHONPATH=str(REPO),
        GLOG_v="0",
        GLOG_minloglevel="2",
        OMP_NUM_THREADS="1",
    )
    cmd = [
        sys.executable,
        str(PS_TRAIN_SCRIPT),
        "--data",
        str(data),
        "--golden",
        str(golden),
        "--out",
        str(pass_dir),
        "--slots",
        ",".join(map(str, SLOTS)),
        "--emb",
        str(emb),
        "--hidden",
        hidden,
        "--epochs",
        str(epochs),
        "--seed",
        str(seed),
        "--window",
        ",".join(window),
    ]
    if shuffle_labels:
        cmd.append("--shuffle-labels")
    if sparse_dim:
        cmd += ["--sparse-dim", str(sparse_dim)]
    with open(work / "pserver.log", "wb") as pslog, open(work / "trainer.log", "wb") as trlog:
        ps = subprocess.Popen(cmd, env=dict(env, TRAINING_ROLE="PSERVER"), stdout=pslog, stderr=subprocess.STDOUT)
        try:
            tr = subprocess.run(
                cmd,
                env=dict(env, TRAINING_ROLE="TRAINER", PADDLE_TRAINER_ID="0"),
                stdout=trlog,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            )
        finally:
            ps.kill()  # the pserver never exits by itself
            ps.wait()
    if tr.returncode != 0 or not (pass_dir / "meta.json").exists():
        tail = (work / "trainer.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"fixture training failed (rc={tr.returncode}):\n{tail}")
    return pass_dir
