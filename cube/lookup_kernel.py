"""The answer to a batch of keys in one compiled pass: rows and found-bitmap written into the answer's buffer.

``gather_answer`` runs the same search as ``ShardIndex.positions`` (the top-bits offset table, then a
fixed-depth lower bound from the bucket's first row), so both find the same row for every key, and
writes what a lookup answers: each key's row (zeros for a missing key) and then the found-bitmap (bit i
of byte i // 8, least significant first). Why compiled (numba, ``nogil``): the numpy search is some
twelve calls over the batch, ~1 us of call overhead each, which at 26 keys a request cost more than the
lookup itself; here a whole 26-key answer is one call (3-4 us of CPU). Each phase is one loop over the
batch whose iterations are independent and free of branches that depend on the data, so the cache
misses of different keys overlap (on 10M keys every key misses in the table, the keys and the rows).
Past a few thousand keys the numpy passes are faster still (``COMPILED_MAX_KEYS`` in lookup_index.py).

The signature is given, so the kernel is compiled (or loaded from numba's cache) when this module is
imported, never by a lookup; one signature for every caller: read-only arrays accept writable ones.
"""

from __future__ import annotations

import numpy as np
from numba import types

from ctr_foundation.compiled import compiled

_KEYS = types.Array(types.uint64, 1, "C", readonly=True)
_SIGNATURE = types.int64(
    _KEYS,  # query
    types.Array(types.int64, 1, "C", readonly=True),  # start: first row of each bucket, then the row count
    types.uint64,  # shift: a key's bucket is key >> shift
    types.int64,  # steps: 2**steps > the widest bucket
    _KEYS,  # keys: the shard's sorted keys
    types.Array(types.uint32, 2, "C", readonly=True),  # rows: the values as 32-bit words, one row a key
    types.Array(types.uint8, 1, "C"),  # out: n rows of 4 * dim bytes, then ceil(n / 8) bitmap bytes
)


@compiled(_SIGNATURE)
def gather_answer(query, start, shift, steps, keys, rows, out):
    """Write the answer to ``query`` into ``out`` (sized n * 4 * dim + ceil(n / 8)); return the misses."""
    n = query.shape[0]
    width = rows.shape[1]
    if out.shape[0] != n * width * 4 + ((n + 7) >> 3) or rows.shape[0] != keys.shape[0] or keys.shape[0] == 0:
        raise ValueError("gather_answer: out must hold n rows and the bitmap; rows and keys must match")
    last_bucket = np.uint64(start.shape[0] - 2)
    last_row = keys.shape[0] - 1
    # Each key's bucket start; keys above the table's top bit go to the last bucket (and are not found).
    pos = np.empty(n, np.int64)
    for i in range(n):
        pos[i] = start[min(query[i] >> shift, last_bucket)]
    # Lower bound in fixed-depth power-of-two steps (ShardIndex.positions explains why no upper bound).
    step = 1 << (steps - 1)
    while step:
        for i in range(n):
            p = pos[i]
            pos[i] = p + step if keys[min(p + step - 1, last_row)] < query[i] else p
        step >>= 1
    words = out[: n * width * 4].view(np.uint32)
    bitmap_at = n * width * 4
    misses = 0
    byte = 0
    for i in range(n):
        p = min(pos[i], last_row)
        hit = keys[p] == query[i]
        mask = np.uint32(0xFFFFFFFF) if hit else np.uint32(0)  # a missing key's row is zeros
        at = i * width
        for k in range(width):
            words[at + k] = rows[p, k] & mask
        byte |= np.int64(hit) << (i & 7)
        misses += 1 - np.int64(hit)
        if i & 7 == 7:
            out[bitmap_at + (i >> 3)] = byte
            byte = 0
    if n & 7:
        out[bitmap_at + (n >> 3)] = byte
    return misses
