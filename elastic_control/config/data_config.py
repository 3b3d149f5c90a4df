"""data.config: bash-style ``export KEY="VALUE"`` lines, parsed in Python (never sourced).

Supported syntax, per line: ``export KEY=VALUE``, ``KEY=VALUE``, values bare,
"double-quoted" (``${VAR}`` / ``$VAR`` expanded from earlier keys, then the
environment) or 'single-quoted' (literal); blank lines and ``#`` comments.
"""

from __future__ import annotations

import datetime as dt
import difflib
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ctr_foundation.errors import ConfigError

KNOWN_KEYS = (
    "HDFS_ADDRESS",
    "HDFS_UGI",
    "START_DATE_HR",
    "END_DATE_HR",
    "DATASET_PATH",
    "SPARSE_DIM",
    "DATA_FORMAT",
    "ONLINE",
    "MODEL_PATH",
    "MAX_BAD_LINE_FRACTION",
    "MODEL",
    "EPOCHS",
    "EARLY_STOP",
    # Incremental rollouts: delta passes, admission, eviction, sub-hour passes; multi-hour passes.
    "DELTA_PASSES",
    "BASE_EVERY",
    "ADMIT_MIN_COUNT",
    "EVICT_AFTER_PASSES",
    "PASS_MINUTES",
    "PASS_HOURS",
)
# MODEL= choices (elastic_control.training.families.FAMILIES; kept here so parsing imports no training code).
MODEL_FAMILIES = ("dnn", "wide_deep", "deepfm", "dcn")
MAX_EPOCHS = 1000
REQUIRED_KEYS = ("START_DATE_HR", "END_DATE_HR", "DATASET_PATH")
DATE_HR_FORMAT = "%Y%m%d/%H"
DATE_HR_MIN_FORMAT = "%Y%m%d/%H%M"
DEFAULT_BASE_EVERY = 24
# Minutes a sub-hour pass may last: a divisor of 60, so that every hour splits into whole passes.
PASS_MINUTES_CHOICES = (1, 2, 3, 4, 5, 6, 10, 12, 15, 20, 30)
# Hours one pass may cover with PASS_HOURS (a week: a backfill of history in a few passes).
MAX_PASS_HOURS = 168
# Paddle's text save prints show counts with 6 significant digits: counts are exact up to 999999.
MAX_ADMIT_MIN_COUNT = 1_000_000

_LINE = re.compile(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


@dataclass(frozen=True)
class DataConfig:
    start: dt.datetime
    end: dt.datetime
    dataset_path: str
    hdfs_address: str = ""
    hdfs_ugi: str = ""
    sparse_dim: int | None = None
    data_format: str = "text"
    online: bool = False
    model_path: str | None = None
    max_bad_line_fraction: float = 0.01
    model: str | None = None  # MODEL: the model family; None = the trainer's default
    epochs: int | str | None = None  # EPOCHS: passes over each pass's data, or "auto"; None = the default
    early_stop: bool | None = None  # EARLY_STOP: stop a pass's epochs when held-out log loss rises
    # Incremental rollouts (docs/contracts.md, "Delta passes"): a base pass every base_every passes, deltas
    # between; admission after admit_min_count sightings; eviction after evict_after_passes passes unseen.
    delta_passes: bool = False
    base_every: int = DEFAULT_BASE_EVERY
    admit_min_count: int | None = None
    evict_after_passes: int | None = None
    pass_minutes: int | None = None  # sub-hour passes: data folders YYYYMMDD/HHMM, one pass each
    pass_hours: int = 1  # PASS_HOURS: consecutive hourly folders trained as one pass (backfills of history)
    source: str = "data.config"
    values: Mapping[str, str] = field(default_factory=dict)

    @property
    def dataset_root(self) -> str:
        """Where the hourly folders live: HDFS_ADDRESS + DATASET_PATH (or the path alone)."""
        if self.hdfs_address:
            return self.hdfs_address.rstrip("/") + "/" + self.dataset_path.lstrip("/")
        return self.dataset_path

    def hours(self) -> Iterator[dt.datetime]:
        """Every hour from START_DATE_HR to END_DATE_HR inclusive, in order."""
        t = self.start
        while t <= self.end:
            yield t
            t += dt.timedelta(hours=1)

    def hour_dir(self, hour: dt.datetime) -> str:
        return f"{self.dataset_root.rstrip('/')}/{slot_path(hour, self.pass_minutes)}"

    @property
    def step(self) -> dt.timedelta:
        """How much data one pass covers: an hour, or PASS_MINUTES."""
        return dt.timedelta(minutes=self.pass_minutes or 60)

    def slots(self) -> Iterator[dt.datetime]:
        """The start of every pass's slot from ``start`` to ``end`` inclusive: hours, or PASS_MINUTES slots.

        With PASS_MINUTES, ``end`` is the LAST slot of END_DATE_HR's hour (END_DATE_HR=20191221/01 with
        15-minute passes: 20191221/0145), so the window covers whole hours.
        """
        t = self.start
        while t <= self.end:
            yield t
            t += self.step

    def pass_windows(self, *, endless: bool = False) -> Iterator[tuple[dt.datetime, dt.datetime]]:
        """(first, last) slot of every pass from ``start`` to ``end``: one slot each, or with PASS_HOURS=N
        groups of N hours from START_DATE_HR (the last group ends at END_DATE_HR, so it may be shorter).
        ``endless`` (online): whole groups on past ``end``, without stopping."""
        span = self.step * self.pass_hours
        t = self.start
        while endless or t <= self.end:
            last = t + span - self.step
            yield t, last if endless else min(last, self.end)
            t += span

    def format_slot(self, t: dt.datetime) -> str:
        """``YYYYMMDD/HH``, or ``YYYYMMDD/HHMM`` with PASS_MINUTES (how windows and data folders name it)."""
        return format_slot(t, self.pass_minutes)

    @property
    def incremental(self) -> bool:
        """Any of delta passes, admission, eviction: the trainer's incremental export is on."""
        return self.delta_passes or self.admit_min_count is not None or self.evict_after_passes is not None

    def with_window(self, start: dt.datetime, end: dt.datetime) -> DataConfig:
        from dataclasses import replace

        return replace(self, start=start, end=end)

    def to_text(self) -> str:
        return "".join(f'export {k}="{v}"\n' for k, v in self.values.items())


def format_hour(hour: dt.datetime) -> str:
    return hour.strftime(DATE_HR_FORMAT)


def format_slot(t: dt.datetime, minutes: int | None) -> str:
    return t.strftime(DATE_HR_MIN_FORMAT if minutes else DATE_HR_FORMAT)


def slot_path(t: dt.datetime, minutes: int | None) -> str:
    """The data folder of a slot under DATASET_PATH: ``YYYYMMDD/HH`` or, with sub-hour passes, ``YYYYMMDD/HHMM``."""
    return t.strftime("%Y%m%d/%H%M" if minutes else "%Y%m%d/%H")


def parse_slot(text: str, *, key: str = "date", source: str = "data.config") -> dt.datetime:
    """``YYYYMMDD/HH`` or ``YYYYMMDD/HHMM`` (how pass windows name hours and sub-hour slots)."""
    if re.fullmatch(r"\d{8}/\d{4}", text or ""):
        try:
            return dt.datetime.strptime(text, DATE_HR_MIN_FORMAT)
        except ValueError:
            pass
        raise ConfigError(f"{key}={text!r} is not a date and time in the format YYYYMMDD/HHMM", path=source)
    return parse_hour(text, key=key, source=source)


def parse_hour(text: str, *, key: str = "date", source: str = "data.config", line: int | None = None) -> dt.datetime:
    try:
        if not re.fullmatch(r"\d{8}/\d{2}", text):
            raise ValueError
        return dt.datetime.strptime(text, DATE_HR_FORMAT)
    except ValueError:
        raise ConfigError(
            f"{key}={text!r} is not a date and hour in the format YYYYMMDD/HH (e.g. 20191221/00)",
            path=source,
            line=line,
        ) from None


def _unquote(raw: str, values: Mapping[str, str], env: Mapping[str, str], source: str, lineno: int) -> str:
    raw = raw.strip()
    # Trailing comment after an unquoted value or after a closing quote.
    if raw.startswith("'"):
        end = raw.find("'", 1)
        if end < 0:
            raise ConfigError(f"unterminated single quote in {raw!r}", path=source, line=lineno)
        rest = raw[end + 1 :].strip()
        if rest and not rest.startswith("#"):
            raise ConfigError(f"unexpected text after the quoted value: {rest!r}", path=source, line=lineno)
        return raw[1:end]
    if raw.startswith('"'):
        end = raw.find('"', 1)
        if end < 0:
            raise ConfigError(f"unterminated double quote in {raw!r}", path=source, line=lineno)
        rest = raw[end + 1 :].strip()
        if rest and not rest.startswith("#"):
            raise ConfigError(f"unexpected text after the quoted value: {rest!r}", path=source, line=lineno)
        body = raw[1:end]
    else:
        body = raw.split(" #", 1)[0].strip()
        if any(c.isspace() for c in body):
            raise ConfigError(f"value {body!r} contains spaces; quote it", path=source, line=lineno)
        if any(c in body for c in "`;|&<>()"):
            raise ConfigError(f"value {body!r} uses shell syntax this parser does not run", path=source, line=lineno)
    if "$(" in body or "`" in body:
        raise ConfigError(
            f"command substitution in {body!r} is not supported (data.config is parsed, never run)",
            path=source,
            line=lineno,
        )

    def expand(m: re.Match) -> str:
        name = m.group(1) or m.group(3)
        if values.get(name):
            return values[name]
        if env.get(name):
            return env[name]
        if m.group(2) is not None:  # ${VAR:-default}
            return m.group(2)
        if name in values or name in env:
            return ""
        raise ConfigError(
            f"${{{name}}} is not defined earlier in the file nor in the environment", path=source, line=lineno
        )

    return _VAR.sub(expand, body)


def parse_data_config(text: str, source: str = "data.config", env: Mapping[str, str] | None = None) -> DataConfig:
    env = os.environ if env is None else env
    values: dict[str, str] = {}
    lines: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        m = _LINE.match(stripped)
        if not m:
            raise ConfigError(f'cannot parse {stripped!r} (expected: export KEY="VALUE")', path=source, line=lineno)
        key, rawvalue = m.group(1), m.group(2)
        if key not in KNOWN_KEYS:
            close = difflib.get_close_matches(key, KNOWN_KEYS, n=1, cutoff=0.75)
            if close:
                raise ConfigError(f"unknown key {key!r}; did you mean {close[0]!r}?", path=source, line=lineno)
        values[key] = _unquote(rawvalue, values, env, source, lineno)
        lines[key] = lineno

    for key in REQUIRED_KEYS:
        if not values.get(key):
            raise ConfigError(f"{key} is missing (required keys: {', '.join(REQUIRED_KEYS)})", path=source)

    start = parse_hour(values["START_DATE_HR"], key="START_DATE_HR", source=source, line=lines["START_DATE_HR"])
    end = parse_hour(values["END_DATE_HR"], key="END_DATE_HR", source=source, line=lines["END_DATE_HR"])
    if end < start:
        raise ConfigError(
            f"END_DATE_HR {values['END_DATE_HR']} is before START_DATE_HR {values['START_DATE_HR']}",
            path=source,
            line=lines["END_DATE_HR"],
        )

    sparse_dim = None
    if values.get("SPARSE_DIM"):
        try:
            sparse_dim = int(values["SPARSE_DIM"])
            if sparse_dim <= 0:
                raise ValueError
        except ValueError:
            raise ConfigError(
                f"SPARSE_DIM={values['SPARSE_DIM']!r} must be a positive integer (or unset for full 64-bit feasigns)",
                path=source,
                line=lines["SPARSE_DIM"],
            ) from None

    data_format = values.get("DATA_FORMAT", "text") or "text"
    if data_format not in ("text", "parquet"):
        raise ConfigError(
            f"DATA_FORMAT={data_format!r} must be 'text' or 'parquet'", path=source, line=lines["DATA_FORMAT"]
        )

    online_raw = values.get("ONLINE", "0") or "0"
    if online_raw.lower() not in ("0", "1", "true", "false", "yes", "no"):
        raise ConfigError(f"ONLINE={online_raw!r} must be 0 or 1", path=source, line=lines["ONLINE"])

    fraction = 0.01
    if values.get("MAX_BAD_LINE_FRACTION"):
        try:
            fraction = float(values["MAX_BAD_LINE_FRACTION"])
            if not 0 <= fraction <= 1:
                raise ValueError
        except ValueError:
            raise ConfigError(
                f"MAX_BAD_LINE_FRACTION={values['MAX_BAD_LINE_FRACTION']!r} must be a number in [0, 1]",
                path=source,
                line=lines["MAX_BAD_LINE_FRACTION"],
            ) from None

    model = values.get("MODEL") or None
    if model is not None and model not in MODEL_FAMILIES:
        close = difflib.get_close_matches(model, MODEL_FAMILIES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"MODEL={model!r} is not a model family (one of {', '.join(MODEL_FAMILIES)}){hint}",
            path=source,
            line=lines["MODEL"],
        )
    epochs = parse_epochs(values["EPOCHS"], source=source, line=lines["EPOCHS"]) if values.get("EPOCHS") else None
    early_raw = (values.get("EARLY_STOP") or "").lower()
    if early_raw not in ("", "0", "1", "true", "false", "yes", "no"):
        raise ConfigError(f"EARLY_STOP={early_raw!r} must be 0 or 1", path=source, line=lines["EARLY_STOP"])
    early_stop = None if not early_raw else early_raw in ("1", "true", "yes")
    incremental = _parse_incremental(values, lines, source)
    if incremental["pass_minutes"]:
        end = end + dt.timedelta(hours=1) - dt.timedelta(minutes=incremental["pass_minutes"])

    return DataConfig(
        start=start,
        end=end,
        dataset_path=values["DATASET_PATH"],
        hdfs_address=values.get("HDFS_ADDRESS", ""),
        hdfs_ugi=values.get("HDFS_UGI", ""),
        sparse_dim=sparse_dim,
        data_format=data_format,
        online=online_raw.lower() in ("1", "true", "yes"),
        model_path=values.get("MODEL_PATH") or None,
        max_bad_line_fraction=fraction,
        model=model,
        epochs=epochs,
        early_stop=early_stop,
        **incremental,
        source=source,
        values=dict(values),
    )


def parse_epochs(text: str, *, source: str = "data.config", line: int | None = None, key: str = "EPOCHS") -> int | str:
    """EPOCHS: a whole number of epochs per pass (1..MAX_EPOCHS) or ``auto``."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        n = int(text)
        if not 1 <= n <= MAX_EPOCHS:
            raise ValueError
    except ValueError:
        raise ConfigError(
            f"{key}={text!r} must be 'auto' or a whole number of epochs per pass in 1..{MAX_EPOCHS}",
            path=source,
            line=line,
        ) from None
    return n


_BOOL_TRUE, _BOOL_FALSE = ("1", "true", "yes"), ("0", "false", "no")


def _int_key(values, lines, source, key: str, low: int, high: int, meaning: str) -> int | None:
    raw = values.get(key, "")
    if raw == "":
        return None
    try:
        v = int(raw)
        if not low <= v <= high:
            raise ValueError
    except ValueError:
        raise ConfigError(
            f"{key}={raw!r} must be an integer from {low} to {high} ({meaning})", path=source, line=lines.get(key)
        ) from None
    return v


def _parse_incremental(values: Mapping[str, str], lines: Mapping[str, int], source: str) -> dict:
    """DELTA_PASSES, BASE_EVERY, ADMIT_MIN_COUNT, EVICT_AFTER_PASSES, PASS_MINUTES, PASS_HOURS (docs/contracts.md)."""
    minutes = None
    if values.get("PASS_MINUTES"):
        raw = values["PASS_MINUTES"]
        try:
            minutes = int(raw)
        except ValueError:
            minutes = -1
        if minutes not in PASS_MINUTES_CHOICES:
            raise ConfigError(
                f"PASS_MINUTES={raw!r} must divide the hour: one of {', '.join(map(str, PASS_MINUTES_CHOICES))} "
                "(unset for hourly passes)",
                path=source,
                line=lines.get("PASS_MINUTES"),
            )
    raw = (values.get("DELTA_PASSES") or "").lower()
    if raw and raw not in _BOOL_TRUE + _BOOL_FALSE:
        raise ConfigError(f"DELTA_PASSES={raw!r} must be 0 or 1", path=source, line=lines.get("DELTA_PASSES"))
    # Sub-hour passes are deltas unless DELTA_PASSES=0 says otherwise: a whole table every few minutes is
    # what incremental rollouts exist to avoid.
    delta = raw in _BOOL_TRUE if raw else minutes is not None
    base_every = _int_key(values, lines, source, "BASE_EVERY", 1, 100_000, "a base pass every N passes")
    admit = _int_key(
        values, lines, source, "ADMIT_MIN_COUNT", 1, MAX_ADMIT_MIN_COUNT, "sightings before a feasign is trained"
    )
    evict = _int_key(
        values, lines, source, "EVICT_AFTER_PASSES", 1, 100_000, "passes unseen before a feasign is removed"
    )
    hours = _int_key(values, lines, source, "PASS_HOURS", 1, MAX_PASS_HOURS, "consecutive hours trained as one pass")
    if hours and hours > 1 and minutes is not None:
        raise ConfigError(
            f"PASS_HOURS={values['PASS_HOURS']!r} and PASS_MINUTES={values['PASS_MINUTES']!r} cannot both be set: "
            "a pass covers several hours or a part of one (unset one of them)",
            path=source,
            line=lines.get("PASS_HOURS"),
        )
    return {
        "pass_hours": hours or 1,
        "delta_passes": delta,
        "base_every": base_every or DEFAULT_BASE_EVERY,
        "admit_min_count": admit if admit and admit > 1 else None,
        "evict_after_passes": evict,
        "pass_minutes": minutes,
    }


def load_data_config(path: str | Path, env: Mapping[str, str] | None = None) -> DataConfig:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("file not found (pass the data description with -f/--datafile)", path=str(path)) from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read: {e}", path=str(path)) from e
    return parse_data_config(text, str(path), env)
