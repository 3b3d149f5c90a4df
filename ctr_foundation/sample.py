"""One slot-format line as a Sample, and the key transform, shared by trainer, cube and serving.

A line is ``$show $click $feasign:$slot $feasign:$slot ...`` (the grammar, its limits and its error
messages: slot_grammar.py); a feasign is an unsigned 64-bit integer (values above 2**63 occur). A token
whose left part is a decimal number that is not a plain unsigned integer (``2.5:40``, ``-3:41``)
is a *value* token: the value of a dense slot (ctr_foundation/dense_features.py). The key stored in the
sparse table is ``feasign % SPARSE_DIM`` when SPARSE_DIM is set (the original
behaviour), else the full feasign. Paddle ids are int64, so the uint64 key's
bits are reinterpreted as int64 on the way in, in every component.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# The grammar's owner is slot_grammar.py; these names stay importable from here, where they always were.
from ctr_foundation.slot_grammar import (  # noqa: F401
    LINE_OK,
    SHOW_LIMIT,
    UINT64_MAX,
    VALUE_NUMBER,
    MalformedLine,
    feasign_above_uint64,
    line_problem,
    show_above_int64,
    value_not_finite,
)


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
    """Parse one slot-format line (slot_grammar.py: the grammar); raise MalformedLine naming what is wrong."""
    if not LINE_OK.fullmatch(line):  # every digit bound, ASCII only: int() below never sees a long number
        raise MalformedLine(line_problem(line))
    parts = line.split()
    show = int(parts[0])
    if show >= SHOW_LIMIT:
        raise MalformedLine(show_above_int64(parts[0]))
    feasigns, slots, values, value_slots = [], [], [], []
    for tok in parts[2:]:
        f, _, s = tok.partition(":")
        if f.isdigit():
            fv = int(f)
            if fv > UINT64_MAX:
                raise MalformedLine(f"feature {tok[:60]!r}: {feasign_above_uint64(f)}")
            feasigns.append(fv)
            slots.append(int(s))
            continue
        value = float(f)  # VALUE_NUMBER (LINE_OK): float() reads it, maybe as inf (1e999)
        if not math.isfinite(value):
            raise MalformedLine(value_not_finite(tok))
        values.append(value)
        value_slots.append(int(s))
    return Sample(show, int(parts[1]), tuple(feasigns), tuple(slots), tuple(values), tuple(value_slots))


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
