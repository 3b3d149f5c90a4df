"""The demo's data: hourly slot-format data (synthetic or converted Criteo), slot.conf, data.config.

The last generated hour is held out: it is outside the training window, and
the demo predicts its lines through the client at the end.
"""

from __future__ import annotations

import datetime as dt
import gzip
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ctr_foundation.atomic import atomic_write_text
from elastic_control.config.data_config import format_hour
from elastic_control.data.criteo import convert_file, read_raw_lines
from elastic_control.data.hourly_writer import hour_dir, hour_slots
from elastic_control.data.synth import DEFAULT_INTERACTIONS, generate, read_truth
from elastic_control.evaluation.logistic_peer import best_fit, logistic_regression
from elastic_control.metrics import auc_from_counts, counts_from_arrays

DEMO_START = dt.datetime(2019, 12, 21, 0)
SYNTH_SLOTS = tuple(range(1, 27))  # 26 slots, as many as Criteo's categorical features


@dataclass(frozen=True)
class DemoData:
    slot_conf: Path
    data_config: Path
    dataset: Path
    model_path: Path
    train_hours: int
    heldout_lines: list[str]
    heldout_labels: np.ndarray
    heldout_truth: np.ndarray | None  # true probabilities (synthetic data only)
    bayes_auc: float | None  # AUC of the true probabilities on the held-out hour
    source: str  # "synthetic" or the Criteo file
    lines_total: int
    lr_auc: float | None = None  # logistic regression on the same feasigns (see logistic_auc)

    @property
    def window(self) -> tuple[dt.datetime, dt.datetime]:
        return DEMO_START, DEMO_START + dt.timedelta(hours=self.train_hours - 1)


def _hour_lines(folder: Path) -> list[str]:
    lines: list[str] = []
    for part in sorted(folder.glob("part-*")):
        opener = gzip.open if part.name.endswith(".gz") else open
        with opener(part, "rt", encoding="utf-8") as f:
            lines.extend(ln.rstrip("\n") for ln in f if ln.strip())
    return lines


def _labels(lines: list[str]) -> np.ndarray:
    return np.array([int(line.split(maxsplit=2)[1]) for line in lines], dtype=np.int64)


def write_configs(
    workdir: Path, *, slots, train_hours: int, dataset: Path, model_path: Path, extra: dict | None = None
) -> tuple[Path, Path]:
    """slot.conf and data.config for the training window (the held-out hour is left out); ``extra`` adds
    keys (the incremental ones: DELTA_PASSES, PASS_MINUTES, ...)."""
    slot_conf = workdir / "slot.conf"
    data_config = workdir / "data.config"
    end = DEMO_START + dt.timedelta(hours=train_hours - 1)
    atomic_write_text(slot_conf, "# written by `elastic-control demo`\n" + "".join(f"{s}\n" for s in slots))
    atomic_write_text(
        data_config,
        "\n".join(
            [
                "# written by `elastic-control demo`: the training window; the next hour is held out",
                'export HDFS_ADDRESS=""',
                f'export START_DATE_HR="{format_hour(DEMO_START)}"',
                f'export END_DATE_HR="{format_hour(end)}"',
                f'export DATASET_PATH="{dataset}"',
                'export DATA_FORMAT="text"',
                'export ONLINE="0"',
                f'export MODEL_PATH="{model_path}"',
                *(f'export {k}="{v}"' for k, v in (extra or {}).items()),
                "",
            ]
        ),
    )
    return slot_conf, data_config


def _heldout(dataset: Path, hour: dt.datetime, minutes: int | None, truth: bool):
    """(lines, true probabilities or None) of the held-out hour, over its sub-hour folders if any."""
    lines: list[str] = []
    probs = []
    for slot in hour_slots(hour, minutes):
        folder = hour_dir(dataset, slot, minutes)
        if truth:
            got, p = read_truth(folder)
            lines += got
            probs.append(p)
        else:
            lines += _hour_lines(folder)
    return lines, (np.concatenate(probs) if truth else None)


def prepare_synthetic(
    workdir: Path,
    *,
    train_hours: int,
    lines_per_hour: int,
    seed: int = 7,
    progress=None,
    extra: dict | None = None,
    interactions: float | None = None,
) -> DemoData:
    """Planted-model hours (``elastic-control data synth``): train_hours + 1 held-out hour.

    ``extra`` data.config keys; with PASS_MINUTES the hours are written as sub-hour folders.
    ``interactions`` is ``data synth --interactions`` (default: the interaction model, where a deep
    model beats logistic regression; 0 is the original planted model).
    """
    dataset, model_path = workdir / "data", workdir / "models"
    summary = generate(
        dataset,
        slots=SYNTH_SLOTS,
        hours=train_hours + 1,
        lines_per_hour=lines_per_hour,
        seed=seed,
        start=DEMO_START,
        progress=progress,
        minutes=_minutes(extra),
        interactions=DEFAULT_INTERACTIONS if interactions is None else interactions,
    )
    lines, truth = _heldout(dataset, DEMO_START + dt.timedelta(hours=train_hours), _minutes(extra), truth=True)
    labels = _labels(lines)
    bayes, _ = auc_from_counts(counts_from_arrays(labels, truth))
    slot_conf, data_config = write_configs(
        workdir, slots=SYNTH_SLOTS, train_hours=train_hours, dataset=dataset, model_path=model_path, extra=extra
    )
    return DemoData(
        slot_conf,
        data_config,
        dataset,
        model_path,
        train_hours,
        lines,
        labels,
        truth,
        bayes,
        "synthetic planted-model data" + (" with pairwise interactions" if summary["interactions"] else ""),
        int(summary["lines"]),
    )


def _minutes(extra: dict | None) -> int | None:
    value = (extra or {}).get("PASS_MINUTES")
    return int(value) if value else None


def prepare_criteo(
    workdir: Path,
    criteo_file: str,
    *,
    train_hours: int,
    lines_per_hour: int | None,
    progress=None,
    extra: dict | None = None,
) -> DemoData:
    """Real Criteo lines (``elastic-control data criteo``), split into train_hours + 1 hours.

    With ``lines_per_hour``, only the first (train_hours + 1) * lines_per_hour lines of the file are used.
    """
    dataset, model_path = workdir / "data", workdir / "models"
    source = Path(criteo_file)
    if lines_per_hour:
        # Convert only what the demo uses: a prefix of the raw file.
        prefix = workdir / "criteo-prefix.txt"
        want = (train_hours + 1) * lines_per_hour
        with open(prefix, "w", encoding="utf-8") as out:
            for n, raw in enumerate(read_raw_lines(criteo_file)):
                if n >= want:
                    break
                out.write(raw if raw.endswith("\n") else raw + "\n")
        source = prefix
    summary = convert_file(
        source, dataset, hours=train_hours + 1, start=DEMO_START, progress=progress, minutes=_minutes(extra)
    )
    lines, _ = _heldout(dataset, DEMO_START + dt.timedelta(hours=train_hours), _minutes(extra), truth=False)
    # The converter's slot.conf: 13 bucketised integer + 26 categorical sparse slots, the 13 counts as dense slots.
    slots = [ln for ln in Path(summary["slot_conf"]).read_text().splitlines() if ln and not ln.startswith("#")]
    slot_conf, data_config = write_configs(
        workdir, slots=slots, train_hours=train_hours, dataset=dataset, model_path=model_path, extra=extra
    )
    return DemoData(
        slot_conf,
        data_config,
        dataset,
        model_path,
        train_hours,
        lines,
        _labels(lines),
        None,
        None,
        f"Criteo lines from {criteo_file}",
        int(summary.get("lines", 0)),
    )


def logistic_auc(data: DemoData, minutes: int | None = None) -> float | None:
    """The held-out hour's AUC of logistic regression trained on the training hours' feasigns (the peer
    the deep model is measured against, at its best regularisation), or None without scikit-learn (a
    development dependency, absent from a bare install). ``minutes``: the PASS_MINUTES layout."""
    try:
        import sklearn  # noqa: F401
    except ImportError:
        return None

    train: list[str] = []
    for h in range(data.train_hours):
        for slot in hour_slots(DEMO_START + dt.timedelta(hours=h), minutes):
            train += _hour_lines(hour_dir(data.dataset, slot, minutes))
    return best_fit(logistic_regression(train, data.heldout_lines)).auc
