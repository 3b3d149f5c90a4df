"""The hot-key cache's read of a batch's keys in one compiled pass: each key's set, its way, its row.

``gather_cached`` reads a VersionCache's flat tables (cache.py) as the numpy expression it replaces did
(hash the key to its set with the same multiplier and shift, compare it with the set's eight keys, copy
the matching way's row and found flag), and writes zeros and found = False for a key in no way. Why
compiled (numba, ``nogil``): the numpy read was a dozen passes over the batch (a take of every key's
whole set, a compare, a frexp for the way, takes of rows and flags), about 1.8 ms of a merged batch of
~20,000 keys, all of it holding the GIL that the event loop's thread needs to take requests in; here
it is one pass that touches each key's set line and row once, with the GIL released, so it overlaps
with the event loop on the other core.

The signature is given, so the kernel is compiled (or loaded from numba's cache) when this module is
imported, never by a request; read-only arrays accept writable ones.
"""

from __future__ import annotations

import numpy as np
from numba import types

from ctr_foundation.compiled import compiled

_SIGNATURE = types.int64(
    types.Array(types.uint64, 1, "C", readonly=True),  # keys: the batch's keys
    types.Array(types.uint64, 2, "C", readonly=True),  # table: each set's keys [sets, ways]
    types.Array(types.boolean, 1, "C", readonly=True),  # found: cube found the way's key [sets * ways]
    types.Array(types.float32, 2, "C", readonly=True),  # values: the way's row [sets * ways, width]
    types.uint64,  # mix: the hash's multiplier
    types.uint64,  # shift: a key's set is (key * mix) >> shift (mod 2**64)
    types.Array(types.boolean, 1, "C"),  # hit_out [n]
    types.Array(types.float32, 2, "C"),  # rows_out [n, width]
    types.Array(types.boolean, 1, "C"),  # found_out [n]
)


@compiled(_SIGNATURE)
def gather_cached(keys, table, found, values, mix, shift, hit_out, rows_out, found_out):
    """Fill ``hit_out``, ``rows_out`` and ``found_out`` for ``keys``; return the number of hits."""
    n = keys.shape[0]
    sets, ways = table.shape
    width = values.shape[1]
    if (
        hit_out.shape[0] != n
        or found_out.shape[0] != n
        or rows_out.shape[0] != n
        or rows_out.shape[1] != width
        or values.shape[0] != sets * ways
        or found.shape[0] != sets * ways
    ):
        raise ValueError("gather_cached: the outputs must hold n rows of the table's width; tables must match")
    if shift < 1 or shift > 64 or np.int64(1) << (64 - np.int64(shift)) != sets:
        raise ValueError("gather_cached: the shift must map every key to one of the table's sets")
    hits = 0
    for i in range(n):
        key = keys[i]
        s = np.int64((key * mix) >> shift)  # uint64 arithmetic wraps mod 2**64, as numpy's does
        at = -1
        for w in range(ways):
            if table[s, w] == key:
                at = s * ways + w
                break
        if at >= 0:
            hit_out[i] = True
            found_out[i] = found[at]
            for k in range(width):
                rows_out[i, k] = values[at, k]
            hits += 1
        else:
            hit_out[i] = False
            found_out[i] = False
            for k in range(width):
                rows_out[i, k] = 0.0
    return hits
