"""Write slot-format lines into the hourly layout, each hour sealed by its donefile.

Used by the Criteo converter and the synthetic generator. Part files are
written atomically and the hour's donefile last, so a reader never sees a
half-written hour as complete. With ``minutes`` (PASS_MINUTES) an hour's lines
are spread over its sub-hour folders ``YYYYMMDD/HHMM``, each sealed by its own
donefile.
"""

from __future__ import annotations

import datetime as dt
import gzip
from collections.abc import Iterable
from pathlib import Path

from ctr_foundation.atomic import atomic_open, atomic_write_text
from elastic_control.config.data_config import slot_path
from elastic_control.data.readers import HOUR_DONEFILE


def hour_dir(root: str | Path, hour: dt.datetime, minutes: int | None = None) -> Path:
    """The folder of an hour, or with ``minutes`` of the sub-hour slot starting at ``hour``."""
    return Path(root) / slot_path(hour, minutes)


def hour_slots(hour: dt.datetime, minutes: int | None) -> list[dt.datetime]:
    """The starts of the sub-hour slots of ``hour`` (just the hour without ``minutes``)."""
    if not minutes:
        return [hour]
    return [hour + dt.timedelta(minutes=m) for m in range(0, 60, minutes)]


def split_hour(lines: list, minutes: int | None) -> list[list]:
    """An hour's lines cut into its slots, in order (contiguous, sizes as even as possible)."""
    n = len(hour_slots(dt.datetime(2000, 1, 1), minutes))
    bounds = [round(i * len(lines) / n) for i in range(n + 1)]
    return [lines[bounds[i] : bounds[i + 1]] for i in range(n)]


def write_hour(
    root: str | Path,
    hour: dt.datetime,
    lines: Iterable[str],
    *,
    parts: int = 2,
    compress: bool = False,
    minutes: int | None = None,
) -> Path:
    """Write ``lines`` round-robin into ``parts`` files of one hour, then its donefile; return the folder.

    With ``minutes`` the lines are cut into the hour's slots, each written the same way (folders in time
    order, each sealed by its donefile); the last slot's folder is returned.
    """
    if minutes:
        folder = Path(root)
        for slot, chunk in zip(hour_slots(hour, minutes), split_hour(list(lines), minutes), strict=True):
            folder = write_folder(hour_dir(root, slot, minutes), chunk, parts=parts, compress=compress)
        return folder
    return write_folder(hour_dir(root, hour), lines, parts=parts, compress=compress)


def write_folder(folder: Path, lines: Iterable[str], *, parts: int = 2, compress: bool = False) -> Path:
    """Write ``lines`` round-robin into ``parts`` files of one data folder, then its donefile."""
    folder.mkdir(parents=True, exist_ok=True)
    buckets: list[list[str]] = [[] for _ in range(parts)]
    for i, line in enumerate(lines):
        buckets[i % parts].append(line)
    for i, bucket in enumerate(buckets):
        name = f"part-{i:05d}" + (".gz" if compress else "")
        text = "".join(ln + "\n" for ln in bucket)
        if compress:
            with atomic_open(folder / name, "wb") as f:
                f.write(gzip.compress(text.encode("utf-8"), compresslevel=6))
        else:
            atomic_write_text(folder / name, text)
    atomic_write_text(folder / HOUR_DONEFILE, f"{sum(len(b) for b in buckets)}\n")
    return folder
