"""Raw Criteo Display Advertising TSV -> slot-format lines in the hourly layout.

Input lines: ``label I1..I13 C1..C26`` separated by TABs (empty = missing).
Integer feature k goes to slot k (1-13), bucketised on a log scale because
counts are heavy-tailed; categorical feature k goes to slot 13+k (14-39).
A missing value is a value of its own ("NA"): missingness carries signal.
feasign = a stable 64-bit hash of (slot, value), so values above 2**63 occur.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable, Iterator
from pathlib import Path

from ctr_foundation.errors import DataError
from elastic_control.data.hourly_writer import write_hour
from elastic_control.data.synth import stable_feasign

INTEGER_FEATURES = 13
CATEGORICAL_FEATURES = 26
FIELDS = 1 + INTEGER_FEATURES + CATEGORICAL_FEATURES
INTEGER_SLOTS = tuple(range(1, 1 + INTEGER_FEATURES))
CATEGORICAL_SLOTS = tuple(range(1 + INTEGER_FEATURES, 1 + INTEGER_FEATURES + CATEGORICAL_FEATURES))
MISSING = "NA"


def bucketize_integer(text: str) -> str:
    """Log-scale bucket of a Criteo integer feature: small values kept, larger ones by floor(ln(v)^2)."""
    if text == "":
        return MISSING
    v = int(text)
    if v < 0:
        return "neg"
    if v <= 2:
        return str(v)
    return f"L{int(math.log(v) ** 2)}"


class CriteoConverter:
    """Converts raw lines; caches the hash of each (slot, value) since values repeat a lot."""

    def __init__(self):
        self._cache: dict[tuple[int, str], int] = {}

    def feasign(self, slot: int, value: str) -> int:
        key = (slot, value)
        f = self._cache.get(key)
        if f is None:
            f = self._cache[key] = stable_feasign("criteo", slot, value)
        return f

    def convert_line(self, raw: str) -> str:
        """One raw Criteo line -> ``1 label feasign:slot ...``; ValueError naming the problem."""
        fields = raw.rstrip("\r\n").split("\t")
        if len(fields) != FIELDS:
            raise ValueError(f"{len(fields)} TAB-separated fields, expected {FIELDS}")
        if fields[0] not in ("0", "1"):
            raise ValueError(f"label {fields[0]!r} is not 0 or 1")
        toks = [f"1 {fields[0]}"]
        for slot, text in zip(INTEGER_SLOTS, fields[1 : 1 + INTEGER_FEATURES], strict=True):
            try:
                value = bucketize_integer(text.strip())
            except ValueError:
                raise ValueError(f"integer feature I{slot} = {text!r} is not an integer") from None
            toks.append(f"{self.feasign(slot, value)}:{slot}")
        for slot, text in zip(CATEGORICAL_SLOTS, fields[1 + INTEGER_FEATURES :], strict=True):
            toks.append(f"{self.feasign(slot, text.strip() or MISSING)}:{slot}")
        return " ".join(toks)


def read_raw_lines(path: str | Path) -> Iterator[str]:
    import gzip

    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: input file not found")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        yield from f


def convert_file(
    input_path: str | Path,
    output: str | Path,
    *,
    hours: int,
    start: dt.datetime,
    parts: int = 2,
    max_bad_fraction: float = 0.01,
    progress: Callable[[int], None] | None = None,
    minutes: int | None = None,
) -> dict:
    """Convert a raw Criteo file into ``hours`` consecutive hours (lines split evenly, in file order).

    ``minutes`` (PASS_MINUTES) spreads each hour over its sub-hour folders ``YYYYMMDD/HHMM``.
    """
    if hours < 1:
        raise DataError(f"--hours must be at least 1, got {hours}")
    conv = CriteoConverter()
    lines: list[str] = []
    bad, first_bad = 0, ""
    for lineno, raw in enumerate(read_raw_lines(input_path), start=1):
        if not raw.strip():
            continue
        try:
            lines.append(conv.convert_line(raw))
        except ValueError as e:
            bad += 1
            first_bad = first_bad or f"{input_path}:{lineno}: {e}"
        if progress and lineno % 10_000 == 0:
            progress(10_000)
    total = len(lines) + bad
    if total == 0:
        raise DataError(f"{input_path}: no lines to convert")
    if bad / total > max_bad_fraction:
        raise DataError(
            f"{input_path}: {bad} of {total} lines are not raw Criteo ({bad / total:.2%}); first: {first_bad}"
        )
    per_hour = math.ceil(len(lines) / hours)
    positives = sum(1 for ln in lines if ln[2] == "1")
    for h in range(hours):
        hour_lines = lines[h * per_hour : (h + 1) * per_hour]
        write_hour(output, start + dt.timedelta(hours=h), hour_lines, parts=parts, minutes=minutes)
    return {
        "lines": len(lines),
        "bad_lines": bad,
        "hours": hours,
        "lines_per_hour": per_hour,
        "ctr": positives / len(lines) if lines else 0.0,
        "start": f"{start:%Y%m%d/%H}",
        "slots": list(INTEGER_SLOTS + CATEGORICAL_SLOTS),
    }
