"""Vectorised parsing of slot-format lines into column arrays, and per-slot key lists.

``parse_sample_line`` (sample.py) is the reference for one line, and
``ctr_foundation/slot_grammar.py`` owns the grammar (its limits, patterns and
messages); this module does the same for thousands of lines at once, because
a per-line Python parse caps a trainer at a few tens of thousands of lines per second.

``parse_text`` takes a chunk of the file as bytes (what the hourly reader
reads) and finds its tokens with numpy on the whole chunk: the separators'
positions give every token, the byte after a token says whether it is a
pair's left part (``:``), and each line's tokens must then be show, click and
feasign:slot pairs; pyarrow converts every integer token at once (its
parser refuses a uint64 overflow) and the value tokens of dense slots
(``2.5:40``), each checked against ``VALUE_NUMBER`` first. Anything outside that
plain layout (tabs, carriage returns, runs of odd bytes, a malformed
token) sends the chunk to the older paths of ``parse_lines``: a regular
expression over the chunk with one ``np.fromstring``, and, when that
fails, the per-line parser, which names the bad lines. So a chunk the
fast path accepts parses as the reference would, and one it refuses is
counted and skipped exactly as before.

Where a chunk's time goes (Criteo lines as ``data criteo`` writes them: about
100 tokens and 500 bytes a line, 10 of the tokens dense values). Such chunks
never fell back to the per-line parser, but took 7 us a line before value
tokens had their own path in the layout writers produce: copying the integer
tokens out (a pyarrow ``take``) cost as much as converting them, the value
tokens' regular expression (pyarrow's) 50 ns each, cutting the lines into
Python strings 0.5 us, and some twenty passes over per-token arrays the rest.
About 4 us are left. What no pass of numpy or pyarrow avoids is 1.6 us of
them: finding the separators (``np.flatnonzero`` over every byte, 0.6 us: as
long as pyarrow's whole CSV split of the same bytes) and converting the
integers (pyarrow, about 10 ns a token: 1 us); the rest is some fifteen
passes over per-token arrays, 0.1 us each, and the value tokens' 0.5 us.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ctr_foundation.dense_features import dense_matrix
from ctr_foundation.sample import PADDING_FEASIGN, parse_sample_line, transform_keys
from ctr_foundation.slot_grammar import (
    CLICK,
    FEASIGN_DIGITS,
    INTEGER_LINES_OK,
    LEAD,
    SEP,
    SHOW,
    SHOW_DIGITS,
    SHOW_LIMIT,
    SLOT,
    SLOT_DIGITS,
    TRAIL,
    UINT64_MAX,
    VALUE_NUMBER,
    MalformedLine,
)

# A chunk with value tokens too (a dense slot's number, ctr_foundation/dense_features.py: a decimal number
# that is not a plain unsigned integer, so it has a sign, a point or an exponent), in feature positions only:
# a value token where show or click belongs makes the chunk fall back to the per-line parser. The grammar's
# fields, except that a token's left part is only checked for its characters here (the exact alternative,
# FEASIGN or VALUE_NUMBER, costs a third more); the integer tokens left once the value tokens are set aside
# then pass the grammar's INTEGER_LINES_OK (a feasign's 20-digit bound), and numpy's float conversion refuses
# a malformed number ("1.2.3").
_CHUNK_WITH_VALUES_OK = re.compile(rf"(?:{LEAD}{SHOW}{SEP}{CLICK}(?:{SEP}[-+.0-9eE]+:{SLOT})*{TRAIL}\n)*", re.ASCII)
# Bytes that only a value token holds in a valid chunk (integer tokens, show and click are digits).
_VALUE_BYTES = np.zeros(256, bool)
_VALUE_BYTES[list(b".+-eE")] = True
_BLANK_BYTES = np.zeros(256, bool)
_BLANK_BYTES[list(b" \t\r\n")] = True
_NO_VALUES = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float64))


class TextLines(Sequence):
    """A chunk's lines kept as its bytes: a pyarrow string array of the lines, each with its newline, over
    the chunk's buffer. A Python string per line cost 0.5 us a Criteo line (half of what converting all
    its numbers costs), for lines that training reads back only a few of (the golden lines); and taking,
    slicing, concatenating and shuffling them is then done by pyarrow, not line by line."""

    __slots__ = ("_arr",)

    def __init__(self, arr):
        self._arr = arr

    @classmethod
    def of_chunk(cls, data: bytes, newlines: np.ndarray) -> TextLines:
        """The lines of ``data``, whose newlines are at ``newlines`` (sorted, the last one ending ``data``)."""
        import pyarrow as pa

        offsets = np.empty(len(newlines) + 1, np.int64)
        offsets[0] = 0
        offsets[1:] = newlines + 1
        return cls(pa.LargeStringArray.from_buffers(len(newlines), pa.py_buffer(offsets), pa.py_buffer(data)))

    @classmethod
    def concat(cls, parts: list[TextLines]) -> TextLines:
        import pyarrow as pa

        return cls(pa.concat_arrays([p._arr for p in parts]))

    def take(self, rows: np.ndarray) -> TextLines:
        return TextLines(self._arr.take(_arrow_indices(rows)))

    def __len__(self) -> int:
        return len(self._arr)

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self._arr))
            if step == 1:
                return TextLines(self._arr.slice(start, max(stop - start, 0)))
            return self.take(np.arange(start, stop, step))
        return self._arr[i].as_py()[:-1]

    def __iter__(self):
        return (ln[:-1] for ln in self._arr.to_pylist())

    def __eq__(self, other) -> bool:
        if isinstance(other, TextLines | list | tuple):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    __hash__ = None

    def __add__(self, other) -> list[str]:
        return [*self, *other]

    def __radd__(self, other) -> list[str]:
        return [*other, *self]

    def __repr__(self) -> str:
        return f"TextLines({list(self)!r})"


@dataclass
class LineBatch:
    """Parsed lines as columns; features are stored line after line, in line order."""

    shows: np.ndarray  # int64[n]
    clicks: np.ndarray  # int64[n]
    feature_line: np.ndarray  # int64[m]: which line each feature belongs to
    feasigns: np.ndarray  # uint64[m]
    feature_slots: np.ndarray  # int64[m]
    # The raw (valid) lines when read from text (a list, or TextLines from the byte parse); None for Parquet.
    lines: Sequence[str] | None
    # value tokens (dense slots' numbers), line after line as the features: line, slot, value
    value_line: np.ndarray = field(default_factory=lambda: _NO_VALUES[0])  # int64[k]
    value_slots: np.ndarray = field(default_factory=lambda: _NO_VALUES[1])  # int64[k]
    values: np.ndarray = field(default_factory=lambda: _NO_VALUES[2])  # float64[k]

    def __len__(self) -> int:
        return len(self.clicks)

    def line_at(self, i: int) -> str:
        """Line ``i`` in the slot text format (rebuilt from the columns when the source was Parquet)."""
        if self.lines is not None:
            return self.lines[i]
        lo, hi = np.searchsorted(self.feature_line, [i, i + 1])
        toks = [
            f"{f}:{s}" for f, s in zip(self.feasigns[lo:hi].tolist(), self.feature_slots[lo:hi].tolist(), strict=True)
        ]
        vlo, vhi = np.searchsorted(self.value_line, [i, i + 1])
        toks += [
            f"{v!r}:{s}" for v, s in zip(self.values[vlo:vhi].tolist(), self.value_slots[vlo:vhi].tolist(), strict=True)
        ]
        return f"{self.shows[i]} {self.clicks[i]} {' '.join(toks)}".rstrip()

    @property
    def has_values(self) -> bool:
        return len(self.values) > 0

    @classmethod
    def empty(cls) -> LineBatch:
        z = np.zeros(0, np.int64)
        return cls(z, z, z, np.zeros(0, np.uint64), z, [])


@dataclass(frozen=True)
class BadLine:
    index: int
    line: str
    reason: str


def parse_text(data: bytes) -> tuple[LineBatch, list[BadLine]]:
    """Parse a chunk of slot-format text, whole lines as read from a file (bytes, UTF-8; the last line's
    newline optional): ``parse_lines`` of its lines, without a Python object per line on the way."""
    if not data:
        return LineBatch.empty(), []
    if not data.endswith(b"\n"):
        data += b"\n"
    batch = _parse_plain_bytes(data)
    if batch is not None:
        return batch, []
    # What a text-mode read of the file gives (undecodable bytes replaced, lines split at "\n" only).
    return parse_lines(data.decode("utf-8", "replace").split("\n")[:-1])


def parse_lines(lines: list[str]) -> tuple[LineBatch, list[BadLine]]:
    """Parse ``lines`` (without trailing newlines); return the valid ones as a batch and the bad ones."""
    lines = [ln.rstrip("\r\n") for ln in lines]
    lines = [ln for ln in lines if ln.strip()]  # blank lines are not samples, nor errors
    if not lines:
        return LineBatch.empty(), []
    text = "\n".join(lines) + "\n"
    if text.isascii():
        batch = _parse_plain_bytes(text.encode("ascii"), lines)
        if batch is not None:
            return batch, []
    if INTEGER_LINES_OK.fullmatch(text):
        batch = _parse_valid_chunk(lines, text)
        if batch is not None:
            return batch, []
    else:
        batch = _parse_chunk_with_values(lines, text)
        if batch is not None:
            return batch, []
    return _parse_line_by_line(lines)


def parse_plain_lines(lines: Sequence[str]) -> LineBatch | None:
    """``lines`` (one sample each: no newline inside, none blank) through the byte fast path alone: a batch
    with one row per line, or None when any line is not in the plain layout or is malformed (the caller then
    takes an exact path that names the bad line). Serving's requests take this path."""
    text = "\n".join(lines) + "\n"
    if not text.isascii() or text.count("\n") != len(lines):  # a newline inside a line is not one sample
        return None
    batch = _parse_plain_bytes(text.encode("ascii"), list(lines))
    if batch is None or len(batch) != len(lines):  # a blank line was dropped: not a sample here
        return None
    return batch


# The separators of the plain layout: space, ":" and newline (tabs and carriage returns take the older path).
_SPACE, _COLON, _NEWLINE = np.uint8(32), np.uint8(58), np.uint8(10)
# The grammar's bounds (slot_grammar.py) as numpy compares them: digit counts, even with leading zeros.
_SHOW_LIMIT = np.uint64(SHOW_LIMIT)


def _parse_plain_bytes(data: bytes, lines: list[str] | None = None) -> LineBatch | None:
    """The fast path over a chunk of ASCII text ending with a newline; None when the chunk is not in the
    plain layout or holds a malformed line (the caller then takes the older, exact paths).

    ``lines``: the chunk's lines when the caller has them (blank lines already dropped); else they are
    cut from ``data``.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    b = np.frombuffer(data, np.uint8)
    # Bytes that are not digits: the separators, and in value tokens their signs, points and exponents.
    other = np.flatnonzero((b - np.uint8(48)) > 9)
    kinds = b[other]
    sep = (kinds == _SPACE) | (kinds == _COLON) | (kinds == _NEWLINE)  # compares, not a table (see _value_bytes)
    if sep.all():
        seps, odd = other, other[:0]
    else:
        odd_at = np.flatnonzero(~sep)
        seps, odd = other[sep], other[odd_at]
        kinds = kinds[sep]
        if not _value_bytes(b[odd]).all():
            return None
    gaps = np.diff(seps)
    if seps[0] > 0 and (gaps > 1).all():
        # An odd byte's token is the separator after it: the separators before it in ``other``.
        odd_tok = odd_at - np.arange(len(odd_at)) if len(odd) else odd
        return _parse_plain_tokens(data, seps, gaps, kinds, odd, odd_tok, lines)
    # The token before separator k, if any, is data[prev[k] + 1 : seps[k]].
    prev = np.empty(len(seps), np.int64)
    prev[0] = -1
    prev[1:] = seps[:-1]
    length = seps - prev - 1
    colons = np.flatnonzero(kinds == _COLON)
    # Every ":" sits between two tokens (the chunk ends with a newline, so colons + 1 exists).
    if len(colons) and not ((length[colons] > 0).all() and (length[colons + 1] > 0).all()):
        return None
    if length.min() > 0:  # one separator between tokens, as writers write: every separator ends a token
        tok, starts, ends = None, prev + 1, seps
        follow = kinds
    else:
        tok = np.flatnonzero(length > 0)  # each token by the separator that ends it
        if not len(tok):
            return None
        starts, ends, follow = prev[tok] + 1, seps[tok], kinds[tok]
    n_tok = len(starts)
    is_feature = follow == _COLON  # the left part of a pair: a feasign or a dense slot's value
    # Each token's line among the chunk's raw lines: the newlines before it.
    newline = kinds == _NEWLINE
    raw_line = np.cumsum(newline) - newline
    if tok is not None:
        raw_line = raw_line[tok]
    per_line = np.bincount(raw_line, minlength=int(newline.sum()))
    nonblank = per_line > 0
    if not nonblank.all():  # lines of spaces only: not samples, nor errors (as parse_lines)
        raw_line = (np.cumsum(nonblank) - 1)[raw_line]
        per_line = per_line[nonblank]
    if per_line.min() < 2:
        return None
    first = np.cumsum(per_line) - per_line
    j = np.arange(n_tok, dtype=np.int64) - np.repeat(first, per_line)  # a token's place in its line
    # show, click, then feasign:slot pairs: a token is a pair's left part exactly at the even places from 2.
    if not np.array_equal(is_feature, (j >= 2) & ((j & 1) == 0)):
        return None
    is_value = None
    if len(odd):
        is_value = np.zeros(n_tok, bool)
        is_value[np.searchsorted(ends, odd, side="right")] = True
        if not is_feature[is_value].all():  # only a pair's left part may be a number that is not an integer
            return None
    bounds = np.empty(2 * n_tok, np.int64)
    bounds[0::2], bounds[1::2] = starts, ends
    # The tokens at the even places, the separators between them at the odd ones.
    whole = pa.LargeStringArray.from_buffers(2 * n_tok - 1, pa.py_buffer(bounds), pa.py_buffer(data))
    ints = np.arange(0, 2 * n_tok, 2) if is_value is None else 2 * np.flatnonzero(~is_value)
    try:
        numbers = _numpy_of(pc.cast(whole.take(_arrow_indices(ints)), pa.uint64()), np.uint64)
    except (pa.ArrowInvalid, ValueError):  # above 2**64-1: the reference names the line
        return None
    if is_value is None:
        at = None  # every token has its number, at its own place
        feature_tok = np.flatnonzero(is_feature)
        shows, clicks, slot_numbers = numbers[first], numbers[first + 1], numbers[feature_tok + 1]
        feasigns = numbers[feature_tok]
    else:
        at = np.cumsum(~is_value) - 1  # where each token's number is in ``numbers`` (value tokens have none)
        feature_tok = np.flatnonzero(is_feature & ~is_value)
        shows, clicks, slot_numbers = numbers[at[first]], numbers[at[first + 1]], numbers[at[feature_tok + 1]]
        feasigns = numbers[at[feature_tok]]
    length = ends - starts
    if (
        (clicks > 1).any()
        or (length[first + 1] != 1).any()  # click: "0" or "1", not "00"
        or (shows >= _SHOW_LIMIT).any()
        or (length[first] > SHOW_DIGITS).any()
        or (length[np.flatnonzero(is_feature) + 1] > SLOT_DIGITS).any()  # value tokens' slots too
        or (length[feature_tok] > FEASIGN_DIGITS).any()
    ):
        return None
    if lines is None:
        lines = data.decode("ascii").split("\n")[:-1]
        if not nonblank.all():
            lines = [ln for ln, keep in zip(lines, nonblank.tolist(), strict=True) if keep]
    batch = LineBatch(
        shows.astype(np.int64),
        clicks.astype(np.int64),
        raw_line[feature_tok],
        feasigns,
        slot_numbers.astype(np.int64),
        lines,
    )
    if is_value is not None:
        value_tok = np.flatnonzero(is_value)
        texts = whole.take(_arrow_indices(2 * value_tok))
        if not pc.all(pc.match_substring_regex(texts, _VALUE_TOKEN_RE2)).as_py():
            return None
        values = _numpy_of(pc.cast(texts, pa.float64()), np.float64).copy()
        if not np.isfinite(values).all():
            return None
        value_slots = numbers[at[value_tok + 1]]
        batch.value_line = raw_line[value_tok]
        batch.value_slots = value_slots.astype(np.int64)
        batch.values = values
    return batch


def _parse_plain_tokens(
    data: bytes, seps: np.ndarray, gaps: np.ndarray, kinds: np.ndarray, odd: np.ndarray, odd_tok: np.ndarray, lines
) -> LineBatch | None:
    """``_parse_plain_bytes`` of a chunk with one separator after each token (the layout every writer of the
    format produces): token i is ``data[seps[i - 1] + 1 : seps[i]]``, so token i + 1 has ``gaps[i] - 1``
    bytes (``gaps = np.diff(seps)``); ``odd``: the bytes of value tokens that are not digits, ``odd_tok``
    their tokens. The checks look at the separators' kinds, the few odd bytes and the longest token, not at
    every token's digits.

    Every number is converted where it stands: one pyarrow cast of the chunk seen as its tokens alternating
    with its separators, the separators (and the value tokens) null, so that nothing is copied to gather
    the tokens first (a ``take`` of the integer tokens cost as much as their conversion); the value tokens,
    checked against ``VALUE_NUMBER`` by where their odd bytes stand (pyarrow's regular expressions cost
    50 ns a token), get one cast to float64.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    # A line of k pairs is show, click, then the pairs: 2 + 2k tokens, so when every line has an even
    # number of tokens (each newline ends an odd-numbered token), every line starts at an even token and a
    # token's place in its line has the parity of its index: a colon must follow exactly the tokens at even
    # indices that do not start a line, and a space follows those that do. No token's line is needed for that.
    is_colon = kinds == _COLON
    ends_line = np.flatnonzero(kinds == _NEWLINE)  # each line's last token
    line_first = np.empty(len(ends_line), np.int64)
    line_first[0] = 0
    line_first[1:] = ends_line[:-1] + 1
    even_colon = is_colon[0::2]
    if (
        not (ends_line & 1).all()
        or is_colon[1::2].any()
        or even_colon[line_first >> 1].any()
        or int(np.count_nonzero(even_colon)) != len(even_colon) - len(line_first)
    ):
        return None
    feature_line = np.repeat(np.arange(len(ends_line), dtype=np.int64), (ends_line - line_first - 1) >> 1)
    n_tok = len(seps)
    # The tokens at the even places of ``whole``, the separators between them at the odd ones.
    bounds = np.empty(2 * n_tok, np.int64)
    bounds[0] = 0
    np.add(seps[:-1], 1, out=bounds[2::2])
    bounds[1::2] = seps
    buffer = pa.py_buffer(data)
    if len(odd):
        found = _value_tokens(data, seps, is_colon, odd, odd_tok)
        if found is None:
            return None
        value_tok, value_start = found
    else:
        value_tok = None
    # Which entries of ``whole`` the cast reads (a bitmap, little-endian): the tokens, 4 to a byte, less
    # the value tokens (token t is bit 2 * (t & 3) of byte t >> 2; each bit set once, so summing sets them).
    validity = np.full(n_tok // 4 + 1, 0x55, np.uint8)
    if value_tok is not None:
        cleared = np.bincount(value_tok >> 2, weights=1 << 2 * (value_tok & 3), minlength=len(validity))
        validity -= cleared.astype(np.uint8)
    whole = pa.LargeStringArray.from_buffers(2 * n_tok - 1, pa.py_buffer(bounds), buffer, pa.py_buffer(validity))
    try:
        numbers = _numpy_of(pc.cast(whole, pa.uint64()), np.uint64)[0::2]  # token i's number at i
    except (pa.ArrowInvalid, ValueError):  # above 2**64-1: the reference names the line
        return None
    shows, clicks = numbers[line_first], numbers[line_first + 1]
    # Digit counts, not values, are the grammar's bounds (leading zeros count): every integer token within the
    # feasign's and the show's 20 digits (one maximum), slots within 9, a click of one digit ("0", not "00").
    if (
        (clicks > 1).any()
        or (gaps[line_first] != 2).any()
        or (shows >= _SHOW_LIMIT).any()
        or max(int(seps[0]), _longest_integer(gaps, value_tok)) > min(FEASIGN_DIGITS, SHOW_DIGITS)
        or ((gaps[0::2] > SLOT_DIGITS + 1) & even_colon).any()  # token 2j + 1, a slot when even_colon[j]
    ):
        return None
    # The pairs are the even tokens that do not start a line (``even_colon``) and the odd tokens after them.
    int_pairs = even_colon
    if value_tok is not None:
        value_line = np.searchsorted(ends_line, value_tok)  # the first line end at or after it
        # Value tokens are pairs' left parts too. A line's tokens before its pairs are its show and click, so
        # the pair of token t of line L (t = 2L + 2 * (the pairs before it) + 2) is the chunk's (t >> 1) - L - 1th.
        keep = np.ones(len(feature_line), bool)
        keep[(value_tok >> 1) - value_line - 1] = False
        feature_line = feature_line[keep]
        int_pairs = even_colon.copy()
        int_pairs[value_tok >> 1] = False
    batch = LineBatch(
        shows.astype(np.int64),
        clicks.astype(np.int64),
        feature_line,
        numbers[0::2][int_pairs],
        numbers[1::2][int_pairs].astype(np.int64),
        TextLines.of_chunk(data, seps[ends_line]) if lines is None else lines,
    )
    if value_tok is not None:
        # The value tokens alone, alternating with what lies between them (null): the cast then reads
        # only them (over all of ``whole``, it cost 4x as much: a float64 for every entry).
        k = len(value_tok)
        value_bounds = np.empty(2 * k, np.int64)
        value_bounds[0::2], value_bounds[1::2] = value_start, seps[value_tok]
        texts = pa.LargeStringArray.from_buffers(
            2 * k - 1, pa.py_buffer(value_bounds), buffer, pa.py_buffer(np.full(k // 4 + 1, 0x55, np.uint8))
        )
        values = _numpy_of(pc.cast(texts, pa.float64()), np.float64)[0::2].copy()
        if not np.isfinite(values).all():  # an overflow (1e999): the reference names the line
            return None
        batch.value_line = value_line
        batch.value_slots = numbers[value_tok + 1].astype(np.int64)
        batch.values = values
    return batch


# The bytes of a value token besides its digits, by kind. Told apart by compares: a lookup in a 256-entry
# table indexes with a 64-bit copy of the bytes, which on a chunk's bytes cost more than all the compares.
_DOT, _PLUS, _MINUS, _E, _UPPER_E = (np.uint8(c) for c in b".+-eE")


def _value_bytes(c: np.ndarray) -> np.ndarray:
    """Which of the bytes ``c`` a value token may hold besides digits (anything else in a token sends the
    chunk to the older paths)."""
    return (c == _DOT) | (c == _PLUS) | (c == _MINUS) | (c == _E) | (c == _UPPER_E)


def _longest_integer(gaps: np.ndarray, value_tok: np.ndarray | None) -> int:
    """The most digits of an integer token after the chunk's first (token i + 1 has ``gaps[i] - 1`` bytes),
    value tokens set aside (their length is not bounded; one is never a line's first token)."""
    longest = int(gaps.max(initial=1)) - 1
    if value_tok is None or longest <= min(FEASIGN_DIGITS, SHOW_DIGITS):  # the usual case: no copy
        return longest
    int_gaps = gaps.copy()
    int_gaps[value_tok - 1] = 0
    return int(int_gaps.max(initial=1)) - 1


def _value_tokens(
    data: bytes, seps: np.ndarray, is_colon: np.ndarray, odd: np.ndarray, odd_tok: np.ndarray
) -> tuple[np.ndarray, np.ndarray] | None:
    """The tokens (indices, sorted) holding the ``odd`` bytes (``.+-eE``; ``odd_tok``: the token of each)
    and where each starts, when each is a pair's left part and a ``VALUE_NUMBER``; else None.

    ``VALUE_NUMBER`` with its alternatives merged: an optional sign, a mantissa of digits with at most one
    point and at least one digit, then optionally ``e`` or ``E``, an optional sign and at least one digit;
    and not a plain unsigned integer, which a token holding one of these bytes is not. So each token's odd
    bytes are checked where they stand, never its digits one by one: at most one exponent and one point,
    the point before the exponent, a sign only first or right after the exponent, and digits left on both
    sides of the exponent.
    """
    if not is_colon[odd_tok].all():  # a show, a click or a slot: never a value
        return None
    new = np.empty(len(odd_tok), bool)  # ``odd_tok`` is sorted: the odd bytes that start a token's run of them
    new[0] = True
    np.not_equal(odd_tok[1:], odd_tok[:-1], out=new[1:])
    value_tok = odd_tok[new]
    which = np.cumsum(new) - 1  # each odd byte's value token, 0 .. k-1
    k = len(value_tok)
    start, end = seps[value_tok - 1] + 1, seps[value_tok]  # a pair's left part is never the chunk's first token
    c = np.frombuffer(data, np.uint8)[odd]
    is_exp, is_dot = (c == _E) | (c == _UPPER_E), c == _DOT
    is_sign = (c == _PLUS) | (c == _MINUS)
    exp_at = end.copy()  # the exponent's position, or the token's end without one
    exp_at[which[is_exp]] = odd[is_exp]
    at = exp_at[which]
    lead_sign = np.zeros(k, np.int64)
    lead_sign[which[is_sign & (odd == start[which])]] = 1
    exp_sign = np.zeros(k, np.int64)
    exp_sign[which[is_sign & (odd == at + 1)]] = 1
    dots = np.bincount(which[is_dot], minlength=k)
    if (
        (np.bincount(which[is_exp], minlength=k) > 1).any()
        or (dots > 1).any()
        or (odd[is_dot] > at[is_dot]).any()
        or int(lead_sign.sum() + exp_sign.sum()) != int(np.count_nonzero(is_sign))  # each sign in its place
        or (exp_at - start - lead_sign - dots < 1).any()  # the mantissa's digits
        or ((exp_at < end) & (end - exp_at - 1 - exp_sign < 1)).any()  # the exponent's digits
    ):
        return None
    return value_tok, start


# pa.array and Array.to_numpy import pandas when it is installed (a third of a second, paid by the first
# chunk of every process, evaluation workers included): these two move numbers by their buffers instead.
def _arrow_indices(idx: np.ndarray):
    """An int64 numpy array as a pyarrow array."""
    import pyarrow as pa

    idx = np.ascontiguousarray(idx, dtype=np.int64)
    return pa.Array.from_buffers(pa.int64(), len(idx), [None, pa.py_buffer(idx)])


def _numpy_of(arr, dtype) -> np.ndarray:
    """The values of a pyarrow array without nulls of a fixed-width type, as numpy (read-only, sharing its buffer)."""
    return np.frombuffer(arr.buffers()[1], dtype=dtype, count=len(arr) + arr.offset)[arr.offset :]


# slot_grammar.VALUE_NUMBER as a whole token, for pyarrow's regular expressions (RE2 reads the same syntax).
_VALUE_TOKEN_RE2 = f"^{VALUE_NUMBER}$"


def _parse_chunk_with_values(lines: list[str], text: str) -> LineBatch | None:
    """The fast path for lines with value tokens; None when the chunk is not valid that way (the caller
    then parses line by line, which names the bad lines).

    One regular expression validates the chunk; numpy then splits it by bytes: in a valid chunk a token
    holding any of ``.+-eE`` is a value token, so blanking those tokens leaves the integer tokens for the
    usual parse, and blanking the others leaves ``value:slot`` pairs for one float parse.
    """
    if not _CHUNK_WITH_VALUES_OK.fullmatch(text):
        return None
    b = np.frombuffer(text.encode("ascii", "replace"), np.uint8)
    blank = _BLANK_BYTES[b]
    token = np.cumsum(blank, dtype=np.int32)  # a token's bytes share its number (blanks start a new one)
    is_value = np.zeros(int(token[-1]) + 1, bool)
    is_value[token[_VALUE_BYTES[b]]] = True
    in_value = is_value[token] & ~blank
    space = np.uint8(32)
    rest = np.where(in_value, space, b).tobytes().decode("ascii")
    pairs = np.where(in_value, b, space).tobytes().replace(b":", b" ").split()
    try:
        values = np.array(pairs[0::2], dtype=np.float64)
    except ValueError:  # a malformed number ("1.2.3"): the per-line parser names it
        return None
    if not np.isfinite(values).all():
        return None  # an overflow (1e999), likewise
    slots = np.array(pairs[1::2], dtype=np.int64)
    starts = np.flatnonzero(in_value & np.r_[True, ~in_value[:-1]])
    value_line = np.searchsorted(np.flatnonzero(b == 10), starts)
    if not INTEGER_LINES_OK.fullmatch(rest):  # the integer tokens' digit bounds (a 21-digit feasign)
        return None
    batch = _parse_valid_chunk(rest.split("\n")[:-1], rest)
    if batch is None:
        return None
    batch.lines = lines
    batch.value_line = value_line.astype(np.int64)
    batch.value_slots = slots.astype(np.int64)
    batch.values = values
    return batch


def _parse_valid_chunk(lines: list[str], text: str) -> LineBatch | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        numbers = np.fromstring(text.replace(":", " "), dtype=np.uint64, sep=" ")
    counts = np.fromiter((ln.count(":") for ln in lines), dtype=np.int64, count=len(lines))
    if len(numbers) != int(2 * len(lines) + 2 * counts.sum()):
        return None
    if (numbers == np.uint64(UINT64_MAX)).any():
        # fromstring saturates on overflow: let the exact parser decide.
        return None
    starts = np.zeros(len(lines), np.int64)
    np.cumsum(2 + 2 * counts[:-1], out=starts[1:])
    if (numbers[starts] >= _SHOW_LIMIT).any():  # a show beyond int64: the exact parser names the line
        return None
    shows = numbers[starts].astype(np.int64)
    clicks = numbers[starts + 1].astype(np.int64)
    is_feature = np.ones(len(numbers), bool)
    is_feature[starts] = False
    is_feature[starts + 1] = False
    pairs = numbers[is_feature]
    return LineBatch(
        shows,
        clicks,
        np.repeat(np.arange(len(lines), dtype=np.int64), counts),
        pairs[0::2].copy(),
        pairs[1::2].astype(np.int64),
        lines,
    )


def _parse_line_by_line(lines: list[str]) -> tuple[LineBatch, list[BadLine]]:
    shows, clicks, flines, feas, slots, good = [], [], [], [], [], []
    vlines, vslots, vals = [], [], []
    bad: list[BadLine] = []
    for i, ln in enumerate(lines):
        try:
            s = parse_sample_line(ln)
        except MalformedLine as e:
            bad.append(BadLine(i, ln, str(e)))
            continue
        row = len(good)
        good.append(ln)
        shows.append(s.show)
        clicks.append(s.click)
        flines.extend([row] * len(s.feasigns))
        feas.extend(s.feasigns)
        slots.extend(s.slots)
        vlines.extend([row] * len(s.values))
        vslots.extend(s.value_slots)
        vals.extend(s.values)
    batch = LineBatch(
        np.array(shows, np.int64),
        np.array(clicks, np.int64),
        np.array(flines, np.int64),
        np.array(feas, np.uint64),
        np.array(slots, np.int64),
        good,
        np.array(vlines, np.int64),
        np.array(vslots, np.int64),
        np.array(vals, np.float64),
    )
    return batch, bad


def concat_batches(batches: list[LineBatch]) -> LineBatch:
    """One batch holding all lines of ``batches``, in order."""
    batches = [b for b in batches if len(b)]
    if not batches:
        return LineBatch.empty()
    if len(batches) == 1:
        return batches[0]
    offsets = np.cumsum([0] + [len(b) for b in batches[:-1]])
    return LineBatch(
        np.concatenate([b.shows for b in batches]),
        np.concatenate([b.clicks for b in batches]),
        np.concatenate([b.feature_line + o for b, o in zip(batches, offsets, strict=True)]),
        np.concatenate([b.feasigns for b in batches]),
        np.concatenate([b.feature_slots for b in batches]),
        _concat_lines([b.lines for b in batches]),
        np.concatenate([b.value_line + o for b, o in zip(batches, offsets, strict=True)]),
        np.concatenate([b.value_slots for b in batches]),
        np.concatenate([b.values for b in batches]),
    )


def _concat_lines(parts: list) -> Sequence[str] | None:
    if any(p is None for p in parts):
        return None
    if all(isinstance(p, TextLines) for p in parts):
        return TextLines.concat(parts)
    return [ln for p in parts for ln in p]


def _take_lines(lines: Sequence[str] | None, rows: np.ndarray) -> Sequence[str] | None:
    if lines is None:
        return None
    if isinstance(lines, TextLines):
        return lines.take(rows)
    return [lines[i] for i in rows.tolist()]


def slice_batch(batch: LineBatch, start: int, stop: int) -> LineBatch:
    """Lines ``start:stop`` of a batch (features are stored in line order)."""
    lo, hi = np.searchsorted(batch.feature_line, [start, stop])
    vlo, vhi = np.searchsorted(batch.value_line, [start, stop])
    return LineBatch(
        batch.shows[start:stop],
        batch.clicks[start:stop],
        batch.feature_line[lo:hi] - start,
        batch.feasigns[lo:hi],
        batch.feature_slots[lo:hi],
        None if batch.lines is None else batch.lines[start:stop],
        batch.value_line[vlo:vhi] - start,
        batch.value_slots[vlo:vhi],
        batch.values[vlo:vhi],
    )


def take_rows(batch: LineBatch, rows: np.ndarray) -> LineBatch:
    """The lines at the sorted indices ``rows``."""
    rows = np.asarray(rows, dtype=np.int64)
    keep = np.zeros(len(batch), bool)
    keep[rows] = True
    fmask = keep[batch.feature_line]
    vmask = keep[batch.value_line]
    new_index = np.cumsum(keep) - 1
    return LineBatch(
        batch.shows[rows],
        batch.clicks[rows],
        new_index[batch.feature_line[fmask]],
        batch.feasigns[fmask],
        batch.feature_slots[fmask],
        _take_lines(batch.lines, rows),
        new_index[batch.value_line[vmask]],
        batch.value_slots[vmask],
        batch.values[vmask],
    )


def permute_rows(batch: LineBatch, order: np.ndarray) -> LineBatch:
    """The lines in the order ``order`` (a permutation of range(len(batch))), features kept line after line."""
    order = np.asarray(order, dtype=np.int64)
    new_line, src = _permuted(batch.feature_line, order, len(batch))
    value_line, vsrc = _permuted(batch.value_line, order, len(batch))
    return LineBatch(
        batch.shows[order],
        batch.clicks[order],
        new_line,
        batch.feasigns[src],
        batch.feature_slots[src],
        _take_lines(batch.lines, order),
        value_line,
        batch.value_slots[vsrc],
        batch.values[vsrc],
    )


def _permuted(item_line: np.ndarray, order: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Items stored line after line, lines put in ``order``: (each item's new line, where it comes from)."""
    counts = np.bincount(item_line, minlength=n)
    starts = np.cumsum(counts) - counts
    new_counts = counts[order]
    new_line = np.repeat(np.arange(len(order), dtype=np.int64), new_counts)
    within = np.arange(len(new_line), dtype=np.int64) - np.repeat(np.cumsum(new_counts) - new_counts, new_counts)
    return new_line, starts[order][new_line] + within


def batch_keys(batch: LineBatch, slots, sparse_dim: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Every slot's keys of the batch, slot after slot: (keys uint64[k], lengths int64[len(slots) * n]),
    one sequence per slot and line (slot 0's lines, then slot 1's, ...): the training net's KEYS_INPUT.

    The same rule as ``sample.slot_keys`` line by line (a test checks it): a
    line's keys of a slot in their order of appearance; one padding key when
    the line has none; features of other slots ignored. One stable sort of the batch's
    features by (slot, line) cell, not one pass per slot: Criteo has 39 slots.
    """
    n = len(batch)
    slots_arr = np.asarray(list(slots), dtype=np.int64)
    order = np.argsort(slots_arr, kind="stable")
    sorted_slots = slots_arr[order]
    if not len(slots_arr):
        return np.zeros(0, np.uint64), np.zeros(0, np.int64)
    pos = np.minimum(np.searchsorted(sorted_slots, batch.feature_slots), len(sorted_slots) - 1)
    known = np.flatnonzero(sorted_slots[pos] == batch.feature_slots)
    cells = order[pos[known]] * n + batch.feature_line[known]
    counts = np.bincount(cells, minlength=len(slots_arr) * n)
    empty = np.flatnonzero(counts == 0)
    keys = transform_keys(batch.feasigns[known], sparse_dim)
    if len(empty):
        pad_key = transform_keys(np.array([PADDING_FEASIGN], np.uint64), sparse_dim)[0]
        cells = np.concatenate([cells, empty])
        keys = np.concatenate([keys, np.full(len(empty), pad_key, np.uint64)])
        counts[empty] = 1
    return keys[np.argsort(cells, kind="stable")], counts.astype(np.int64)


def batch_dense(batch: LineBatch, dense_slots) -> np.ndarray:
    """float64 [n, len(dense_slots)]: each line's value of each dense slot, NaN where it has none
    (``dense_features.dense_matrix`` over the batch's value tokens and integer tokens)."""
    return dense_matrix(
        len(batch),
        dense_slots,
        batch.value_line,
        batch.value_slots,
        batch.values,
        batch.feature_line,
        batch.feasigns,
        batch.feature_slots,
    )
