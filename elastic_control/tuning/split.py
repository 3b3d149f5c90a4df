"""Which lines judge the candidates, and which ones they train on.

Two ways, and no candidate ever trains on a line that judges it:

- ``--validation START[..END]``: those hours judge. They must lie outside the data.config window or at one
  of its ends (the window is then trimmed so that it stops short of them).
- otherwise every ``HOLDOUT_EVERY``-th line of each hour of the window is held out: the window is copied once
  into ``DIR/data/train`` (the rest) and ``DIR/data/validation`` (the held-out lines), each hour sealed by its
  donefile like any dataset, and ``DIR/data/split.json`` (written last) says the copy is complete.

Either way the candidates may train on less than the window holds (its held-out lines, or the validation
hours trimmed off one of its ends): ``Split.refit_reason`` says so, and the winner is then trained once more
on the whole window (tuning/refit.py).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from dataclasses import dataclass
from pathlib import Path

from ctr_foundation.atomic import atomic_write_json, atomic_write_text
from ctr_foundation.errors import ConfigError, UsageError
from elastic_control.config.data_config import DataConfig, format_hour, load_data_config, parse_hour
from elastic_control.data.hourly_writer import write_hour
from elastic_control.data.readers import HourlyData, iter_text_chunks

HOLDOUT_EVERY = 5  # one line in five judges: enough lines for a stable AUC on a log of a few thousand lines
HOUR = dt.timedelta(hours=1)
SPLIT_MARK = "split.json"


@dataclass(frozen=True)
class Split:
    train_values: dict  # data.config keys every candidate's copy starts from (no MODEL_PATH, no PASS_HOURS)
    train_start: dt.datetime
    train_end: dt.datetime
    validation_config: Path  # data.config of the judging lines (its window is exactly them)
    how: str  # one line for people
    window_values: dict  # data.config keys of the whole window as -f gives it (no MODEL_PATH, no PASS_HOURS)
    window_start: dt.datetime
    window_end: dt.datetime
    holds_lines_out: bool = False

    @property
    def refit_reason(self) -> str | None:
        """Why the window holds lines no candidate trained on (None: the candidates trained on all of it)."""
        if self.holds_lines_out:
            return f"every {HOLDOUT_EVERY}th line of each hour was held out"
        if (self.train_start, self.train_end) != (self.window_start, self.window_end):
            return "the validation hours were trimmed off the window"
        return None

    @property
    def train_hours(self) -> int:
        return (self.train_end - self.train_start) // HOUR + 1

    @property
    def validation(self) -> DataConfig:
        return load_data_config(self.validation_config)


def parse_validation(text: str) -> tuple[dt.datetime, dt.datetime]:
    """``START`` or ``START..END`` (hours YYYYMMDD/HH) -> (first, last)."""
    first, _, last = text.partition("..")
    start = parse_hour(first.strip(), key="--validation", source="--validation")
    end = parse_hour(last.strip(), key="--validation", source="--validation") if last else start
    if end < start:
        raise UsageError(f"--validation {text}: the last hour is before the first")
    return start, end


def config_text(values: dict) -> str:
    return "".join(f'export {k}="{v}"\n' for k, v in values.items())


def _check_supported(config: DataConfig) -> None:
    if config.pass_minutes:
        raise ConfigError("tune trains hourly folders: PASS_MINUTES is not supported (unset it)", path=config.source)
    if config.online:
        raise ConfigError("tune needs a fixed window of hours: set ONLINE=0", path=config.source)


def _base_values(config: DataConfig) -> dict:
    """The keys a candidate's data.config keeps (its own MODEL_PATH and PASS_HOURS are added per candidate)."""
    drop = {"MODEL_PATH", "PASS_HOURS", "ONLINE", "START_DATE_HR", "END_DATE_HR"}
    return {k: v for k, v in config.values.items() if k not in drop}


def prepare_split(*, config: DataConfig, output: Path, validation: str | None) -> Split:
    _check_supported(config)
    output.mkdir(parents=True, exist_ok=True)
    if validation:
        return _hours_split(config, output, validation)
    return _holdout_split(config, output)


def _hours_split(config: DataConfig, output: Path, text: str) -> Split:
    v_start, v_end = parse_validation(text)
    start, end = config.start, config.end
    if v_end < start or v_start > end:
        pass  # outside the window: the whole window trains
    elif v_start <= start and v_end < end:
        start = v_end + HOUR  # the window's first hours judge
    elif v_end >= end and v_start > start:
        end = v_start - HOUR  # the window's last hours judge
    else:
        raise UsageError(
            f"--validation {text} covers {'the whole' if v_start <= start else 'the middle of the'} training window "
            f"{format_hour(config.start)}..{format_hour(config.end)}: validation hours must lie outside it or at "
            "one of its ends, so that no candidate trains on them"
        )
    values = _base_values(config)
    validation_config = output / "validation.config"
    atomic_write_text(
        validation_config,
        config_text({**values, "START_DATE_HR": format_hour(v_start), "END_DATE_HR": format_hour(v_end)}),
    )
    how = f"hours {format_hour(v_start)}..{format_hour(v_end)}"
    return Split(values, start, end, validation_config, how, values, config.start, config.end)


def _holdout_split(config: DataConfig, output: Path) -> Split:
    data = output / "data"
    train_root, validation_root = data / "train", data / "validation"
    mark = data / SPLIT_MARK
    window = {"start": format_hour(config.start), "end": format_hour(config.end), "dataset": config.dataset_root}
    if not _split_done(mark, window):
        if config.data_format != "text":
            raise ConfigError(
                f"DATA_FORMAT={config.data_format}: holding lines out copies text lines; pass --validation "
                "START..END to judge on hours instead",
                path=config.source,
            )
        counts = _copy_split(config, train_root, validation_root)
        if not counts["validation"]:
            raise ConfigError(
                f"no lines in the window {window['start']}..{window['end']} of {config.dataset_root} to hold out",
                path=config.source,
            )
        atomic_write_json(mark, {**window, **counts, "every": HOLDOUT_EVERY})
    local = {k: v for k, v in _base_values(config).items() if k not in ("HDFS_ADDRESS", "HDFS_UGI")}
    local["DATA_FORMAT"] = "text"
    train_values = {**local, "DATASET_PATH": str(train_root.resolve())}
    validation_config = output / "validation.config"
    atomic_write_text(
        validation_config,
        config_text(
            {
                **local,
                "DATASET_PATH": str(validation_root.resolve()),
                "START_DATE_HR": window["start"],
                "END_DATE_HR": window["end"],
            }
        ),
    )
    how = f"every {HOLDOUT_EVERY}th line of {window['start']}..{window['end']} held out"
    return Split(
        train_values,
        config.start,
        config.end,
        validation_config,
        how,
        _base_values(config),
        config.start,
        config.end,
        holds_lines_out=True,
    )


def _split_done(mark: Path, window: dict) -> bool:
    import json

    try:
        done = json.loads(mark.read_text())
    except (OSError, ValueError):
        return False
    return all(done.get(k) == v for k, v in window.items())


def _copy_split(config: DataConfig, train_root: Path, validation_root: Path) -> dict:
    """Copy each ready hour of the window, its lines in file order, every HOLDOUT_EVERY-th to validation."""
    counts = {"train": 0, "validation": 0}
    for hour, lines in hour_lines(config):
        held = lines[HOLDOUT_EVERY - 1 :: HOLDOUT_EVERY]
        train = [ln for i, ln in enumerate(lines) if i % HOLDOUT_EVERY != HOLDOUT_EVERY - 1]
        write_hour(train_root, hour, train)
        write_hour(validation_root, hour, held)
        counts["train"] += len(train)
        counts["validation"] += len(held)
    return counts


def hour_lines(config: DataConfig):
    """(hour, its non-empty text lines in file order) for each ready hour of a config's window."""
    for part in HourlyData(dataclasses.replace(config, pass_hours=1)).partitions():
        lines: list[str] = []
        for name in part.files:
            path = f"{part.location.path}/{name}"
            for chunk in iter_text_chunks(part.location.fs, path, path, 8192):
                lines += [ln.rstrip("\n") for ln in chunk if ln.strip()]
        yield part.hour, lines


def lines_of(config: DataConfig) -> list[str]:
    """Every non-empty text line of a config's window (logistic regression's input)."""
    return [ln for _, lines in hour_lines(config) for ln in lines]
