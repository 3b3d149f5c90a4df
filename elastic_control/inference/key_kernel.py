"""The keys of a batch with one key a (row, slot) cell, in one compiled pass: each feature's key written to
its cell, the padding key to every cell left empty.

``one_key_cells`` is the common case of ``scoring.key_batch`` (serving's Criteo lines: every slot of a line
has one feature, or none and the padding): there the batch's keys sorted by cell are simply the cells in
order, so one pass over the features places each one (its slot's position from the slot table, its key
``feasign % sparse_dim``). It answers False, having written nothing the caller keeps, as soon as a cell
gets a second key, a feature's slot is negative or its row is outside the batch; key_batch then takes its
numpy passes, which handle every case. Why compiled (numba, ``nogil``): those passes are about a dozen over
the batch's ~20,000 features (slot positions, cells, presence, the empty cells, the order check, the key
transform, the cell starts), ~0.2 ms of a merged serving batch with the GIL held; this pass is one.

The signature is given, so the kernel is compiled (or loaded from numba's cache) when this module is
imported, never by a request.
"""

from __future__ import annotations

import numpy as np
from numba import types

from ctr_foundation.compiled import compiled
from ctr_foundation.sample import PADDING_FEASIGN

_INTS = types.Array(types.int64, 1, "C", readonly=True)
_SIGNATURE = types.boolean(
    _INTS,  # feature_row: the row of each feature
    types.Array(types.uint64, 1, "C", readonly=True),  # feasigns
    _INTS,  # feature_slots: the slot id of each feature
    _INTS,  # table: slot id -> position (-1: not a slot of the batch), its last entry -1 (scoring._slot_table)
    types.int64,  # n: rows
    types.uint64,  # sparse_dim: keys are feasign % sparse_dim (0: the feasign itself)
    types.Array(types.uint64, 1, "C"),  # keys_out [n * len(slots)]
    types.Array(types.int64, 1, "C"),  # cells_out [n * len(slots)]
)

_PADDING = np.uint64(PADDING_FEASIGN)


@compiled(_SIGNATURE)
def one_key_cells(feature_row, feasigns, feature_slots, table, n, sparse_dim, keys_out, cells_out):
    """Write each cell's key and number; False when a cell has two keys or a feature is out of range."""
    cells = keys_out.shape[0]
    if cells_out.shape[0] != cells or feasigns.shape[0] != feature_row.shape[0] or table.shape[0] == 0:
        raise ValueError("one_key_cells: keys_out and cells_out hold one entry a cell; one row a feature")
    if feature_slots.shape[0] != feature_row.shape[0]:
        raise ValueError("one_key_cells: one slot a feature")
    num_slots = cells // n if n else 0
    if num_slots * n != cells:
        raise ValueError("one_key_cells: keys_out must hold n rows of every slot")
    last = table.shape[0] - 1
    filled = np.zeros(cells, np.bool_)
    for j in range(feature_row.shape[0]):
        slot = feature_slots[j]
        if slot < 0:
            return False
        pos = table[min(slot, last)]
        if pos < 0:  # a slot the batch does not use: dropped
            continue
        row = feature_row[j]
        if row < 0 or row >= n:
            return False
        cell = row * num_slots + pos
        if filled[cell]:
            return False
        filled[cell] = True
        keys_out[cell] = feasigns[j] % sparse_dim if sparse_dim else feasigns[j]
    padding = _PADDING % sparse_dim if sparse_dim else _PADDING
    for cell in range(cells):
        cells_out[cell] = cell
        if not filled[cell]:
            keys_out[cell] = padding
    return True
