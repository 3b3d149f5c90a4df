"""Request bodies and instances -> feature columns, validated per request (one bad request never fails another).

An instance is ``{"line": "<slot-format line>"}`` or ``{"slots": {"<slot>": [feasign, ...], ...}}``.
Every request is parsed and checked on its own (one client's bad feasign must never fail
another client's request of the same merged batch): feasigns are ASCII digits only (``str.isdigit``
is true for "²"), at most 20 of them, value below 2**64; JSON too deep or with integers too long for
Python to convert is a 400; too many instances a 413. What leaves here is a ``ParsedInstances``
(feature columns, no model needed); ``to_key_batch`` turns it into the shared KeyBatch with a
version's slots (inference/scoring.py: ``key_batch``, the one builder).

Lines follow training exactly: the grammar of a line, its bounds and its error messages are
ctr_foundation/slot_grammar.py's (so are the feasign and slot bounds of the ``slots`` form); features of
slots outside slot.conf are ignored (the trainer ignores them too); the ``slots`` form is explicit, so an
unknown slot there is an error. In both forms a slot with no feature gets the padding feasign, and the key
transform is ``feasign % sparse_dim`` when the version has one.

Dense slots (slot.conf ``SLOT dense``, ctr_foundation/dense_features.py) carry one number each:

- In a line, as in training: a value token ``value:slot`` (``2.5:40``, ``-3:41``, ``1e-3:42``: a decimal
  number that is not a plain unsigned integer, ASCII only), and an integer token of a dense slot
  (``7:43``) is that slot's value too. A value token of a sparse slot is ignored, as training ignores it.
- In the ``slots`` form, a dense slot takes one JSON number (integer or not) or a one-element list of
  one, e.g. ``{"slots": {"14": [123], "40": 2.5, "41": [-3]}}``; a decimal string (``"2.5"``) is read as
  a number too, and an empty list leaves the value missing (standardised to 0, as training does). Any
  other value is a 400 naming the instance and slot: bool, null, a non-finite number, a string that is
  neither digits nor a decimal number, more than one number for a dense slot, and a number that is not
  a feasign (``2.5``, ``-1``) in a sparse slot.

Whether a slot is dense is the scoring version's business, so what depends on it is checked when a
merged batch meets its version (``strict_problems``), still per request: a request the version cannot
score is refused alone.

A request whose instances are all lines may leave the frontend unparsed (``UnparsedLines``): the batch
worker parses the lines of every such request in its batch with one byte parse (``parse_parts``), about
half the cost per line of parsing 32-line requests one by one, and off the frontend's event loop. A bad
line still refuses its own request alone, with the same message (the worker then parses each request by
itself).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ctr_foundation.http_messages import HttpError, parse_json
from ctr_foundation.slot_grammar import (
    FEASIGN_DIGITS,
    LINE_OK,
    SHOW_LIMIT,
    SLOT_DIGITS,
    UINT64_MAX,
    VALUE_NUMBER_OK,
    feasign_above_uint64,
    line_problem,
)
from elastic_control.data.line_batch import LineBatch, parse_lines, parse_plain_lines
from elastic_control.inference.scoring import KeyBatch, key_batch, slot_positions
from elastic_control.serving.body_scan import body_lines

MAX_INSTANCES = 10_000
MAX_ROUTING_KEY = 256
# A show of this many digits or fewer is below 2**63 without converting it (the fast paths' common case).
_SHOW_SAFE_DIGITS = len(str(SHOW_LIMIT)) - 1

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
    # numbers that are not feasigns (value tokens, JSON numbers): instance, slot, value; in no particular order
    value_rows: list | np.ndarray = ()  # int [k]
    value_slots: list | np.ndarray = ()  # int [k]
    values: list | np.ndarray = ()  # float [k]
    # Requests parsed together (parse_parts): (the columns of all of them, this one's first row), so that
    # concat_parsed gives those columns back, not a copy, when the batch holds the same requests in order.
    within: tuple[ParsedInstances, int] | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def feature_row(self) -> np.ndarray:
        return np.repeat(np.arange(self.n, dtype=np.int64), np.asarray(self.counts, dtype=np.int64))


@dataclass(frozen=True)
class PredictRequest:
    parsed: ParsedInstances | UnparsedLines  # UnparsedLines: lines the batch worker parses (parse_parts)
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


def predict_request(body: object, *, defer_lines: bool = False) -> PredictRequest:
    """A decoded ``/v1/predict`` body -> its validated PredictRequest; with ``defer_lines``, a request of
    lines only keeps them unparsed for the batch worker (``UnparsedLines``)."""
    if not isinstance(body, dict) or "instances" not in body:
        raise InstanceError('the body must be a JSON object {"instances": [...]}')
    instances = body["instances"]
    if not isinstance(instances, list):
        raise InstanceError('"instances" must be a list')
    lines = only_lines(instances) if defer_lines else None
    return PredictRequest(
        parse_instances(instances) if lines is None else lines,
        routing_key_of(body.get("routing_key")),
        arm_of(body.get("arm")),
        instances,
    )


def predict_body(body: bytes) -> PredictRequest:
    """A ``/v1/predict`` body -> ``predict_request(decode_json(body), defer_lines=True)``: the common body of
    lines only through one compiled scan of its bytes (body_scan.py, without the GIL), any other through
    JSON."""
    lines = body_lines(body)
    if lines is None:
        return predict_request(decode_json(body), defer_lines=True)
    check_count(len(lines))
    return PredictRequest(UnparsedLines(lines), None, None, [{"line": line} for line in lines])


def only_lines(instances: Sequence[object]) -> UnparsedLines | None:
    """The instances as UnparsedLines when every one is ``{"line": <string>, ...}`` (and there are not too
    many), else None (they are parsed now)."""
    check_count(len(instances))
    lines = []
    for inst in instances:
        if type(inst) is not dict or type(line := inst.get("line")) is not str:
            return None
        lines.append(line)
    return UnparsedLines(lines)


@dataclass(frozen=True)
class UnparsedLines:
    """A request's instances, all lines, not parsed yet (``parse_parts`` parses them in the merged batch).
    ``first``: the instance number of ``lines[0]`` (a part of a larger request), for the messages."""

    lines: list[str]
    first: int = 0
    strict_rows = None  # lines are never strict (strict_problems)

    @property
    def n(self) -> int:
        return len(self.lines)


def parse_parts(items: Sequence[ParsedInstances | UnparsedLines]) -> list[ParsedInstances | InstanceError]:
    """Every item parsed: the UnparsedLines of all of them with one byte parse of their lines together
    (ParsedInstances pass through); when that parse declines (a line outside the plain layout, a malformed
    one), each one on its own, so a bad line is the InstanceError of its own request only."""
    out: list = list(items)
    todo = [i for i, item in enumerate(items) if isinstance(item, UnparsedLines)]
    if not todo:
        return out
    lines = [line for i in todo for line in items[i].lines]
    batch = parse_plain_lines(lines) if len(lines) > 4 else None
    if batch is not None:
        for i, parsed in zip(todo, _split_lines(batch, [items[i].n for i in todo]), strict=True):
            out[i] = parsed
        return out
    for i in todo:
        item = items[i]
        try:
            out[i] = parsed_lines(item.lines, range(item.first, item.first + item.n))
        except InstanceError as e:
            out[i] = e
    return out


def _split_lines(batch: LineBatch, sizes: list[int]) -> list[ParsedInstances]:
    """A LineBatch of several requests' lines (one row each, request after request) as each request's
    ParsedInstances: views of the batch's columns, cut where each request's lines begin (features and
    values are stored line after line), found for every request at once."""
    counts = np.bincount(batch.feature_line, minlength=len(batch))
    line_at = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(sizes, out=line_at[1:])
    feature_at = np.zeros(len(batch) + 1, np.int64)
    np.cumsum(counts, out=feature_at[1:])
    lines, features = line_at.tolist(), feature_at[line_at].tolist()
    values = np.searchsorted(batch.value_line, line_at).tolist()
    has_values = values[-1] > 0
    value_columns = (_ints(batch.value_line), _ints(batch.value_slots), np.asarray(batch.values, np.float64))
    whole = ParsedInstances(len(batch), counts, batch.feasigns, batch.feature_slots, None, *value_columns)
    out = []
    for j, n in enumerate(sizes):
        lo, hi, fl, fh = lines[j], lines[j + 1], features[j], features[j + 1]
        if has_values:
            vl, vh = values[j], values[j + 1]
            value_columns = (batch.value_line[vl:vh] - lo, batch.value_slots[vl:vh], batch.values[vl:vh])
        else:
            value_columns = ((), (), ())
        out.append(
            ParsedInstances(
                n, counts[lo:hi], batch.feasigns[fl:fh], batch.feature_slots[fl:fh], None, *value_columns, (whole, lo)
            )
        )
    return out


def parsed_lines(lines: Sequence[str], line_rows: Sequence[int]) -> ParsedInstances:
    """Instances that are all lines, parsed (``parse_lines_strict``; InstanceError names a bad one)."""
    return _instances_of(parse_lines_strict(lines, line_rows))


def _instances_of(cols: LineColumns) -> ParsedInstances:
    """Lines' columns as the instances of a request whose instances are all lines (line i is instance i)."""
    return ParsedInstances(
        len(cols.counts), cols.counts, cols.feasigns, cols.slots, None, cols.value_lines, cols.value_slots, cols.values
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
            add_json_slots(columns, r, inst["slots"])
        else:
            raise InstanceError(f'instance {r} is empty: give "line" or "slots"')
    return columns.build()


def add_json_slots(columns: InstanceColumns, r: int, given: object) -> None:
    """The ``"slots"`` object of instance ``r``: each slot's feasigns, or numbers (dense slots)."""
    if not isinstance(given, dict) or not given:
        raise InstanceError(f'instance {r}: "slots" must be a non-empty object {{"<slot>": [feasign, ...]}}')
    for key, items in given.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= SLOT_DIGITS):
            raise InstanceError(f"instance {r}: unknown slot {key!r}; slots are decimal integers")
        where = f"instance {r} slot {key}"
        feasigns: list[int] = []
        numbers: list[float] = []
        for item in items if isinstance(items, list) else [items]:
            kind, v = feasign_or_number(item, where)
            (feasigns if kind is int else numbers).append(v)
        columns.add_slot(r, int(key), feasigns, numbers)


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
        self.value_rows: list[int] = []
        self.value_slots: list[int] = []
        self.values: list[float] = []

    def add_line(self, row: int, line: str) -> None:
        self.lines.append(line)
        self.line_rows.append(row)

    def add_slot(self, row: int, slot: int, feasigns: list[int], numbers: Sequence[float] = ()) -> None:
        """Checked feasigns (ints below 2**64) and other finite numbers of one slot of instance ``row``
        (rows in order). Whether the slot may take numbers is the version's business (``strict_problems``)."""
        if self.strict is None:
            self.strict = [False] * self.n
        self.strict[row] = True
        self.counts[row] += len(feasigns)
        self.feasigns.extend(feasigns)
        self.slots.extend([slot] * len(feasigns))
        if numbers:
            self.value_rows.extend([row] * len(numbers))
            self.value_slots.extend([slot] * len(numbers))
            self.values.extend(numbers)

    def build(self) -> ParsedInstances:
        own_values = (self.value_rows, self.value_slots, self.values)
        if not self.lines:
            return ParsedInstances(self.n, self.counts, self.feasigns, self.slots, self.strict, *own_values)
        if len(self.lines) == self.n:  # every instance is a line (the usual case): line i is instance i
            return parsed_lines(self.lines, self.line_rows)
        cols = parse_lines_strict(self.lines, self.line_rows)
        # both forms: put the lines' features among the slot features, in instance order
        line_counts = np.asarray(cols.counts, np.int64)
        line_rows = np.asarray(self.line_rows, np.int64)
        rows = np.concatenate(
            [
                np.repeat(line_rows, line_counts),
                np.repeat(np.arange(self.n, dtype=np.int64), np.asarray(self.counts, np.int64)),
            ]
        )
        order = np.argsort(rows, kind="stable")
        all_counts = np.asarray(self.counts, np.int64)
        all_counts[line_rows] += line_counts
        fs = np.concatenate([np.asarray(cols.feasigns, np.uint64), np.asarray(self.feasigns, np.uint64)])[order]
        sl = np.concatenate([np.asarray(cols.slots, np.int64), np.asarray(self.slots, np.int64)])[order]
        # values carry their row, so they need no ordering: the lines' ones only move to their instances
        value_rows = np.concatenate([line_rows[np.asarray(cols.value_lines, np.int64)], _ints(self.value_rows)])
        value_slots = np.concatenate([_ints(cols.value_slots), _ints(self.value_slots)])
        values = np.concatenate([np.asarray(cols.values, np.float64), np.asarray(self.values, np.float64)])
        return ParsedInstances(self.n, all_counts, fs, sl, self.strict, value_rows, value_slots, values)


def _ints(column) -> np.ndarray:
    return np.asarray(column, np.int64)


def feasign_or_number(value: object, where: str) -> tuple[type, int | float]:
    """(int, feasign) for a feasign from JSON (an integer or a string of ASCII digits, below 2**64), or
    (float, number) for any other finite number (a dense slot's value; a decimal string counts)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):  # bool is an int in Python
        raise InstanceError(f"{where}: {_shown(value)} is not an integer feasign nor a number")
    if isinstance(value, str):
        if value.isascii() and value.isdigit():
            return int, feasign_value(value, where)
        if not (value.isascii() and VALUE_NUMBER_OK.fullmatch(value)):
            raise InstanceError(
                f"{where}: feasign {value[:40]!r} is not an unsigned integer (ASCII digits) nor a decimal number"
            )
        value = float(value)
    elif isinstance(value, int) and 0 <= value <= UINT64_MAX:
        return int, value
    value = float(value)  # JSON integers are at most 40 digits (http_json): never too large for a float
    if not math.isfinite(value):
        raise InstanceError(f"{where}: {value!r} is not a finite number")
    return float, value


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."


def feasign_value(value: object, where: str) -> int:
    """A feasign from JSON: an integer or a decimal string of ASCII digits, below 2**64."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):  # bool is an int in Python, never a feasign
        raise InstanceError(f"{where}: feasign {value!r} is not an integer")
    if isinstance(value, str):
        if not (value.isascii() and value.isdigit()):
            raise InstanceError(f"{where}: feasign {value[:40]!r} is not an unsigned integer (ASCII digits)")
        if len(value) > FEASIGN_DIGITS:
            raise InstanceError(f"{where}: {feasign_above_uint64(value)}")
        value = int(value)
    if not 0 <= value <= UINT64_MAX:
        raise InstanceError(f"{where}: feasign {str(value)[:40]} is outside the unsigned 64-bit range")
    return value


class LineColumns(NamedTuple):
    """Parsed slot-format lines: integer tokens (``counts[i]`` of line i, line after line) and value tokens
    (``value_lines``: the index of each one's line in the list given). Lists for a few lines, else arrays."""

    counts: list | np.ndarray
    feasigns: list | np.ndarray
    slots: list | np.ndarray
    value_lines: list | np.ndarray = ()
    value_slots: list | np.ndarray = ()
    values: list | np.ndarray = ()


def parse_lines_strict(lines: Sequence[str], line_rows: Sequence[int]) -> LineColumns:
    """The columns of slot-format lines; raise InstanceError naming a bad one (``line_rows``: each line's
    instance number, for the message).

    Fast path: up to 4 lines token by token; more through the training reader's byte parse of the lines
    joined (line_batch.parse_plain_lines: separators and numbers found over the whole text at once).
    Anything else, or anything wrong, takes the exact path, which checks line by line (the grammar's
    ``LINE_OK``), names the bad line in the grammar's words, and parses with the training reader's parser.
    """
    parsed = _parse_few_lines(lines) if len(lines) <= 4 else _parse_lines_fast(lines)
    if parsed is not None:
        return parsed
    for line, r in zip(lines, line_rows, strict=True):
        if not LINE_OK.fullmatch(line):
            raise InstanceError(f"instance {r}: {line_problem(line)}")
    batch, bad = parse_lines(list(lines))
    if bad:  # e.g. a 20-digit feasign above 2**64-1, a show of 2**63, a value beyond the float range
        raise InstanceError(f"instance {line_rows[bad[0].index]}: {bad[0].reason}")
    return _columns(batch, len(lines))


def warm_up_line_parse() -> None:
    """Have the compiled line parse ready before the first request: numba compiles it on first use, or loads
    its cached machine code (0.3 s), and compiling takes 3-4 s of CPU (14 s seen under load) where no
    cache folder holds it yet (a fresh image's pod). Serving calls this before it listens, so no request
    and no readiness probe waits for it."""
    parse_lines_strict(["1 0 1:1 2:2 0.5:3"] * 5, range(5))


def _columns(batch: LineBatch, n: int) -> LineColumns:
    """A LineBatch of ``n`` lines (one row each) as the request path's columns."""
    return LineColumns(
        np.bincount(batch.feature_line, minlength=n),
        batch.feasigns,
        batch.feature_slots,
        batch.value_line,
        batch.value_slots,
        batch.values,
    )


def _parse_few_lines(lines: Sequence[str]) -> LineColumns | None:
    """A few lines, token by token (numpy's per-call overhead dominates below a few thousand characters)."""
    counts: list[int] = []
    feasigns: list[int] = []
    slots: list[int] = []
    value_lines: list[int] = []
    value_slots: list[int] = []
    values: list[float] = []
    for i, line in enumerate(lines):
        if not line.isascii():
            return None
        tokens = line.split(" ")
        if len(tokens) < 2 or not (tokens[0].isdigit() and _show_ok(tokens[0])):
            return None
        if tokens[1] != "0" and tokens[1] != "1":
            return None
        count = 0
        for tok in tokens[2:]:
            f, sep, slot = tok.partition(":")
            if not (sep and slot.isdigit() and len(slot) <= SLOT_DIGITS):
                return None  # tabs, \r, double spaces, a bad feature: the exact path decides and explains
            if f.isdigit():
                if len(f) > FEASIGN_DIGITS or (v := int(f)) > UINT64_MAX:
                    return None
                feasigns.append(v)
                slots.append(int(slot))
                count += 1
            elif VALUE_NUMBER_OK.fullmatch(f) and math.isfinite(x := float(f)):
                value_lines.append(i)
                value_slots.append(int(slot))
                values.append(x)
            else:
                return None
        counts.append(count)
    return LineColumns(counts, feasigns, slots, value_lines, value_slots, values)


def _parse_lines_fast(lines: Sequence[str]) -> LineColumns | None:
    """The fast path of ``parse_lines_strict`` (the training reader's byte parse: data/line_batch.py), or None
    to take the exact one (never a wrong answer)."""
    batch = parse_plain_lines(lines)
    return None if batch is None else _columns(batch, len(lines))


def _show_ok(digits: str) -> bool:
    """A show of ASCII ``digits`` within the grammar's bound (below 2**63), converting only the long ones."""
    return len(digits) <= _SHOW_SAFE_DIGITS or (len(digits) <= FEASIGN_DIGITS and int(digits) < SHOW_LIMIT)


def concat_parsed(parts: Sequence[ParsedInstances]) -> tuple[ParsedInstances, list[int]]:
    """Several requests' instances as one (arrays) and each request's first row."""
    offsets, n = [], 0
    for p in parts:
        offsets.append(n)
        n += p.n
    whole = _whole_of(parts, offsets, n)
    if whole is not None:
        return whole, offsets
    value_columns = _concat_values(parts, offsets)
    if len(parts) == 1 and isinstance(parts[0].feasigns, np.ndarray):
        return dataclasses.replace(parts[0], **value_columns), offsets
    counts = _concat([p.counts for p in parts], np.int64)
    feasigns = _concat([p.feasigns for p in parts], np.uint64)
    slots = _concat([p.feature_slots for p in parts], np.int64)
    strict = None
    if any(p.strict_rows is not None for p in parts):
        strict = _concat([p.strict_rows if p.strict_rows is not None else [False] * p.n for p in parts], bool)
    return ParsedInstances(n, counts, feasigns, slots, strict, **value_columns), offsets


def _whole_of(parts: Sequence[ParsedInstances], offsets: list[int], n: int) -> ParsedInstances | None:
    """The columns ``parts`` were cut from (``ParsedInstances.within``) when they are all of them, in order
    (a batch whose requests were all lines, parsed together): their concatenation, without copying."""
    within = parts[0].within
    if within is None or within[0].n != n:
        return None
    whole = within[0]
    for p, at in zip(parts, offsets, strict=True):
        if p.within is None or p.within[0] is not whole or p.within[1] != at:
            return None
    return whole


def slice_parsed(parsed: ParsedInstances | UnparsedLines, lo: int, hi: int) -> ParsedInstances | UnparsedLines:
    """Instances ``lo`` .. ``hi - 1`` of a request as a request of their own (rows renumbered from 0)."""
    if isinstance(parsed, UnparsedLines):
        return UnparsedLines(parsed.lines[lo:hi], parsed.first + lo)
    counts = np.asarray(parsed.counts, np.int64)
    ends = np.cumsum(counts)
    first, last = (int(ends[lo - 1]) if lo else 0), (int(ends[hi - 1]) if hi else 0)
    rows = _ints(parsed.value_rows)
    keep = (rows >= lo) & (rows < hi)
    return ParsedInstances(
        hi - lo,
        counts[lo:hi],
        np.asarray(parsed.feasigns, np.uint64)[first:last],
        _ints(parsed.feature_slots)[first:last],
        None if parsed.strict_rows is None else np.asarray(parsed.strict_rows, bool)[lo:hi],
        rows[keep] - lo,
        _ints(parsed.value_slots)[keep],
        np.asarray(parsed.values, np.float64)[keep],
    )


def _concat(columns: list, dtype) -> np.ndarray:
    if all(isinstance(c, list) for c in columns):  # one conversion for the whole batch
        flat: list = []
        for c in columns:
            flat.extend(c)
        return np.array(flat, dtype=dtype)
    return np.concatenate([np.asarray(c, dtype=dtype) for c in columns])


def _concat_values(parts: Sequence[ParsedInstances], offsets: list[int]) -> dict[str, np.ndarray]:
    """The value columns of several requests as arrays, rows renumbered like the features'."""
    if not any(len(p.values) for p in parts):  # no dense values at all (every pass without dense slots)
        return {"value_rows": _ints(()), "value_slots": _ints(()), "values": np.zeros(0, np.float64)}
    return {
        "value_rows": np.concatenate([_ints(p.value_rows) + off for p, off in zip(parts, offsets, strict=True)]),
        "value_slots": np.concatenate([_ints(p.value_slots) for p in parts]),
        "values": np.concatenate([np.asarray(p.values, np.float64) for p in parts]),
    }


def strict_problems(parsed: ParsedInstances, slots: Sequence[int], dense_slots: Sequence[int] = ()) -> dict[int, str]:
    """{row: message} for the rows of the strict ("slots") form that a version with these sparse ``slots``
    and ``dense_slots`` cannot score (each row's first problem): a slot that is neither, a number that is
    not a feasign in a sparse slot, more than one number for a dense slot. Lines are never strict."""
    if parsed.strict_rows is None:
        return {}
    strict = np.asarray(parsed.strict_rows, bool)
    sparse_arr, dense_arr = _ints(list(slots)), _ints(list(dense_slots))
    f_rows, f_slots = parsed.feature_row, _ints(parsed.feature_slots)
    v_rows, v_slots, values = _ints(parsed.value_rows), _ints(parsed.value_slots), np.asarray(parsed.values, float)
    f_strict, v_strict = strict[f_rows], strict[v_rows]
    f_dense, v_dense = np.isin(f_slots, dense_arr), np.isin(v_slots, dense_arr)
    f_sparse, v_sparse = slot_positions(f_slots, sparse_arr) >= 0, slot_positions(v_slots, sparse_arr) >= 0
    out: dict[int, str] = {}
    for rows, cols, bad in (
        (f_rows, f_slots, f_strict & ~f_sparse & ~f_dense),
        (v_rows, v_slots, v_strict & ~v_sparse & ~v_dense),
    ):
        for j in np.flatnonzero(bad).tolist():
            out.setdefault(int(rows[j]), unknown_slot_message(int(rows[j]), int(cols[j]), slots, dense_slots))
    for j in np.flatnonzero(v_strict & v_sparse).tolist():
        r = int(v_rows[j])
        out.setdefault(r, not_a_feasign_message(r, int(v_slots[j]), float(values[j]), dense_slots))
    if len(dense_arr):
        # one number per dense slot: count the integers and the other numbers of each (row, dense slot)
        cells = np.stack(
            [
                np.concatenate([f_rows[f_strict & f_dense], v_rows[v_strict & v_dense]]),
                np.concatenate([f_slots[f_strict & f_dense], v_slots[v_strict & v_dense]]),
            ],
            axis=1,
        )
        if len(cells):
            cell, count = np.unique(cells, axis=0, return_counts=True)
            for (r, s), c in zip(cell[count > 1].tolist(), count[count > 1].tolist(), strict=True):
                out.setdefault(r, f"instance {r} slot {s}: a dense slot takes one number, got {c}")
    return out


def _few(slots: Sequence[int]) -> str:
    return f"{list(slots)[:8]}{'...' if len(slots) > 8 else ''}"


def unknown_slot_message(row: int, slot: int, slots: Sequence[int], dense_slots: Sequence[int] = ()) -> str:
    dense = f" and dense slots {_few(dense_slots)}" if len(dense_slots) else ""
    return f"instance {row}: unknown slot '{slot}'; this model's slots are {_few(slots)}{dense}"


def not_a_feasign_message(row: int, slot: int, value: float, dense_slots: Sequence[int] = ()) -> str:
    """A number that is not a feasign, given for a sparse slot."""
    if value.is_integer() and not 0 <= value <= UINT64_MAX:
        shown = str(int(value)) if abs(value) < 2**53 else repr(value)
        why = f"feasign {shown} is outside the unsigned 64-bit range"
    else:
        why = f"feasign {value!r} is not an integer"
    hint = f" (slot {slot} is sparse; numbers go to the dense slots {_few(dense_slots)})" if len(dense_slots) else ""
    return f"instance {row} slot {slot}: {why}{hint}"


def parsed_key_batch(
    parsed: ParsedInstances, slots: Sequence[int], sparse_dim: int | None, dense_slots: Sequence[int] = ()
) -> KeyBatch:
    """The KeyBatch of (merged) instances for a version: sparse ``slots`` in slot.conf order, its key
    transform, its ``dense_slots`` (through scoring.key_batch, the one builder)."""
    return key_batch(
        parsed.feature_row,
        parsed.feasigns,
        parsed.feature_slots,
        parsed.n,
        slots,
        sparse_dim,
        dense_slots=dense_slots,
        values=(parsed.value_rows, parsed.value_slots, parsed.values),
    )


def to_key_batch(
    parsed: ParsedInstances, slots: Sequence[int], sparse_dim: int | None, dense_slots: Sequence[int] = ()
) -> KeyBatch:
    """The KeyBatch of one request's instances for a version; a strict instance it cannot score is an error."""
    problems = strict_problems(parsed, slots, dense_slots)
    if problems:
        raise InstanceError(problems[min(problems)])
    merged, _ = concat_parsed([parsed])
    return parsed_key_batch(merged, slots, sparse_dim, dense_slots)


def build_key_batch(
    instances: Sequence[object], slots: Sequence[int], sparse_dim: int | None, dense_slots: Sequence[int] = ()
) -> KeyBatch:
    """JSON instances -> KeyBatch for a version's ``slots`` (slot.conf order) and ``dense_slots``; raise
    InstanceError on bad input."""
    return to_key_batch(parse_instances(instances), slots, sparse_dim, dense_slots)
