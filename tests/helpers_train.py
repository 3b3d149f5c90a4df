"""Helpers for the product-trainer tests (tests/test_train_*.py): small jobs on synthetic or Criteo data.

Other tests get their passes from the session fixtures in conftest.py (helpers_passes.py).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

import numpy as np

START = dt.datetime(2019, 12, 21, 0)


@dataclass
class Job:
    root: Path
    data: Path
    models: Path
    data_config: Path
    slot_conf: Path


def write_job(
    root: Path, *, slots, hours: int, start: dt.datetime = START, extra: str = "", data: Path | None = None
) -> Job:
    """data.config + slot.conf for hours START..START+hours-1 over ``data`` (default root/data)."""
    root.mkdir(parents=True, exist_ok=True)
    data = data or root / "data"
    models = root / "models"
    end = start + dt.timedelta(hours=hours - 1)
    data_config = root / "data.config"
    data_config.write_text(
        f"export START_DATE_HR={start:%Y%m%d/%H}\nexport END_DATE_HR={end:%Y%m%d/%H}\n"
        f'export DATASET_PATH="{data}"\nexport MODEL_PATH="{models}"\n{extra}'
    )
    slot_conf = root / "slot.conf"
    slot_conf.write_text("".join(f"{s}\n" for s in slots))
    return Job(root, data, models, data_config, slot_conf)


def run_training(
    job: Job,
    *,
    trainers: int = 2,
    pservers: int = 1,
    args: list[str] | None = None,
    timeout: float = 600,
    env: dict | None = None,
):
    """Run what `elastic-control train` runs, in-process (the local supervisor, in the foreground); the TrainResult."""
    import os

    from elastic_control.config import load_data_config
    from elastic_control.local.components import training_window
    from elastic_control.local.train_job import run_training_job
    from elastic_control.training.cli import hyperparameter_args
    from elastic_control.training.settings import Hyperparameters

    role_args = args if args is not None else hyperparameter_args(Hyperparameters(log_every=20))
    base_env = dict(os.environ, **(env or {}))
    return run_training_job(
        trainers=trainers,
        pservers=pservers,
        data_config=str(job.data_config),
        slot_conf=str(job.slot_conf),
        model_path=str(job.models),
        role_args=role_args,
        base_env=base_env,
        timeout=timeout,
        window=training_window(load_data_config(job.data_config)),
    )


def score_pass(pass_dir: Path, lines: list[str]) -> np.ndarray:
    """Probabilities of ``lines`` under a saved pass: sparse table + padding rule + paddle.inference."""
    from ctr_foundation.pass_format import load_pass
    from elastic_control.inference import scoring

    info = load_pass(pass_dir)
    table = scoring.InMemoryTable.from_pass(info)
    model = scoring.DenseModel.from_pass(info)
    out = []
    for i in range(0, len(lines), 4096):
        out.append(scoring.score_lines(lines[i : i + 4096], info, table.lookup, model))
    return np.concatenate(out) if out else np.zeros(0)


def read_golden(pass_dir: Path) -> tuple[list[str], np.ndarray]:
    """(lines, probabilities) of a pass's golden.jsonl (read by records.py, the format's owner)."""
    from ctr_foundation.records import GOLDEN_FILE
    from ctr_foundation.records import read_golden as read_golden_file

    lines, probs = read_golden_file(Path(pass_dir) / GOLDEN_FILE)
    return lines, np.array(probs)


def labels_of(lines: list[str]) -> np.ndarray:
    return np.array([int(ln.split()[1]) for ln in lines])


def key_counts(keys):
    """A KeyCounts of ``keys`` (uint64), as a trainer counts its share of a pass."""
    from elastic_control.training.pass_stream import KeyCounts

    c = KeyCounts()
    c.add(np.array(keys, dtype=np.uint64))
    return c
