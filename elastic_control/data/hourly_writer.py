"""Write slot-format lines into the hourly layout, each hour sealed by its donefile.

Used by the Criteo converter and the synthetic generator. Part files are
written atomically and the hour's donefile last, so a reader never sees a
half-written hour as complete.
"""

from __future__ import annotations

import datetime as dt
import gzip
from collections.abc import Iterable
from pathlib import Path

from ctr_foundation.atomic import atomic_open, atomic_write_text
from elastic_control.data.readers import HOUR_DONEFILE


def hour_dir(root: str | Path, hour: dt.datetime) -> Path:
    return Path(root) / f"{hour:%Y%m%d}" / f"{hour:%H}"


def write_hour(
    root: str | Path, hour: dt.datetime, lines: Iterable[str], *, parts: int = 2, compress: bool = False
) -> Path:
    """Write ``lines`` round-robin into ``parts`` files of one hour, then its donefile; return the folder."""
    folder = hour_dir(root, hour)
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
