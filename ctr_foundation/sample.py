"""The slot text format and the key transform, shared by trainer, cube and serving.

A line is ``$show $click $feasign:$slot $feasign:$slot ...``; a feasign is an
unsigned 64-bit integer (values above 2**63 occur). A token whose left part is
a decimal number that is not a plain unsigned integer (``2.5:40``, ``-3:41``)
is a *value* token: the value of a dense slot (ctr_foundation/dense_features.py). The key stored in the
sparse table is ``feasign % SPARSE_DIM`` when SPARSE_DIM is set (the original
behaviour), else the full feasign. Paddle ids are int64, so the uint64 key's
bits are reinterpreted as int64 on the way in, in every component.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

UINT64_MAX = (1 << 64) - 1


# A value token's number, ASCII only: a decimal number that is NOT a plain unsigned integer (a sign, a point
# or an exponent; what Python's float() reads minus inf/nan, underscores and spaces). No alternative can match
# the same digits two ways, so a long digit run costs linear time to refuse (no quadratic backtracking on
# hostile input). Serving's strict line checks build on it.
VALUE_NUMBER = (
    r"(?:[-+](?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?"
    r"|(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?"
    r"|[0-9]+[eE][-+]?[0-9]+)"
)
_VALUE_NUMBER_OK = re.compile(VALUE_NUMBER, re.ASCII)


class MalformedLine(ValueError):
    """A line that is not in the slot format; readers count and skip these."""


def feasign_above_uint64(digits: str) -> str:
    """What is wrong with a feasign written as ``digits`` (ASCII digits) above 2**64-1, in the words every
    reader of the format uses."""
    shown = digits if len(digits) <= 40 else f"{digits[:20]}...({len(digits)} digits)"
    return f"feasign {shown} is above 2**64-1 (the largest unsigned 64-bit integer, {UINT64_MAX})"


@dataclass(frozen=True)
class Sample:
    show: int
    click: int
    feasigns: tuple[int, ...]
    slots: tuple[int, ...]
    # value tokens (``2.5:40``): the values of dense slots, and their slots
    values: tuple[float, ...] = ()
    value_slots: tuple[int, ...] = ()


def parse_sample_line(line: str) -> Sample:
    """Parse one slot-format line; raise MalformedLine naming what is wrong."""
    parts = line.split()
    if len(parts) < 2:
        raise MalformedLine("expected '$show $click $feasign:$slot ...'")
    try:
        show, click = int(parts[0]), int(parts[1])
    except ValueError:
        raise MalformedLine(f"show/click {parts[0]!r} {parts[1]!r} are not integers") from None
    if click not in (0, 1) or show < 0:
        raise MalformedLine(f"click must be 0 or 1 and show >= 0, got show={show} click={click}")
    feasigns, slots, values, value_slots = [], [], [], []
    for tok in parts[2:]:
        f, sep, s = tok.partition(":")
        if not sep:
            raise MalformedLine(f"feature {tok!r} is not feasign:slot")
        try:
            sv = int(s)
        except ValueError:
            raise MalformedLine(f"feature {tok!r}: slot {s!r} is not an integer") from None
        if sv < 0:
            raise MalformedLine(f"feature {tok!r}: slot must be >= 0")
        if f.isascii() and f.isdigit():
            if len(f) > len(str(UINT64_MAX)) or int(f) > UINT64_MAX:  # int() refuses 4300+ digits
                raise MalformedLine(f"feature {tok[:60]!r}: {feasign_above_uint64(f)}")
            fv = int(f)
            feasigns.append(fv)
            slots.append(sv)
            continue
        try:
            value = float(f)
        except ValueError:
            raise MalformedLine(f"feature {tok!r} is not feasign:slot (integer) or value:slot (number)") from None
        if not math.isfinite(value) or not _VALUE_NUMBER_OK.fullmatch(f):
            raise MalformedLine(f"feature {tok!r}: a dense value must be a finite decimal number")
        values.append(value)
        value_slots.append(sv)
    return Sample(show, click, tuple(feasigns), tuple(slots), tuple(values), tuple(value_slots))


def feasign_to_key(feasign: int, sparse_dim: int | None) -> int:
    """The sparse-table key (uint64 value as a Python int)."""
    return feasign % sparse_dim if sparse_dim else feasign


def keys_to_paddle_ids(keys: np.ndarray) -> np.ndarray:
    """Reinterpret uint64 keys as the int64 ids Paddle takes (same bits)."""
    return np.ascontiguousarray(keys, dtype=np.uint64).view(np.int64)


def paddle_ids_to_keys(ids: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(ids, dtype=np.int64).view(np.uint64)


def transform_keys(feasigns: np.ndarray, sparse_dim: int | None) -> np.ndarray:
    """Vectorised key transform on a uint64 array."""
    feasigns = np.asarray(feasigns, dtype=np.uint64)
    return feasigns % np.uint64(sparse_dim) if sparse_dim else feasigns


# A slot with no feature in a line gets this one feasign, so that no LoD
# sequence is ever empty. Trainer, evaluation and serving all apply it.
PADDING_FEASIGN = 0


def slot_keys(sample: Sample, slots: tuple[int, ...] | list[int], sparse_dim: int | None) -> list[np.ndarray]:
    """Per slot (in slot.conf order) the uint64 keys of a sample, padding applied.

    Features of slots not in ``slots`` are ignored, as in training.
    """
    pos = {s: i for i, s in enumerate(slots)}
    per_slot: list[list[int]] = [[] for _ in slots]
    for f, s in zip(sample.feasigns, sample.slots, strict=True):
        i = pos.get(s)
        if i is not None:
            per_slot[i].append(f)
    out = []
    for feas in per_slot:
        if not feas:
            feas = [PADDING_FEASIGN]
        out.append(transform_keys(np.array(feas, dtype=np.uint64), sparse_dim))
    return out
