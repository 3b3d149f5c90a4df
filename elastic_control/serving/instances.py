"""Request instances -> one flat KeyBatch, with the training program's key rules.

An instance is ``{"line": "<slot-format line>"}`` or ``{"slots": {"<slot>": [feasign, ...]}}``.
Lines follow training exactly: features of slots outside slot.conf are
ignored (the trainer ignores them too). The ``slots`` form is explicit, so an
unknown slot there is an error. In both forms a slot with no feature gets the
padding feasign (elastic_control/data/sample.py), and the key transform is
``feasign % sparse_dim`` when the version has one.

This builds the KeyBatch of elastic_control/scoring.py directly (one numpy
conversion per batch instead of one per slot and instance); a test checks it
equals ``scoring.batch_from_lines``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ctr_foundation.sample import PADDING_FEASIGN, UINT64_MAX, MalformedLine, parse_sample_line, transform_keys
from elastic_control.inference.scoring import KeyBatch

MAX_INSTANCES = 10_000


class InstanceError(ValueError):
    """A request that cannot be scored; the message names the instance and the problem (-> HTTP ``status``)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def instances_of(body: object) -> list:
    """The ``instances`` list of a decoded request body, checked for shape."""
    if not isinstance(body, dict) or "instances" not in body:
        raise InstanceError('the body must be a JSON object {"instances": [...]}')
    instances = body["instances"]
    if not isinstance(instances, list):
        raise InstanceError('"instances" must be a list')
    if not instances:
        raise InstanceError('"instances" is empty: nothing to predict')
    if len(instances) > MAX_INSTANCES:
        raise InstanceError(f"{len(instances)} instances in one request; at most {MAX_INSTANCES}", status=413)
    return instances


def _feasign(value: object, where: str) -> int:
    # bool is an int in Python but never a feasign.
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InstanceError(f"{where}: feasign {value!r} is not an integer")
    if isinstance(value, str):
        if not value.isdigit():
            raise InstanceError(f"{where}: feasign {value!r} is not an unsigned integer")
        value = int(value)
    if not 0 <= value <= UINT64_MAX:
        raise InstanceError(f"{where}: feasign {value} is outside the unsigned 64-bit range")
    return value


def build_key_batch(instances: Sequence[object], slots: Sequence[int], sparse_dim: int | None) -> KeyBatch:
    """Flatten instances into a KeyBatch for ``slots`` (slot.conf order); raise InstanceError on bad input."""
    pos = {s: i for i, s in enumerate(slots)}
    num_slots = len(slots)
    feasigns: list[int] = []
    rows: list[int] = []
    slot_pos: list[int] = []
    for r, inst in enumerate(instances):
        where = f"instance {r}"
        if not isinstance(inst, dict):
            raise InstanceError(f'{where}: expected an object {{"line": ...}} or {{"slots": {{...}}}}')
        present = [False] * num_slots
        if "line" in inst:
            line = inst["line"]
            if not isinstance(line, str):
                raise InstanceError(f'{where}: "line" must be a string')
            try:
                sample = parse_sample_line(line)
            except MalformedLine as e:
                raise InstanceError(f"{where}: {e}") from None
            for f, s in zip(sample.feasigns, sample.slots, strict=True):
                i = pos.get(s)
                if i is not None:
                    feasigns.append(f)
                    rows.append(r)
                    slot_pos.append(i)
                    present[i] = True
        elif "slots" in inst:
            given = inst["slots"]
            if not isinstance(given, dict) or not given:
                raise InstanceError(f'{where}: "slots" must be a non-empty object {{"<slot>": [feasign, ...]}}')
            for key, values in given.items():
                try:
                    i = pos[int(key)]
                except (ValueError, KeyError):
                    raise InstanceError(
                        f"{where}: unknown slot {key!r}; this model's slots are "
                        f"{list(slots)[:8]}{'...' if len(slots) > 8 else ''}"
                    ) from None
                if not isinstance(values, list):
                    values = [values]
                for v in values:
                    feasigns.append(_feasign(v, f"{where} slot {key}"))
                    rows.append(r)
                    slot_pos.append(i)
                    present[i] = True
        else:
            raise InstanceError(f'{where} is empty: give "line" or "slots"')
        for i, there in enumerate(present):
            if not there:  # the padding rule: no empty slot sequences, as in training
                feasigns.append(PADDING_FEASIGN)
                rows.append(r)
                slot_pos.append(i)
    keys = transform_keys(np.array(feasigns, dtype=np.uint64), sparse_dim)
    return KeyBatch(keys, np.array(rows, dtype=np.int64), np.array(slot_pos, dtype=np.int64), len(instances), num_slots)


def concat_batches(batches: Sequence[KeyBatch]) -> tuple[KeyBatch, list[int]]:
    """One KeyBatch for several requests (rows renumbered) and each request's first row."""
    offsets, n = [], 0
    for b in batches:
        offsets.append(n)
        n += b.n
    if len(batches) == 1:
        return batches[0], offsets
    merged = KeyBatch(
        np.concatenate([b.keys for b in batches]),
        np.concatenate([b.rows + off for b, off in zip(batches, offsets, strict=True)]),
        np.concatenate([b.slot_pos for b in batches]),
        n,
        batches[0].num_slots,
    )
    return merged, offsets
