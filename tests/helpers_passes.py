"""Passes written by the product trainer, for the cube, serving and evaluation tests.

Everything goes through the product's public paths: `elastic-control data
synth` makes the data, `elastic-control train` (1 pserver, 1 trainer) trains
it and writes ``MODEL_PATH/pass-*`` with its donefile line, exactly as a user
would. No test carries a copy of the model: whatever the trainer does (model
families, sparse layouts, meta.json fields), the passes here follow.

The session fixtures in ``conftest.py`` build each world once per test run;
tests must treat them as read-only (copy before changing anything).
"""

from __future__ import annotations

import datetime as dt
import itertools
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from helpers_common import CRITEO_FILE, CRITEO_SLOTS, run_cli

SYNTH_START = dt.datetime(2020, 1, 1, 0)
# Slots 1-4 are trained; slot 5 is in every generated line too but not in slot.conf, so
# training, serving and evaluation must all ignore it.
SYNTH_SLOTS = (1, 2, 3, 4)
EXTRA_SLOT = 5
GROUP_SLOT = 4  # evaluation's grouped metrics group by this slot's first feasign
TRAIN_HOURS = 2  # two consecutive passes: version switches are tested between real passes
HOLDOUT_HOURS = 2  # hours after the training window, never trained on
LINES_PER_HOUR = 8000
# `train` flags of the worlds whose tests need a real pass but not a converged one.
QUICK_TRAIN_ARGS = ["--log-every", "100", "--epochs", "2"]
SYNTH_SEED = 3
CRITEO_LINES = 2000
CRITEO_SPARSE_DIM = 1000003


def hour_text(hour: dt.datetime) -> str:
    return f"{hour:%Y%m%d/%H}"


@dataclass(frozen=True)
class TrainedWorld:
    """A data set in the hourly layout and the passes `elastic-control train` wrote from it."""

    root: Path
    data: Path  # DATASET_PATH (training hours and, for the synthetic world, the hold-out hours)
    models: Path  # MODEL_PATH: pass folders, donefile, logs, mlflow.db
    data_config: Path  # the training window
    slot_conf: Path
    slots: tuple[int, ...]
    passes: tuple[Path, ...]  # oldest first, as the donefile lists them
    holdout: tuple[str, str] | None = None  # first and last hold-out hour (YYYYMMDD/HH)
    sparse_dim: int | None = None

    @property
    def latest(self) -> Path:
        return self.passes[-1]

    def copy_models(self, dest: Path) -> Path:
        """A private MODEL_PATH copy (pass folders + donefile) for tests that add or change passes."""
        shutil.copytree(self.models, dest, ignore=shutil.ignore_patterns("logs", "mlflow.db", "mlartifacts"))
        return dest


def write_data_config(
    path: Path,
    dataset: Path,
    start: str,
    end: str,
    *,
    model_path: Path | None = None,
    sparse_dim: int | None = None,
    extra: str = "",
) -> Path:
    """A data.config over hours START..END of ``dataset``."""
    text = f'export START_DATE_HR="{start}"\nexport END_DATE_HR="{end}"\nexport DATASET_PATH="{dataset}"\n'
    if sparse_dim:
        text += f'export SPARSE_DIM="{sparse_dim}"\n'
    if model_path:
        text += f'export MODEL_PATH="{model_path}"\n'
    path.write_text(text + extra)
    return path


def _check(result, what: str, models: Path | None = None) -> None:
    if result.returncode == 0:
        return
    logs = ""
    if models is not None and (models / "logs").is_dir():
        for log in sorted((models / "logs").glob("*.log")):
            logs += f"\n--- {log.name}\n" + log.read_text(errors="replace")[-1500:]
    raise RuntimeError(f"{what} failed (exit {result.returncode}):\n{result.stderr[-3000:]}{logs}")


def train(
    root: Path,
    *,
    data: Path,
    slots,
    start: str,
    end: str,
    sparse_dim: int | None = None,
    trainers: int = 1,
    pservers: int = 1,
    args: list[str] | None = None,
    timeout: float = 600,
    slot_conf_text: str | None = None,
) -> tuple[Path, Path, Path, tuple[Path, ...]]:
    """`elastic-control train` over START..END of ``data``: (data_config, slot_conf, models, passes).

    The slot.conf lists ``slots``, or is ``slot_conf_text`` when given (e.g. one with dense slots)."""
    from ctr_foundation.records import read_donefile

    root.mkdir(parents=True, exist_ok=True)
    models = root / "models"
    slot_conf = root / "slot.conf"
    slot_conf.write_text(slot_conf_text if slot_conf_text is not None else "".join(f"{s}\n" for s in slots))
    config = write_data_config(root / "data.config", data, start, end, model_path=models, sparse_dim=sparse_dim)
    # The training's own store (sqlite in MODEL_PATH), whatever the calling environment says.
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL_PATH", "MLFLOW_TRACKING_URI")}
    result = run_cli(
        "train",
        "-f",
        config,
        "-s",
        slot_conf,
        "-t",
        trainers,
        "-p",
        pservers,
        "--timeout",
        timeout,
        *(args or ["--log-every", "100"]),
        env=env,
        timeout=timeout + 60,
    )
    _check(result, "elastic-control train", models)
    passes = tuple(models / e.pass_name for e in read_donefile(models))
    if not passes:
        raise RuntimeError(f"elastic-control train wrote no complete pass:\n{result.stderr[-3000:]}")
    return config, slot_conf, models, passes


def synth_world(root: Path) -> TrainedWorld:
    """Synthetic hours from `elastic-control data synth`; passes for the first TRAIN_HOURS hours."""
    data = root / "data"
    generated = root / "generated-slots.conf"
    generated.write_text("".join(f"{s}\n" for s in (*SYNTH_SLOTS, EXTRA_SLOT)))
    hours = TRAIN_HOURS + HOLDOUT_HOURS
    result = run_cli(
        "data",
        "synth",
        "--output",
        data,
        "--hours",
        hours,
        "--lines-per-hour",
        LINES_PER_HOUR,
        "--seed",
        SYNTH_SEED,
        "-s",
        generated,
        "--start",
        hour_text(SYNTH_START),
    )
    _check(result, "elastic-control data synth")
    last_trained = SYNTH_START + dt.timedelta(hours=TRAIN_HOURS - 1)
    config, slot_conf, models, passes = train(
        root, data=data, slots=SYNTH_SLOTS, start=hour_text(SYNTH_START), end=hour_text(last_trained)
    )
    holdout = (
        hour_text(last_trained + dt.timedelta(hours=1)),
        hour_text(last_trained + dt.timedelta(hours=HOLDOUT_HOURS)),
    )
    return TrainedWorld(root, data, models, config, slot_conf, SYNTH_SLOTS, passes, holdout)


def shuffled_label_world(root: Path, source: TrainedWorld) -> TrainedWorld:
    """A pass trained on the first hour of ``source`` with its clicks shuffled: a model that learned nothing."""
    import numpy as np

    from elastic_control.data.hourly_writer import hour_dir, write_hour
    from elastic_control.data.readers import HOUR_DONEFILE

    folder = hour_dir(source.data, SYNTH_START)
    lines = []
    for part in sorted(p for p in folder.glob("part-*")):
        lines += [ln for ln in part.read_text().splitlines() if ln.strip()]
    assert (folder / HOUR_DONEFILE).exists()
    toks = [ln.split(" ", 2) for ln in lines]
    clicks = np.random.default_rng(0).permutation([t[1] for t in toks])
    data = root / "data"
    write_hour(data, SYNTH_START, [" ".join([t[0], c, *t[2:]]) for t, c in zip(toks, clicks, strict=True)])
    start = hour_text(SYNTH_START)
    # Two epochs: what it is for (a model that learned nothing) needs no more, and a first pass would train 13.
    config, slot_conf, models, passes = train(
        root, data=data, slots=source.slots, start=start, end=start, args=QUICK_TRAIN_ARGS
    )
    return TrainedWorld(root, data, models, config, slot_conf, source.slots, passes)


def criteo_slot_lines(start: int, count: int) -> list[str]:
    """``count`` real Criteo lines from line ``start`` on (read in place), in the slot format of the product's
    converter. An import error or a conversion error of the converter fails the calling test."""
    from elastic_control.data.criteo import CriteoConverter

    conv = CriteoConverter()
    with open(CRITEO_FILE, encoding="utf-8") as f:
        return [conv.convert_line(raw) for raw in itertools.islice(f, start, start + count)]


def criteo_world(root: Path, *, lines: int = CRITEO_LINES, sparse_dim: int | None = CRITEO_SPARSE_DIM) -> TrainedWorld:
    """One hour of real Criteo lines (all 39 slots) trained with SPARSE_DIM: the key transform end to end."""
    from elastic_control.data.hourly_writer import write_hour

    data = root / "data"
    write_hour(data, SYNTH_START, criteo_slot_lines(0, lines))
    start = hour_text(SYNTH_START)
    # Its users check keys, rows and golden lines, not quality: two epochs, not the first pass's 20 of 16 steps.
    config, slot_conf, models, passes = train(
        root, data=data, slots=CRITEO_SLOTS, start=start, end=start, sparse_dim=sparse_dim, args=QUICK_TRAIN_ARGS
    )
    return TrainedWorld(root, data, models, config, slot_conf, tuple(CRITEO_SLOTS), passes, sparse_dim=sparse_dim)


def criteo_dense_world(root: Path, *, lines: int = CRITEO_LINES) -> TrainedWorld:
    """Real Criteo lines as `elastic-control data criteo` converts them (sparse slots 1-39, and I1-I13 as
    numbers in the dense slots 40-52), trained with the slot.conf it wrote: a pass with dense slots."""
    import json

    raw = root / "raw.tsv"
    root.mkdir(parents=True, exist_ok=True)
    with open(CRITEO_FILE, encoding="utf-8") as f:
        raw.write_text("".join(itertools.islice(f, lines)))
    data = root / "data"
    start = hour_text(SYNTH_START)
    result = run_cli("data", "criteo", "--input", raw, "--output", data, "--hours", 1, "--start", start)
    _check(result, "elastic-control data criteo")
    written = Path(json.loads(result.stdout)["slot_conf"])
    config, slot_conf, models, passes = train(
        root,
        data=data,
        slots=CRITEO_SLOTS,
        start=start,
        end=start,
        sparse_dim=CRITEO_SPARSE_DIM,
        args=QUICK_TRAIN_ARGS,
        slot_conf_text=written.read_text(),
    )
    return TrainedWorld(
        root, data, models, config, slot_conf, tuple(CRITEO_SLOTS), passes, sparse_dim=CRITEO_SPARSE_DIM
    )


_SESSION_WORLDS: dict[str, TrainedWorld] = {}


def session_synth_world(tmp_path_factory) -> TrainedWorld:
    """The session's synthetic world, trained once however many callers ask (the ``synth_world`` fixture)."""
    key = str(tmp_path_factory.getbasetemp())
    if key not in _SESSION_WORLDS:
        _SESSION_WORLDS[key] = synth_world(tmp_path_factory.mktemp("synth-world"))
    return _SESSION_WORLDS[key]
