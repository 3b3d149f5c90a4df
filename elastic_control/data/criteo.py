"""Raw Criteo Display Advertising TSV -> slot-format lines in the hourly layout.

Input lines: ``label I1..I13 C1..C26`` separated by TABs (empty = missing).
Integer feature k goes to slot k (1-13), bucketised on a log scale because
counts are heavy-tailed; categorical feature k goes to slot 13+k (14-39).
A missing value is a value of its own ("NA"): missingness carries signal.
Integer feature k is also written as a number, ``log(1 + v)`` (``-log(1 - v)``
for the few negative counts), in dense slot 39+k (40-52; a missing value has
no token): the network then also sees the count's order, which the buckets
alone lose (CHANGELOG.md, "Dense slots: the counts as numbers"). ``slot_conf_text`` is the
slot.conf that trains on all of them.
feasign = a stable 64-bit hash of (slot, value), so values above 2**63 occur.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable, Iterator
from pathlib import Path

from ctr_foundation.atomic import atomic_write_text
from ctr_foundation.errors import DataError
from elastic_control.data.hourly_writer import write_hour
from elastic_control.data.synth import stable_feasign

INTEGER_FEATURES = 13
CATEGORICAL_FEATURES = 26
FIELDS = 1 + INTEGER_FEATURES + CATEGORICAL_FEATURES
INTEGER_SLOTS = tuple(range(1, 1 + INTEGER_FEATURES))
CATEGORICAL_SLOTS = tuple(range(1 + INTEGER_FEATURES, 1 + INTEGER_FEATURES + CATEGORICAL_FEATURES))
DENSE_SLOTS = tuple(range(CATEGORICAL_SLOTS[-1] + 1, CATEGORICAL_SLOTS[-1] + 1 + INTEGER_FEATURES))
MISSING = "NA"
SLOT_CONF_FILE = "slot.conf"


def slot_conf_text() -> str:
    """The slot.conf of converted Criteo lines: the 39 sparse slots, then the 13 dense ones."""
    return (
        "# Criteo, as `elastic-control data criteo` writes it: I1-I13 bucketised (1-13), C1-C26 (14-39),\n"
        "# I1-I13 as log counts (40-52, dense)\n"
        + "".join(f"{s}\n" for s in INTEGER_SLOTS + CATEGORICAL_SLOTS)
        + "".join(f"{s} dense\n" for s in DENSE_SLOTS)
    )


def dense_integer(text: str) -> str | None:
    """The dense token's number for a Criteo integer feature: log(1 + v), signed; None when missing."""
    if text == "":
        return None
    v = int(text)
    x = math.log1p(v) if v >= 0 else -math.log1p(-v)
    text = f"{x:.6g}"
    # Always a value token (``0.0``, not ``0``): a reader that does not know the slot's kind (a peer
    # counting feasigns) can tell the numbers from the feasigns.
    return text if ("." in text or "e" in text) else text + ".0"


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
        numbers = []
        for slot, dense_slot, text in zip(INTEGER_SLOTS, DENSE_SLOTS, fields[1 : 1 + INTEGER_FEATURES], strict=True):
            try:
                value = bucketize_integer(text.strip())
                number = dense_integer(text.strip())
            except ValueError:
                raise ValueError(f"integer feature I{slot} = {text!r} is not an integer") from None
            toks.append(f"{self.feasign(slot, value)}:{slot}")
            if number is not None:
                numbers.append(f"{number}:{dense_slot}")
        for slot, text in zip(CATEGORICAL_SLOTS, fields[1 + INTEGER_FEATURES :], strict=True):
            toks.append(f"{self.feasign(slot, text.strip() or MISSING)}:{slot}")
        return " ".join(toks + numbers)


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
    atomic_write_text(Path(output) / SLOT_CONF_FILE, slot_conf_text())
    return {
        "lines": len(lines),
        "bad_lines": bad,
        "hours": hours,
        "lines_per_hour": per_hour,
        "ctr": positives / len(lines) if lines else 0.0,
        "start": f"{start:%Y%m%d/%H}",
        "slots": list(INTEGER_SLOTS + CATEGORICAL_SLOTS),
        "dense_slots": list(DENSE_SLOTS),
        "slot_conf": str(Path(output) / SLOT_CONF_FILE),
    }
