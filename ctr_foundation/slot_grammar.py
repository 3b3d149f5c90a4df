"""The slot-line grammar: its one owner (issue #37). Training's reader, serving and the client build on it.

A line is ``$show $click $token $token ...``, fields separated by spaces or tabs (leading blanks, and
trailing blanks and carriage returns, allowed); ASCII only, because ``int()`` takes "٣" and "1_0" and
``str.isdigit`` is true for "²":

- show: ASCII digits, at most 20 of them, value below 2**63 (a signed 64-bit column everywhere);
- click: exactly ``0`` or ``1``;
- a token is ``feasign:slot`` (feasign: at most 20 ASCII digits, value at most 2**64-1) or a *value
  token* ``value:slot`` (a finite decimal number that is not a plain unsigned integer: ``VALUE_NUMBER``);
- slot: at most 9 ASCII digits (slot ids are below 10**9, so they fit gRPC's uint32 slot keys).

The digit bounds are in the patterns (so no parser ever converts a 4,300-digit number); the value
bounds are checked after conversion. Every reader of the format refuses a line with one of the
messages below, so a line refused by training is refused by serving and by the client in the same words.
"""

from __future__ import annotations

import re

UINT64_MAX = (1 << 64) - 1
SHOW_LIMIT = 1 << 63  # shows are int64 (LineBatch.shows, Parquet's show column)
FEASIGN_DIGITS = len(str(UINT64_MAX))  # 20
SHOW_DIGITS = FEASIGN_DIGITS
SLOT_DIGITS = 9
SLOT_LIMIT = 10**SLOT_DIGITS
CLICKS = ("0", "1")

# A value token's number, ASCII only: a decimal number that is NOT a plain unsigned integer (a sign, a point
# or an exponent; what Python's float() reads minus inf/nan, underscores and spaces). No alternative can match
# the same digits two ways, so a long digit run costs linear time to refuse (no quadratic backtracking on
# hostile input). RE2 (pyarrow's regular expressions) reads the same syntax.
VALUE_NUMBER = (
    r"(?:[-+](?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?"
    r"|(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?"
    r"|[0-9]+[eE][-+]?[0-9]+)"
)
VALUE_NUMBER_OK = re.compile(VALUE_NUMBER, re.ASCII)

# The fields as pattern text, for the patterns here and the chunk patterns of the training reader.
SHOW = rf"[0-9]{{1,{SHOW_DIGITS}}}"
CLICK = "[01]"
FEASIGN = rf"[0-9]{{1,{FEASIGN_DIGITS}}}"
SLOT = rf"[0-9]{{1,{SLOT_DIGITS}}}"
LEAD, SEP, TRAIL = r"[ \t]*", r"[ \t]+", r"[ \t\r]*"

# One line (no newline), every digit bound included: what fullmatches here is a line of the grammar
# unless a value is out of range (show >= 2**63, feasign > 2**64-1, value token beyond the float range).
LINE_OK = re.compile(rf"{LEAD}{SHOW}{SEP}{CLICK}(?:{SEP}(?:{FEASIGN}|{VALUE_NUMBER}):{SLOT})*{TRAIL}", re.ASCII)
# Lines of integer tokens only, each ending with a newline (the training reader's chunk check).
INTEGER_LINES_OK = re.compile(rf"(?:{LEAD}{SHOW}{SEP}{CLICK}(?:{SEP}{FEASIGN}:{SLOT})*{TRAIL}\n)*", re.ASCII)

EXPECTED = "expected '$show $click $feasign:$slot ...'"


class MalformedLine(ValueError):
    """A line that is not in the slot format; readers count and skip these."""


def feasign_above_uint64(digits: str) -> str:
    """What is wrong with a feasign written as ``digits`` (ASCII digits) above 2**64-1."""
    shown = digits if len(digits) <= 40 else f"{digits[:20]}...({len(digits)} digits)"
    return f"feasign {shown} is above 2**64-1 (the largest unsigned 64-bit integer, {UINT64_MAX})"


def show_above_int64(digits: str) -> str:
    """What is wrong with a show of ``digits`` (ASCII digits, at most SHOW_DIGITS) of 2**63 or more."""
    return f"show {digits} is above 2**63-1 (the largest signed 64-bit integer, {SHOW_LIMIT - 1})"


def show_click_problem(show: str, click: str) -> str:
    return f"show/click {show[:20]!r} {click[:20]!r}: show is an unsigned integer, click 0 or 1"


def slot_too_long(slot: str) -> str:
    shown = slot if len(slot) <= 20 else f"{slot[:20]}..."
    return f"slot {shown} has more than {SLOT_DIGITS} digits (slot ids are integers below {SLOT_LIMIT})"


def bad_token(tok: str) -> str:
    return (
        f"feature {tok[:60]!r} is not integer:integer (feasign:slot) nor number:integer (a dense slot's "
        "value:slot), in ASCII digits"
    )


def value_not_finite(tok: str) -> str:
    return f"feature {tok[:60]!r}: a dense value must be a finite decimal number"


def line_problem(line: str) -> str:
    """The first thing wrong with a line that does not fullmatch ``LINE_OK``, in the grammar's words."""
    parts = line.split()
    if len(parts) < 2:
        return EXPECTED
    show, click = parts[0], parts[1]
    if not (show.isascii() and show.isdigit()) or click not in CLICKS:
        return show_click_problem(show, click)
    if len(show) > SHOW_DIGITS:
        return f"show {show[:20]}... has more than {SHOW_DIGITS} digits"
    for tok in parts[2:]:
        f, sep, s = tok.partition(":")
        if sep and s.isascii() and s.isdigit() and f.isascii():
            if f.isdigit() and len(f) > FEASIGN_DIGITS:
                return f"feature {tok[:60]!r}: {feasign_above_uint64(f)}"
            if f.isdigit() or VALUE_NUMBER_OK.fullmatch(f):
                if len(s) > SLOT_DIGITS:
                    return f"feature {tok[:60]!r}: {slot_too_long(s)}"
                continue
        return bad_token(tok)
    # every field is right, so a separator is not: a vertical tab, a no-break space, a carriage return inside
    return "characters outside the slot format (spaces or tabs between fields, ASCII digits)"
