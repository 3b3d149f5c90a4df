"""Vectorised parsing of slot-format lines into column arrays, and per-slot key lists.

``parse_sample_line`` (sample.py) is the reference for one line, and
``ctr_foundation/slot_grammar.py`` owns the grammar (its limits, patterns and
messages); this module does the same for thousands of lines at once, because
a per-line Python parse caps a trainer at a few tens of thousands of lines per second.

``parse_text`` takes a chunk of the file as bytes (``parse_chunk``: as the
hourly reader reads it, lines in a buffer) and parses it in one compiled pass
(``byte_scan.py``): tokens found, checked and converted together. Anything
outside the plain layout (tabs, carriage returns, odd bytes, a malformed
token) sends the chunk to the older paths of ``parse_lines``: a regular
expression over the chunk with one ``np.fromstring``, and, when that
fails, the per-line parser, which names the bad lines. So a chunk the
fast path accepts parses as the reference would, and one it refuses is
counted and skipped exactly as before.

Before the compiled pass, the fast path was some twenty numpy and pyarrow
kernels over the chunk's bytes and tokens: 4.3 us of CPU a Criteo line (about
100 tokens and 1,000 bytes a line, 13 of the tokens dense values), against
0.45 us for pyarrow's bare split of the same lines into strings; converting the
integers (pyarrow, 10 ns a token) and finding the separators (``np.flatnonzero``
over every byte) alone took 1.6 us.
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
    INTEGER_LINES_OK,
    LEAD,
    SEP,
    SHOW,
    SHOW_LIMIT,
    SLOT,
    TRAIL,
    UINT64_MAX,
    MalformedLine,
)
from elastic_control.data import byte_scan

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
    def of_buffer(cls, buffer: np.ndarray, start: int, newlines: np.ndarray) -> TextLines:
        """The lines of ``buffer`` from ``start`` on, one after another, whose newlines are at ``newlines``."""
        import pyarrow as pa

        offsets = np.empty(len(newlines) + 1, np.int64)
        offsets[0] = start
        offsets[1:] = newlines + 1
        return cls(pa.LargeStringArray.from_buffers(len(newlines), pa.py_buffer(offsets), pa.py_buffer(buffer)))

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


@dataclass(frozen=True)
class TextChunk:
    """Whole lines of a file as bytes: ``buffer[start:end]``, the last line ending with a newline, and
    ``byte_scan.PADDING`` bytes readable after ``end``; ``lines`` newlines and ``colons`` colons in it
    (what the parse allocates for)."""

    buffer: np.ndarray  # uint8
    start: int
    end: int
    lines: int
    colons: int
    newline_added: bool = False  # the file's last line, given the newline it lacks

    @classmethod
    def of_bytes(cls, data: bytes) -> TextChunk:
        """``data`` (whole lines, the last ending with a newline) copied into a buffer of its own."""
        return cls.of_padded(data + bytes(byte_scan.PADDING))

    @classmethod
    def of_padded(cls, padded: bytes) -> TextChunk:
        """Whole lines followed by ``byte_scan.PADDING`` zero bytes, used where they lie (no copy)."""
        buffer = np.frombuffer(padded, np.uint8)
        end = len(buffer) - byte_scan.PADDING
        lines, colons = byte_scan.count(buffer, 0, end)
        return cls(buffer, 0, end, lines, colons)

    def data(self) -> bytes:
        return self.buffer[self.start : self.end].tobytes()


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
    return _parse_decoded(data)


def parse_chunk(chunk: TextChunk) -> tuple[LineBatch, list[BadLine]]:
    """``parse_text`` of a chunk of a file read into a buffer (``readers.read_text_chunks``), parsed where
    it lies."""
    if chunk.end == chunk.start:
        return LineBatch.empty(), []
    batch = _parse_plain_chunk(chunk)
    if batch is not None:
        return batch, []
    return _parse_decoded(chunk.data())


def _parse_decoded(data: bytes) -> tuple[LineBatch, list[BadLine]]:
    """The chunk as a text-mode read of the file gives it (undecodable bytes replaced, lines split at "\n"
    only), through ``parse_lines``."""
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
    # One copy into the parse's buffer: the lines, each with its newline, then the scan's padding (made
    # by the same join); the count the parse sizes its arrays with also finds a newline inside a line.
    text = "\n".join([*lines, _PADDING_TEXT])
    if not text.isascii():
        return None
    chunk = TextChunk.of_padded(text.encode("ascii"))
    if chunk.lines != len(lines):  # a newline inside a line is not one sample
        return None
    batch = _parse_plain_chunk(chunk, list(lines))
    if batch is None or len(batch) != len(lines):  # a blank line was dropped: not a sample here
        return None
    return batch


_PADDING_TEXT = "\0" * byte_scan.PADDING  # what TextChunk.of_padded expects after the lines


# The grammar's show bound as numpy compares it (the older paths' check).
_SHOW_LIMIT = np.uint64(SHOW_LIMIT)


def _parse_plain_bytes(data: bytes, lines: list[str] | None = None) -> LineBatch | None:
    """``_parse_plain_chunk`` of a chunk of ASCII text ending with a newline."""
    return _parse_plain_chunk(TextChunk.of_bytes(data), lines)


def _parse_plain_chunk(chunk: TextChunk, lines: list[str] | None = None) -> LineBatch | None:
    """The fast path (``byte_scan.scan``, one compiled pass); None when the chunk is not in the plain layout
    or holds a malformed line (the caller then takes the older, exact paths).

    ``lines``: the chunk's lines when the caller has them (blank lines already dropped); else they are
    the chunk's bytes, kept as ``TextLines``.
    """
    found = byte_scan.scan(chunk.buffer, chunk.start, chunk.end, chunk.lines, chunk.colons)
    if found is None:
        return None
    shows, clicks, ends, feature_line, feasigns, feature_slots, value_line, value_slots, values, inexact, blank = found
    if len(inexact):
        # Value tokens the compiled pass does not convert exactly (more than 2**53, or a large exponent):
        # read as the per-line parser reads them; an overflow (1e999) is for the reference to name.
        data = chunk.buffer
        for index, start, end in inexact.reshape(-1, 3).tolist():
            values[index] = float(data[start:end].tobytes())
        if not np.isfinite(values).all():
            return None
    if lines is None:
        if blank:  # lines of spaces only, dropped as parse_lines drops them
            lines = [ln for ln in chunk.data().decode("ascii").split("\n")[:-1] if ln.strip()]
        else:
            lines = TextLines.of_buffer(chunk.buffer, chunk.start, ends)
    batch = LineBatch(shows, clicks, feature_line, feasigns, feature_slots, lines)
    if len(values):
        batch.value_line, batch.value_slots, batch.values = value_line, value_slots, values
    return batch


# pa.array imports pandas when it is installed (a third of a second, paid by the first chunk of every
# process, evaluation workers included): this moves the numbers by their buffer instead.
def _arrow_indices(idx: np.ndarray):
    """An int64 numpy array as a pyarrow array."""
    import pyarrow as pa

    idx = np.ascontiguousarray(idx, dtype=np.int64)
    return pa.Array.from_buffers(pa.int64(), len(idx), [None, pa.py_buffer(idx)])


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
