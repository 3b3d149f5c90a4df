"""The whole sparse table of a pass: a base's own table, or a delta's chain assembled down to its base.

A delta pass holds only the keys that changed since its parent (and the keys deleted since); its table
is its parent's with those rows laid over and the deleted keys removed (docs/contracts.md, "Delta
passes"). Offline evaluation, the promotion gate, shadow scoring and serving from a model folder all
read a pass's table through here (``scoring.InMemoryTable.from_pass``), so they see what cube serves for
the same pass. The overlay is cube's own (``cube.delta_merge``): one definition of "a delta on its parent".
"""

from __future__ import annotations

import os

import numpy as np

from ctr_foundation.errors import DataError
from ctr_foundation.pass_format import PassInfo, load_pass, pass_chain
from ctr_foundation.sparse_table_reader import iter_deleted_keys, iter_sparse_table_fast
from cube.delta_merge import Delta, apply


def _own_rows(info: PassInfo) -> tuple[np.ndarray, np.ndarray]:
    """A pass's own rows, keys sorted and unique (the last of duplicates, in part-file order, wins)."""
    chunks = list(iter_sparse_table_fast(info.path, info.layout))
    if not chunks:
        return np.zeros(0, np.uint64), np.zeros((0, info.embedding_dim), np.float32)
    keys = np.concatenate([c[0] for c in chunks])
    values = np.concatenate([c[1] for c in chunks])
    rev = keys[::-1]
    uniq, first_in_rev = np.unique(rev, return_index=True)  # sorted keys, index of their last occurrence
    last = len(keys) - 1 - first_in_rev
    return uniq, values[last]


def read_whole_table(pass_dir: str | os.PathLike | PassInfo) -> tuple[np.ndarray, np.ndarray]:
    """(keys uint64 sorted, values float32 [n, dim]) of the pass's whole table."""
    info = pass_dir if isinstance(pass_dir, PassInfo) else load_pass(pass_dir)
    if info.kind == "base":
        return _own_rows(info)
    chain = pass_chain(info.path)
    keys, values = _own_rows(chain[0])
    for link in chain[1:]:
        if link.embedding_dim != chain[0].embedding_dim:
            raise DataError(
                f"{link.path}: embedding_dim {link.embedding_dim} differs from its base {chain[0].name}'s "
                f"({chain[0].embedding_dim}): not a delta of it"
            )
        changed, rows = _own_rows(link)
        deleted = np.unique(np.concatenate([*iter_deleted_keys(link.path), np.zeros(0, np.uint64)]))
        keys, values = apply(keys, values, Delta.of(changed, rows, deleted))
    return keys, values
