"""A ``/v1/predict`` body of lines only, found in its bytes by one compiled pass: where each line lies.

``line_spans`` recognises the common body exactly, ``{"instances": [{"line": "..."}, ...]}`` (JSON
whitespace anywhere between tokens, no other key, each line printable ASCII without an escape), and
writes where each line's characters begin and end; any other body (another key such as ``routing_key``,
an escape, a byte outside printable ASCII, no instance at all, anything malformed) is -1, and the caller
decodes it as JSON as before (``instances.predict_body``). What it accepts, JSON decodes to the same
lines, so both paths give the same request.

Why compiled (numba, ``nogil``): on the event loop's thread, decoding a 32-line body as JSON (33 KB:
orjson, the check of its answer, the pick of the lines) took ~22 us of CPU with the GIL held, about a
tenth of all the GIL a request needs, while the batch workers wait for it; this pass takes the bytes
without the GIL, and the lines are then cut from one ASCII decode of the body.

The signature is given, so the kernel is compiled (or loaded from numba's cache) when this module is
imported, never by a request.
"""

from __future__ import annotations

import numpy as np
from numba import types

from ctr_foundation.compiled import compiled

_SPANS = types.Array(types.int64, 1, "C")
_SIGNATURE = types.int64(
    types.Array(types.uint8, 1, "C", readonly=True),  # body
    types.Array(types.uint64, 1, "C", readonly=True),  # words: the body's whole 8-byte words (the last bytes: none)
    _SPANS,  # starts
    _SPANS,  # ends
)

_QUOTE, _BACKSLASH = 34, 92
_ONES, _HIGH = np.uint64(0x0101010101010101), np.uint64(0x8080808080808080)


@compiled(_SIGNATURE)
def line_spans(body, words, starts, ends):
    """The number of lines of ``body`` (their spans written to ``starts`` and ``ends``, which must hold
    len(body) // 11 + 1), or -1 when the body is not exactly the shape above."""
    n = body.shape[0]
    if starts.shape[0] < n // 11 + 1 or ends.shape[0] < n // 11 + 1:
        raise ValueError("line_spans: starts and ends must hold len(body) // 11 + 1 spans")
    if words.shape[0] != n >> 3:
        raise ValueError("line_spans: words must be the body's whole 8-byte words")

    def plain(c):  # a byte a line's string may hold as it is: printable ASCII but the quote and backslash
        return 32 <= c <= 126 and c != _QUOTE and c != _BACKSLASH

    def string_end(i):  # the first byte from i that is not plain (n if none): 8 bytes a step between
        while i < n and i & 7 and plain(body[i]):
            i += 1
        if i < n and i & 7 == 0:
            j = i >> 3
            while j < n >> 3:
                # Any byte below 0x20, above 0x7e, a quote or a backslash sets its high bit here (the
                # word tricks of "Bit Twiddling Hacks": hasless, hasmore, haszero of the xor).
                w = words[j]
                less = (w - _ONES * np.uint64(0x20)) & ~w
                more = (w + _ONES) | w
                quote = w ^ (_ONES * np.uint64(_QUOTE))
                backslash = w ^ (_ONES * np.uint64(_BACKSLASH))
                flags = less | more | ((quote - _ONES) & ~quote) | ((backslash - _ONES) & ~backslash)
                if flags & _HIGH:
                    break
                j += 1
            i = j << 3
            while i < n and plain(body[i]):
                i += 1
        return i

    def skip(i):  # JSON whitespace: space, tab, newline, carriage return
        while i < n and (body[i] == 32 or body[i] == 9 or body[i] == 10 or body[i] == 13):
            i += 1
        return i

    def literal(i, text):  # i past ``text`` (after whitespace) when it is there, else -1
        i = skip(i)
        if i + len(text) > n:
            return -1
        for k in range(len(text)):
            if body[i + k] != ord(text[k]):
                return -1
        return i + len(text)

    i = literal(0, "{")
    i = literal(i, '"instances"') if i >= 0 else -1
    i = literal(i, ":") if i >= 0 else -1
    i = literal(i, "[") if i >= 0 else -1
    lines = 0
    while i >= 0:
        i = literal(i, "{")
        i = literal(i, '"line"') if i >= 0 else -1
        i = literal(i, ":") if i >= 0 else -1
        i = literal(i, '"') if i >= 0 else -1
        if i < 0:
            return -1
        start = i
        i = string_end(i)
        if i >= n or body[i] != _QUOTE:  # an escape, a byte outside printable ASCII, or the end
            return -1
        starts[lines], ends[lines] = start, i
        lines += 1
        i = literal(i + 1, "}")
        if i < 0:
            return -1
        after = literal(i, ",")
        if after < 0:
            break
        i = after
    i = literal(i, "]") if i >= 0 else -1
    i = literal(i, "}") if i >= 0 else -1
    if i < 0 or skip(i) != n:
        return -1
    return lines


def body_lines(body: bytes) -> list[str] | None:
    """The lines of a body of lines only (the shape above), in order; None for any other body."""
    n = len(body)
    data = np.frombuffer(body, np.uint8)
    words = np.frombuffer(body, np.uint64, count=n >> 3)
    if not words.flags.aligned:  # numba's signature takes aligned words (a bytes object's are, in CPython)
        words = words.copy()
    spans = n // 11 + 1
    starts, ends = np.empty(spans, np.int64), np.empty(spans, np.int64)
    lines = line_spans(data, words, starts, ends)
    if lines < 0:
        return None
    text = body.decode("ascii")  # every byte outside the lines is JSON's punctuation or whitespace
    return [text[a:z] for a, z in zip(starts[:lines].tolist(), ends[:lines].tolist(), strict=True)]
