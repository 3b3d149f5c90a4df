"""Request bodies and instances -> feature columns, validated per request before any merging.

An instance is ``{"line": "<slot-format line>"}`` or ``{"slots": {"<slot>": [feasign, ...]}}``.
Every request is parsed and checked on its own (issue 15: one client's bad feasign must never fail
another client's request of the same merged batch): feasigns are ASCII digits only (``str.isdigit``
is true for "²"), at most 20 of them, value below 2**64; JSON too deep or with integers too long for
Python to convert is a 400; too many instances a 413. What leaves here is a ``ParsedInstances``
(feature columns, no model needed); ``to_key_batch`` turns it into the shared KeyBatch with a
version's slots (inference/scoring.py: ``key_batch``, the one builder).

Lines follow training exactly (features of slots outside slot.conf are ignored, the trainer ignores
them too); the ``slots`` form is explicit, so an unknown slot there is an error. In both forms a slot
with no feature gets the padding feasign, and the key transform is ``feasign % sparse_dim`` when the
version has one.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ctr_foundation.http_json import parse_json
from ctr_foundation.http_messages import HttpError
from ctr_foundation.sample import UINT64_MAX
from elastic_control.data.line_batch import parse_lines
from elastic_control.inference.scoring import KeyBatch, key_batch, slot_positions

MAX_INSTANCES = 10_000
MAX_FEASIGN_DIGITS = 20
MAX_SLOT_DIGITS = 9
MAX_ROUTING_KEY = 256

# One valid line, ASCII only (re.ASCII: \d would accept any Unicode digit): show, click, feasign:slot pairs.
_LINE_OK = re.compile(r"[ \t]*[0-9]{1,20}[ \t]+[01](?:[ \t]+[0-9]{1,20}:[0-9]{1,9})*[ \t\r]*", re.ASCII)
_ARM_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}", re.ASCII)


class InstanceError(ValueError):
    """A request that cannot be scored; the message names the instance and the problem (-> HTTP ``status``)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class TooManyInstances(InstanceError):
    def __init__(self, message: str):
        super().__init__(message, 413)


@dataclass(frozen=True)
class ParsedInstances:
    """The features of one request's instances, instance after instance: ``counts[i]`` features of instance i.

    Small requests keep Python lists (numpy's per-call cost would dominate); ``concat_parsed`` turns the
    requests of a merged batch into arrays at once.
    """

    n: int
    counts: list | np.ndarray  # int [n]: features per instance
    feasigns: list | np.ndarray  # uint64 [m], raw (before the key transform)
    feature_slots: list | np.ndarray  # int [m]
    strict_rows: list | np.ndarray | None  # bool [n]: instances in the "slots" form (unknown slot = error); None: none

    @property
    def feature_row(self) -> np.ndarray:
        return np.repeat(np.arange(self.n, dtype=np.int64), np.asarray(self.counts, dtype=np.int64))


@dataclass(frozen=True)
class PredictRequest:
    parsed: ParsedInstances
    routing_key: str | None
    arm: str | None  # forced arm (QA), else None
    instances: list | None = None  # the raw JSON instances (after-response hooks), when parsed from JSON


def decode_json(body: bytes) -> object:
    """JSON of a request body through the shared parser (ctr_foundation.http_json: UTF-8, nesting depth,
    integer size); anything it refuses is an InstanceError with its status (400)."""
    try:
        return parse_json(body)
    except HttpError as e:
        raise InstanceError(e.message, e.status) from None


def predict_request(body: object) -> PredictRequest:
    """A decoded ``/v1/predict`` body -> its validated PredictRequest."""
    if not isinstance(body, dict) or "instances" not in body:
        raise InstanceError('the body must be a JSON object {"instances": [...]}')
    instances = body["instances"]
    if not isinstance(instances, list):
        raise InstanceError('"instances" must be a list')
    return PredictRequest(
        parse_instances(instances),
        routing_key_of(body.get("routing_key")),
        arm_of(body.get("arm")),
        instances,
    )


def routing_key_of(value: object) -> str | None:
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InstanceError('"routing_key" must be a string (or an integer)')
    value = str(value)
    if len(value) > MAX_ROUTING_KEY:
        raise InstanceError(f'"routing_key" is longer than {MAX_ROUTING_KEY} characters')
    return value


def arm_of(value: object) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str) or not _ARM_NAME.fullmatch(value):
        raise InstanceError('"arm" must be an arm name ([a-z0-9_-], at most 32 characters)')
    return value


def check_count(n: int) -> None:
    if n == 0:
        raise InstanceError('"instances" is empty: nothing to predict')
    if n > MAX_INSTANCES:
        raise TooManyInstances(f"{n} instances in one request; at most {MAX_INSTANCES}")


def parse_instances(instances: Sequence[object]) -> ParsedInstances:
    """Validate and flatten JSON instances; raise InstanceError naming the first bad one."""
    check_count(len(instances))
    columns = InstanceColumns(len(instances))
    for r, inst in enumerate(instances):
        if not isinstance(inst, dict):
            raise InstanceError(f'instance {r}: expected an object {{"line": ...}} or {{"slots": {{...}}}}')
        if "line" in inst:
            line = inst["line"]
            if not isinstance(line, str):
                raise InstanceError(f'instance {r}: "line" must be a string')
            columns.add_line(r, line)
        elif "slots" in inst:
            given = inst["slots"]
            if not isinstance(given, dict) or not given:
                raise InstanceError(f'instance {r}: "slots" must be a non-empty object {{"<slot>": [feasign, ...]}}')
            for key, values in given.items():
                if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= MAX_SLOT_DIGITS):
                    raise InstanceError(f"instance {r}: unknown slot {key!r}; slots are decimal integers")
                where = f"instance {r} slot {key}"
                values = values if isinstance(values, list) else [values]
                columns.add_slot(r, int(key), [feasign_value(v, where) for v in values])
        else:
            raise InstanceError(f'instance {r} is empty: give "line" or "slots"')
    return columns.build()


class InstanceColumns:
    """Collects one request's instances (lines and slot features, any order) into a ParsedInstances."""

    def __init__(self, n: int):
        self.n = n
        self.counts = [0] * n
        self.feasigns: list[int] = []
        self.slots: list[int] = []
        self.strict: list[bool] | None = None
        self.lines: list[str] = []
        self.line_rows: list[int] = []

    def add_line(self, row: int, line: str) -> None:
        self.lines.append(line)
        self.line_rows.append(row)

    def add_slot(self, row: int, slot: int, feasigns: list[int]) -> None:
        """Checked feasigns (ints below 2**64) of one slot of instance ``row`` (rows in order)."""
        if self.strict is None:
            self.strict = [False] * self.n
        self.strict[row] = True
        self.counts[row] += len(feasigns)
        self.feasigns.extend(feasigns)
        self.slots.extend([slot] * len(feasigns))

    def build(self) -> ParsedInstances:
        if not self.lines:
            return ParsedInstances(self.n, self.counts, self.feasigns, self.slots, self.strict)
        counts, feasigns, slots = parse_lines_strict(self.lines, self.line_rows)
        if len(self.lines) == self.n:  # every instance is a line (the usual case)
            return ParsedInstances(self.n, counts, feasigns, slots, None)
        # both forms: put the lines' features among the slot features, in instance order
        line_counts = np.asarray(counts, np.int64)
        rows = np.concatenate(
            [
                np.repeat(np.asarray(self.line_rows, np.int64), line_counts),
                np.repeat(np.arange(self.n, dtype=np.int64), np.asarray(self.counts, np.int64)),
            ]
        )
        order = np.argsort(rows, kind="stable")
        all_counts = np.asarray(self.counts, np.int64)
        all_counts[np.asarray(self.line_rows, np.int64)] += line_counts
        fs = np.concatenate([np.asarray(feasigns, np.uint64), np.asarray(self.feasigns, np.uint64)])[order]
        sl = np.concatenate([np.asarray(slots, np.int64), np.asarray(self.slots, np.int64)])[order]
        return ParsedInstances(self.n, all_counts, fs, sl, self.strict)


def feasign_value(value: object, where: str) -> int:
    """A feasign from JSON: an integer or a decimal string of ASCII digits, below 2**64."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):  # bool is an int in Python, never a feasign
        raise InstanceError(f"{where}: feasign {value!r} is not an integer")
    if isinstance(value, str):
        if not (value.isascii() and value.isdigit()):
            raise InstanceError(f"{where}: feasign {value[:40]!r} is not an unsigned integer (ASCII digits)")
        if len(value) > MAX_FEASIGN_DIGITS:
            raise InstanceError(f"{where}: feasign {value[:40]!r}... has more than {MAX_FEASIGN_DIGITS} digits")
        value = int(value)
    if not 0 <= value <= UINT64_MAX:
        raise InstanceError(f"{where}: feasign {str(value)[:40]} is outside the unsigned 64-bit range")
    return value


_FAST_CHARS_DELETE = b"0123456789 :\n"  # what the fast path allows (no tabs, no \r, single spaces)
_SLOT_LIMIT = 10**MAX_SLOT_DIGITS
_COLON, _SPACE, _NEWLINE = ord(":"), ord(" "), ord("\n")


def parse_lines_strict(lines: Sequence[str], line_rows: Sequence[int]) -> tuple:
    """(counts per line, feasigns, feature_slots) of slot-format lines; raise InstanceError naming a bad one
    (``line_rows``: each line's instance number, for the message). Lists for a few lines, else arrays.

    Fast path (lines separated by single spaces, the usual case): a handful of C-speed string checks
    over all lines at once, then one ``np.fromstring``. Anything else, or anything wrong, takes the
    exact path, which checks line by line (ASCII-only regular expression) and names the bad line.
    """
    parsed = _parse_few_lines(lines, line_rows) if len(lines) <= 4 else _parse_lines_fast(lines, line_rows)
    if parsed is not None:
        return parsed
    for line, r in zip(lines, line_rows, strict=True):
        if not _LINE_OK.fullmatch(line):
            raise InstanceError(f"instance {r}: {_line_problem(line)}")
    batch, bad = parse_lines(list(lines))
    if bad:  # e.g. a 20-digit feasign above 2**64-1
        raise InstanceError(f"instance {line_rows[bad[0].index]}: {bad[0].reason}")
    return np.bincount(batch.feature_line, minlength=len(lines)), batch.feasigns, batch.feature_slots


def _parse_few_lines(lines: Sequence[str], line_rows: Sequence[int]):
    """A few lines, token by token (numpy's per-call overhead dominates below a few thousand characters)."""
    counts: list[int] = []
    feasigns: list[int] = []
    slots: list[int] = []
    for line in lines:
        if not line.isascii():
            return None
        tokens = line.split(" ")
        if len(tokens) < 2 or not (tokens[0].isdigit() and len(tokens[0]) <= MAX_FEASIGN_DIGITS):
            return None
        if tokens[1] != "0" and tokens[1] != "1":
            return None
        for tok in tokens[2:]:
            f, sep, slot = tok.partition(":")
            if not (sep and f.isdigit() and slot.isdigit()):
                return None  # tabs, \r, double spaces, a bad feature: the exact path decides and explains
            if len(f) > MAX_FEASIGN_DIGITS or len(slot) > MAX_SLOT_DIGITS:
                return None
            v = int(f)
            if v > UINT64_MAX:
                return None
            feasigns.append(v)
            slots.append(int(slot))
        counts.append(len(tokens) - 2)
    return counts, feasigns, slots


def _parse_lines_fast(lines: Sequence[str], line_rows: Sequence[int]):
    """The fast path of ``parse_lines_strict``, or None to take the exact one (never a wrong answer).

    After show and click, a line's features joined by newlines must read ``D:D D:D ... D:D`` (D = one or
    more ASCII digits): then the non-digit characters, in order, alternate ':' and a separator, and no
    two of them touch. Numbers come from one ``np.fromstring``; 21+ digits or values above 2**64-1
    saturate there, so they go to the exact path too.
    """
    features: list[str] = []
    counts: list[int] = []
    for line in lines:
        head = line.split(" ", 2)
        if len(head) < 2 or not (head[0].isascii() and head[0].isdigit() and len(head[0]) <= MAX_FEASIGN_DIGITS):
            return None
        if head[1] != "0" and head[1] != "1":
            return None
        f = head[2] if len(head) == 3 else ""
        counts.append(f.count(":"))
        if f:
            features.append(f)
    if not features:
        return counts, [], []
    text = "\n".join(features)
    if not text.isascii():
        return None
    raw = text.encode("ascii")
    if raw.translate(None, _FAST_CHARS_DELETE):  # tabs, \r, letters, ...: the exact path decides
        return None
    a = np.frombuffer(raw, np.uint8)
    other = (a - 48) > 9  # not a digit (uint8 arithmetic wraps below '0')
    if other[0] or other[-1] or (other[1:] & other[:-1]).any():
        return None
    seps = a[other]
    colons = seps[0::2]
    between = seps[1::2]
    if len(seps) % 2 == 0 or (colons != _COLON).any() or (between == _COLON).any():
        return None
    if int(np.count_nonzero(between == _NEWLINE)) != len(features) - 1:  # a newline inside a line
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        numbers = np.fromstring(raw.replace(b":", b" ").replace(b"\n", b" "), dtype=np.uint64, sep=" ")
    if len(numbers) != 2 * len(colons):
        return None
    feasigns, slots = numbers[0::2], numbers[1::2]
    if (feasigns == np.uint64(UINT64_MAX)).any() or (slots >= np.uint64(_SLOT_LIMIT)).any():
        return None
    return np.asarray(counts, np.int64), feasigns.copy(), slots.astype(np.int64)


def _line_problem(line: str) -> str:
    parts = line.split()
    if len(parts) < 2:
        return "expected '$show $click $feasign:$slot ...'"
    if not (parts[0].isascii() and parts[0].isdigit()) or parts[1] not in ("0", "1"):
        return f"show/click {parts[0][:20]!r} {parts[1][:20]!r}: show is an unsigned integer, click 0 or 1"
    for tok in parts[2:]:
        f, sep, s = tok.partition(":")
        if not sep or not (f.isascii() and f.isdigit() and s.isascii() and s.isdigit()):
            return f"feature {tok[:60]!r} is not integer:integer (ASCII digits)"
        if len(f) > MAX_FEASIGN_DIGITS or len(s) > MAX_SLOT_DIGITS:
            return f"feature {tok[:60]!r}: feasign above 20 digits or slot above 9"
    return "characters outside the slot format (spaces or tabs between fields, ASCII digits)"


def concat_parsed(parts: Sequence[ParsedInstances]) -> tuple[ParsedInstances, list[int]]:
    """Several requests' instances as one (arrays) and each request's first row."""
    offsets, n = [], 0
    for p in parts:
        offsets.append(n)
        n += p.n
    if len(parts) == 1 and isinstance(parts[0].feasigns, np.ndarray):
        return parts[0], offsets
    counts = _concat([p.counts for p in parts], np.int64)
    feasigns = _concat([p.feasigns for p in parts], np.uint64)
    slots = _concat([p.feature_slots for p in parts], np.int64)
    strict = None
    if any(p.strict_rows is not None for p in parts):
        strict = _concat([p.strict_rows if p.strict_rows is not None else [False] * p.n for p in parts], bool)
    return ParsedInstances(n, counts, feasigns, slots, strict), offsets


def _concat(columns: list, dtype) -> np.ndarray:
    if all(isinstance(c, list) for c in columns):  # one conversion for the whole batch
        flat: list = []
        for c in columns:
            flat.extend(c)
        return np.array(flat, dtype=dtype)
    return np.concatenate([np.asarray(c, dtype=dtype) for c in columns])


def unknown_slot_rows(parsed: ParsedInstances, slots: Sequence[int]) -> dict[int, int]:
    """Rows of the strict ("slots") form naming a slot outside ``slots``: {row: first such slot}."""
    if parsed.strict_rows is None or not len(parsed.feature_slots):
        return {}
    feature_slots = np.asarray(parsed.feature_slots, np.int64)
    pos = slot_positions(feature_slots, np.asarray(list(slots), np.int64))
    rows = parsed.feature_row
    bad = np.flatnonzero((pos < 0) & np.asarray(parsed.strict_rows, bool)[rows])
    out: dict[int, int] = {}
    for j in bad.tolist():
        out.setdefault(int(rows[j]), int(feature_slots[j]))
    return out


def unknown_slot_message(row: int, slot: int, slots: Sequence[int]) -> str:
    shown = list(slots)[:8]
    return f"instance {row}: unknown slot '{slot}'; this model's slots are {shown}{'...' if len(slots) > 8 else ''}"


def to_key_batch(parsed: ParsedInstances, slots: Sequence[int], sparse_dim: int | None) -> KeyBatch:
    """The KeyBatch of one request's instances for a version's ``slots``; an unknown strict slot is an error."""
    bad = unknown_slot_rows(parsed, slots)
    if bad:
        row, slot = min(bad.items())
        raise InstanceError(unknown_slot_message(row, slot, slots))
    merged, _ = concat_parsed([parsed])
    return key_batch(merged.feature_row, merged.feasigns, merged.feature_slots, merged.n, slots, sparse_dim)


def build_key_batch(instances: Sequence[object], slots: Sequence[int], sparse_dim: int | None) -> KeyBatch:
    """JSON instances -> KeyBatch for ``slots`` (slot.conf order); raise InstanceError on bad input."""
    return to_key_batch(parse_instances(instances), slots, sparse_dim)
