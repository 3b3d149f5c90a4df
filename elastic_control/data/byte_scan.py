"""One compiled pass over a chunk of slot-format lines: tokens found, checked and converted together.

``scan`` reads a chunk's bytes once, line by line, and writes every line's show and click, its
``feasign:slot`` pairs and its value tokens (``2.5:40``) straight into the output arrays. It takes the
plain layout only (fields separated by spaces, lines by newlines; blank lines skipped) and refuses the
whole chunk at the first byte outside it or the first field the grammar refuses (``slot_grammar.py``:
digit counts, a show below 2**63, a feasign at most 2**64-1, a value token's form), so that the caller
can hand the chunk to the exact paths, which name the bad line.

Why compiled (numba, ``nogil``): the earlier parse was some twenty numpy and pyarrow kernels, each
visiting every byte or token of the chunk (4.3 us of CPU a Criteo line, where pyarrow's bare split of
the same lines takes 0.45 us); here each byte is read once; an integer token's digits are counted 32 bytes
at a time (``_digit_count``), its last 16 digits converted by vector multiplies (``_value16``) and the
others eight at a time (one 64-bit load and three multiplies; ``_value8``). A value token
is converted exactly when its digits make an integer of at most 2**53 and its decimal exponent is
within 10**22 (one correctly rounded multiply or divide of two exact doubles); any other is left to
the caller (``float``), which reads it as the per-line parser does.

The walk goes from separator to separator (space, newline, colon), taken from bit masks of 64 bytes
(``_byte_mask``: one vector compare), so that a field's start never waits for the digits of the field
before it to be read; the same masks count a chunk's lines and colons (``count``, ``chunk_end``) at 0.04 us
of CPU a Criteo line, a third of what numba's vectorised byte loop took. The input holds ``PADDING`` bytes
after the chunk: 64-byte blocks are read from its start, and a token's digits eight bytes at a time.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.cpython.unsafe.numbers import trailing_zeros
from numba.extending import intrinsic

from ctr_foundation.compiled import compiled
from ctr_foundation.slot_grammar import FEASIGN_DIGITS, SHOW_LIMIT, SLOT_DIGITS

# Bytes readable after a chunk's last byte: its bytes are read 64 at a time (``_byte_mask``), from its start.
PADDING = 64
_BLOCK = 64

_SPACE, _NEWLINE, _COLON = 32, 10, 58
_PLUS, _MINUS, _DOT, _E, _UPPER_E = 43, 45, 46, 101, 69
_U8 = np.uint64(8)
_ONE = np.uint64(1)
_ZEROS = np.uint64(0x3030303030303030)  # "0" in every byte
_HIGH_NIBBLES = np.uint64(0xF0F0F0F0F0F0F0F0)
_SIXES = np.uint64(0x0606060606060606)
_LOW_BYTES = np.uint64(0x000000FF000000FF)
_TIMES_100_AND_1E6 = np.uint64(100 + (1000000 << 32))
_TIMES_1_AND_1E4 = np.uint64(1 + (10000 << 32))
_E8 = np.uint64(10**8)
_E16 = np.uint64(10**16)
# A 20-digit integer is hi * 10**16 + lo (hi of 4 digits): above 2**64-1 when hi > 1844, or hi == 1844
# and lo > 6744073709551615.
_TOP_HI = np.uint64((2**64 - 1) // 10**16)
_TOP_LO = np.uint64((2**64 - 1) % 10**16)
_SHOW_LIMIT = np.uint64(SHOW_LIMIT)
_MAX_EXACT = np.uint64(2**53)  # integers up to here are exact doubles
_POWERS = np.array([10.0**k for k in range(23)], np.float64)  # exact doubles, 1e0 .. 1e22
_POWERS_INT = np.array([10**k for k in range(8)], np.uint64)
assert FEASIGN_DIGITS == 20 and SLOT_DIGITS == 9  # what _integer and scan check


def _small(func):
    """A helper of a few instructions, compiled on its own (numba types it once) and inlined by LLVM into
    its callers. Inlining every helper in numba's own IR made the pass 3-8% faster but took 6.5 s of CPU to
    compile, against 2.9 s with none inlined so and 3.5 s (and 3-4% slower) as now."""
    return njit(func)


def _inline(func):
    """A helper inlined in numba's IR (a call to another compiled function that LLVM does not inline costs a
    call and a tuple through memory per token)."""
    return njit(inline="always")(func)


def _vector_at(context, builder, signature, args, lanes: int):
    """An intrinsic's ``b[i:i + lanes]`` (its two arguments) as one vector of bytes, read by one load."""
    data = context.make_array(signature.args[0])(context, builder, args[0]).data
    vector = ir.VectorType(ir.IntType(8), lanes)
    return builder.load(builder.bitcast(builder.gep(data, [args[1]]), vector.as_pointer()), align=1)


def _byte_mask(*wanted: int):
    """A kernel ``(b, i) -> uint64`` whose bit k says whether ``b[i + k]`` is one of the bytes ``wanted``: one
    64-byte load and a compare per byte value (on AVX-512 a mask register, else a few byte-mask moves). numba
    does not turn a loop over 64 bytes into that (its loop built the mask bit by bit: 0.16 ns a byte)."""

    @intrinsic
    def byte_mask(typingctx, array, index):
        def codegen(context, builder, signature, args):
            block = _vector_at(context, builder, signature, args, _BLOCK)
            vector = block.type
            hits = [builder.icmp_unsigned("==", block, ir.Constant(vector, [w] * _BLOCK)) for w in wanted]
            hit = hits[0]
            for other in hits[1:]:
                hit = builder.or_(hit, other)
            return builder.bitcast(hit, ir.IntType(_BLOCK))

        return types.uint64(array, types.intp), codegen

    return byte_mask


@intrinsic
def _digit_count(typingctx, array, index):
    """``(b, i) -> int64``: how many ASCII digits start ``b[i:]``, up to 32 (32 bytes compared at once, where
    three 8-byte words were tested one after the other)."""

    def codegen(context, builder, signature, args):
        block = _vector_at(context, builder, signature, args, 32)
        i64 = ir.IntType(64)
        other = builder.icmp_unsigned(
            ">", builder.sub(block, ir.Constant(block.type, [48] * 32)), ir.Constant(block.type, [9] * 32)
        )
        bits = builder.or_(builder.zext(builder.bitcast(other, ir.IntType(32)), i64), ir.Constant(i64, 1 << 32))
        cttz = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(i64, [i64, ir.IntType(1)]), "llvm.cttz.i64"
        )
        return builder.call(cttz, [bits, ir.Constant(ir.IntType(1), 1)])

    return types.int64(array, types.intp), codegen


@intrinsic
def _value16(typingctx, array, index):
    """``(b, i) -> uint64``: the number the 16 ASCII digits ``b[i:i + 16]`` write: each digit times its power
    of ten, summed (vector multiplies and one reduction, a third faster than two ``_value8``)."""

    def codegen(context, builder, signature, args):
        block = _vector_at(context, builder, signature, args, 16)
        wide = ir.VectorType(ir.IntType(64), 16)
        digits = builder.zext(builder.sub(block, ir.Constant(block.type, [48] * 16)), wide)
        terms = builder.mul(digits, ir.Constant(wide, [10 ** (15 - k) for k in range(16)]))
        add = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.IntType(64), [wide]), "llvm.vector.reduce.add.v16i64"
        )
        return builder.call(add, [terms])

    return types.uint64(array, types.intp), codegen


_newlines = _byte_mask(_NEWLINE)
_colons = _byte_mask(_COLON)
_separators = _byte_mask(_SPACE, _NEWLINE, _COLON)


@_small
def _popcount(x):
    """Set bits of a uint64 (LLVM turns this into one popcnt)."""
    x = x - ((x >> _ONE) & np.uint64(0x5555555555555555))
    x = (x & np.uint64(0x3333333333333333)) + ((x >> np.uint64(2)) & np.uint64(0x3333333333333333))
    x = (x + (x >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return np.int64((x * np.uint64(0x0101010101010101)) >> np.uint64(56))


@_small
def _load8(b, i):
    """The 8 bytes at ``b[i:]`` as one little-endian word (byte i lowest), read by one load."""
    j = np.uint64(i)  # an unsigned index: no wraparound test per byte, so the 8 reads merge into one
    w = np.uint64(0)
    for k in range(8):
        w |= np.uint64(b[j + np.uint64(k)]) << np.uint64(8 * k)
    return w


@_inline
def _digits(w):
    """How many of the word's first bytes, from the lowest, are ASCII digits (8: all of them)."""
    # A byte is a digit when its high nibble is 3 and adding 6 keeps it so. A carry out of a non-digit
    # byte can only spoil the bytes after it, never the first non-digit.
    other = ((w & _HIGH_NIBBLES) ^ _ZEROS) | (((w + _SIXES) & _HIGH_NIBBLES) ^ _ZEROS)
    if other == 0:
        return 8
    return np.int64(trailing_zeros(other)) >> 3


@_small
def _value8(w, k):
    """The number the word's first ``k`` bytes (0..8, ASCII digits) write (0 for none)."""
    # Shifted so that the k digits are the word's last bytes, the bytes before them 0: then pairs, fours
    # and the eight digits combine by multiplies (borrows from the bytes after the digits are shifted out).
    # Two shifts of half as many bits each, so that k = 0 shifts every byte out (one of 64 bits would not).
    half = np.uint64(4 * (8 - k))
    x = ((w - _ZEROS) << half) << half
    x = x * np.uint64(10) + (x >> _U8)
    return (
        (x & _LOW_BYTES) * _TIMES_100_AND_1E6 + ((x >> np.uint64(16)) & _LOW_BYTES) * _TIMES_1_AND_1E4
    ) >> np.uint64(32)


@_inline
def _integer(b, i):
    """(value, digit count) of the ASCII digits at ``b[i:]``; count -1 for more than 20 digits or a value
    above 2**64-1 (counting leading zeros, as the grammar does)."""
    return _integer_of(b, i, _digit_count(b, i))


@_inline
def _integer_of(b, i, k):
    """``_integer`` of the ``k`` digits at ``b[i:]`` (``_digit_count``: all of them)."""
    if k <= 8:
        return _value8(_load8(b, i), k), k
    if k <= 16:
        return _value8(_load8(b, i), k - 8) * _E8 + _value8(_load8(b, i + k - 8), 8), k
    if k > FEASIGN_DIGITS:
        return np.uint64(0), -1
    hi = _value8(_load8(b, i), k - 16)
    lo = _value16(b, i + k - 16)
    if hi > _TOP_HI or (hi == _TOP_HI and lo > _TOP_LO):
        return np.uint64(0), -1
    return hi * _E16 + lo, k


@_small
def _u(i):
    """An index as numba takes it without a test for a negative one (wraparound) at every access: in the walk,
    the tests and the array lengths they keep in registers cost 6% of the pass."""
    return np.uint64(i)


@_inline
def _nondigits(w, k):
    """Nonzero when any of the word's first ``k`` bytes (0..8, from the lowest) is not an ASCII digit."""
    other = ((w & _HIGH_NIBBLES) ^ _ZEROS) | (((w + _SIXES) & _HIGH_NIBBLES) ^ _ZEROS)  # as in _digits
    half = np.uint64(4 * k)
    return other & (((_ONE << half) << half) - _ONE)  # two shifts: k = 8 keeps every byte


@_inline
def _point_value(b, i, whole, n):
    """(value, True) when the ``n`` bytes at ``b[i:]`` are ``whole`` digits (their count, from
    ``_digit_count``), a point and digits, fewer than 8 on either side and at least one (Criteo's
    "1.38629"): ``_value_token``'s usual form and its arithmetic, without finding the token's end, which
    the separators gave; else (0.0, False)."""
    fraction = n - whole - 1
    if b[_u(i + whole)] != _DOT or whole >= 8 or fraction < 0 or fraction >= 8 or n < 2:
        return 0.0, False
    f = _load8(b, i + whole + 1)
    if _nondigits(f, fraction) != 0:
        return 0.0, False
    number = np.int64(_value8(_load8(b, i), whole) * _POWERS_INT[_u(fraction)] + _value8(f, fraction))
    return np.float64(number) / _POWERS[_u(fraction)], True


@_inline
def _value_token(b, i):
    """A value token at ``b[i:]`` (slot_grammar.VALUE_NUMBER: an optional sign, digits with at most one
    point and at least one digit, optionally an exponent of an optional sign and digits) up to its ``:``:
    (where the ``:`` is or -1 when the token is not one, the value, whether the value is exact)."""
    c = b[i]
    negative = c == _MINUS
    signed = c == _PLUS or c == _MINUS
    if signed:
        i += 1
        c = b[i]
    # The usual form first (Criteo's "1.38629"): a sign or a point, fewer than 8 digits on either side of
    # it and no exponent, read a word at a time; the exact value is then one division of exact doubles.
    w = _load8(b, i)
    whole = _digits(w)
    point = b[i + whole] == _DOT
    f = _load8(b, i + whole + 1)
    fraction = _digits(f) if point else 0
    end = i + whole + point + fraction
    if b[end] == _COLON and (signed or point) and 0 < whole + fraction and whole < 8 and fraction < 8:
        number = np.int64(_value8(w, whole) * _POWERS_INT[fraction] + _value8(f, fraction))  # below 10**14
        value = np.float64(number) / _POWERS[fraction]
        return end, -value if negative else value, True
    mantissa = np.uint64(0)  # its first 19 significant digits
    digits = 0
    significant = 0
    after_point = 0
    point = False
    while True:
        d = np.uint64(c) - np.uint64(48)
        if d <= np.uint64(9):
            digits += 1
            if significant > 0 or d != 0:
                significant += 1
                if significant <= 19:
                    mantissa = mantissa * np.uint64(10) + d
            if point:
                after_point += 1
        elif c == _DOT and not point:
            point = True
        else:
            break
        i += 1
        c = b[i]
    if digits == 0:
        return -1, 0.0, False
    exponent = 0
    if c == _E or c == _UPPER_E:
        i += 1
        c = b[i]
        exponent_negative = c == _MINUS
        if c == _PLUS or c == _MINUS:
            i += 1
            c = b[i]
        exponent_digits = 0
        while np.uint64(c) - np.uint64(48) <= np.uint64(9):
            exponent_digits += 1
            if exponent < 100000:  # beyond any double's exponent: not exact here either way
                exponent = exponent * 10 + (c - 48)
            i += 1
            c = b[i]
        if exponent_digits == 0:
            return -1, 0.0, False
        if exponent_negative:
            exponent = -exponent
    if c != _COLON:
        return -1, 0.0, False
    scale = exponent - after_point
    if mantissa == 0:
        value = 0.0
    elif significant <= 19 and mantissa <= _MAX_EXACT and -22 <= scale <= 22:
        value = np.float64(mantissa)
        value = value * _POWERS[scale] if scale >= 0 else value / _POWERS[-scale]
    else:
        return i, 0.0, False
    return i, -value if negative else value, True


@compiled
def count(b, start, stop):
    """(newlines, colons) in ``b[start:stop]``: the most rows and tokens its lines can have (64 bytes at a
    time: two compares to bit masks and their popcounts, 0.03 ns a byte)."""
    newlines = colons = 0
    for i in range(start, stop, _BLOCK):
        newline, colon = _newlines(b, i), _colons(b, i)
        if stop - i < _BLOCK:  # the bytes past stop are not the caller's
            keep = (_ONE << np.uint64(stop - i)) - _ONE
            newline &= keep
            colon &= keep
        newlines += _popcount(newline)
        colons += _popcount(colon)
    return newlines, colons


@compiled
def chunk_end(b, start, stop, lines):
    """Where the ``lines``-th line from ``start`` ends (after its newline) in ``b[start:stop]``, or -1 when
    fewer end there; and (newlines, colons) up to that end (to ``stop`` when -1)."""
    newlines = colons = 0
    for i in range(start, stop, _BLOCK):
        newline, colon = _newlines(b, i), _colons(b, i)
        if stop - i < _BLOCK:
            keep = (_ONE << np.uint64(stop - i)) - _ONE
            newline &= keep
            colon &= keep
        found = _popcount(newline)
        if newlines + found >= lines:  # the line ends in this block: at its (lines - newlines)-th newline
            for _ in range(lines - newlines - 1):
                newline &= newline - _ONE
            end = i + np.int64(trailing_zeros(newline)) + 1
            below = (_ONE << np.uint64(end - i)) - _ONE if end - i < _BLOCK else ~np.uint64(0)
            return end, lines, colons + _popcount(colon & below)
        newlines += found
        colons += _popcount(colon)
    return -1, newlines, colons


@_inline
def _slot(b, i, n):
    """``_integer`` of the field of ``n`` bytes at ``b[i:]`` (a slot: its digit count is compared with ``n``):
    one or two digits (most slots) read as bytes, 9% of the pass faster than counting them; others by
    ``_integer``."""
    first = np.uint64(b[_u(i)]) - np.uint64(48)
    second = np.uint64(b[_u(i + 1)]) - np.uint64(48)  # the separator when n is 1: within the chunk
    if n == 1:
        return first, 1 if first <= np.uint64(9) else -1
    if n == 2:
        return first * np.uint64(10) + second, 2 if first <= np.uint64(9) and second <= np.uint64(9) else -1
    return _integer(b, i)


@_inline
def _next_separator(b, block, mask):
    """The next space, newline or colon: (its index, the block it is in, the block's separators after it),
    from ``block`` (a 64-byte block's first index) and ``mask`` (its separators not yet taken)."""
    while mask == 0:
        block += _BLOCK
        mask = _separators(b, block)
    return block + np.int64(trailing_zeros(mask)), block, mask & (mask - _ONE)


@compiled
def _fill(b, start, end, out, counts):
    """The parse itself (``scan``), into the arrays ``out``, large enough; False at the first thing outside
    the plain layout or the grammar. ``counts``: rows, pairs, value tokens, inexact value tokens and blank
    lines written.

    The walk goes from separator to separator (space, newline, colon), taken from 64-byte bit masks: the
    next field's start does not wait for the last field's digits to be read, so the fields' conversions
    overlap (walking byte to byte, each token's start waited on the end of the one before: 10 ns a token)."""
    shows, clicks, ends, feature_line, feasigns, feature_slots, value_line, value_slots, values, inexact = out
    rows = features = tokens = left = blank = 0
    block = start
    mask = _separators(b, block)
    i = start  # the first byte of the field after the last separator taken
    while i < end:
        p, block, mask = _next_separator(b, block, mask)
        c = b[_u(p)]
        if p == i:  # a separator where a line's show belongs
            i += 1
            if c == _SPACE:  # leading spaces
                continue
            if c == _NEWLINE:  # a blank line: not a sample
                blank += 1
                continue
            return False
        show, k = _integer(b, i)
        if c != _SPACE or k != p - i or show >= _SHOW_LIMIT:
            return False
        i = p + 1
        p, block, mask = _next_separator(b, block, mask)
        while p == i and b[_u(p)] == _SPACE:
            i += 1
            p, block, mask = _next_separator(b, block, mask)
        click = np.int64(b[_u(i)]) - 48
        c = b[_u(p)]
        if p != i + 1 or click < 0 or click > 1 or (c != _SPACE and c != _NEWLINE):
            return False
        shows[_u(rows)] = np.int64(show)
        clicks[_u(rows)] = click
        i = p + 1
        while c != _NEWLINE:
            p, block, mask = _next_separator(b, block, mask)
            c = b[_u(p)]
            if p == i:
                i += 1
                if c == _SPACE:
                    continue
                if c == _NEWLINE:  # trailing spaces
                    break
                return False
            if c != _COLON:
                return False
            k = _digit_count(b, i)
            is_value = k != p - i  # a byte other than a digit before the colon
            feasign = np.uint64(0)
            if not is_value:
                feasign, k = _integer_of(b, i, k)
                if k < 0:  # more than 20 digits, or above 2**64-1
                    return False
            else:
                if k > 16 and _integer_of(b, i, k)[1] < 0:  # as for an integer token: refused here
                    return False
                value, exact = _point_value(b, i, k, p - i)
                if not exact:
                    colon, value, exact = _value_token(b, i)
                    if colon != p:
                        return False
                    if not exact:
                        inexact[3 * left] = tokens
                        inexact[3 * left + 1] = i
                        inexact[3 * left + 2] = p
                        left += 1
                values[_u(tokens)] = value
            i = p + 1
            p, block, mask = _next_separator(b, block, mask)
            c = b[_u(p)]
            slot, k = _slot(b, i, p - i)
            if k != p - i or k <= 0 or k > SLOT_DIGITS or (c != _SPACE and c != _NEWLINE):
                return False
            if is_value:
                value_line[_u(tokens)] = rows
                value_slots[_u(tokens)] = np.int64(slot)
                tokens += 1
            else:
                feature_line[_u(features)] = rows
                feasigns[_u(features)] = feasign
                feature_slots[_u(features)] = np.int64(slot)
                features += 1
            i = p + 1
        ends[_u(rows)] = p
        rows += 1
        i = p + 1
    counts[0], counts[1], counts[2], counts[3], counts[4] = rows, features, tokens, left, blank
    return True


@compiled
def _scan(b, start, end, lines, colons):
    shows = np.empty(lines, np.int64)
    clicks = np.empty(lines, np.int64)
    ends = np.empty(lines, np.int64)
    feature_line = np.empty(colons, np.int64)
    feasigns = np.empty(colons, np.uint64)
    feature_slots = np.empty(colons, np.int64)
    value_line = np.empty(colons, np.int64)
    value_slots = np.empty(colons, np.int64)
    values = np.empty(colons, np.float64)
    inexact = np.empty(3 * colons, np.int64)
    counts = np.zeros(5, np.int64)
    out = (shows, clicks, ends, feature_line, feasigns, feature_slots, value_line, value_slots, values, inexact)
    ok = _fill(b, start, end, out, counts)
    rows, features, tokens, left = counts[0], counts[1], counts[2], counts[3]
    # The value tokens' arrays are sized for every token: copied down (a tenth of the pairs' bytes on Criteo
    # lines), not kept as views of mostly unused memory.
    return (
        ok,
        shows[:rows],
        clicks[:rows],
        ends[:rows],
        feature_line[:features],
        feasigns[:features],
        feature_slots[:features],
        value_line[:tokens].copy(),
        value_slots[:tokens].copy(),
        values[:tokens].copy(),
        inexact[: 3 * left],
        counts[4],
    )


def scan(buffer: np.ndarray, start: int, end: int, lines: int, colons: int):
    """The lines ``buffer[start:end]`` (uint8; the last ending with a newline; ``PADDING`` readable bytes
    after ``end``; ``lines`` newlines and ``colons`` colons among them) in the plain layout: None when they
    are not, or when a field breaks the grammar; else (shows, clicks, each row's newline, feature_line,
    feasigns, feature_slots, value_line, value_slots, values, inexact, blank lines). The value tokens
    ``inexact`` (their index in ``values``, start and end: three numbers each) are 0.0 in ``values``, for
    the caller to convert."""
    ok, *arrays = _scan(buffer, start, end, lines, colons)
    return tuple(arrays) if ok else None
