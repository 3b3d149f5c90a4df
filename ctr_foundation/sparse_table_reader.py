"""A fast streaming reader of the saved Paddle sparse table.

``ctr_foundation.pass_format.iter_sparse_table`` parses lines in Python
(clear, but ~1 us per column); this reader hands each part file to Arrow's
multi-threaded CSV parser with the SAME column logic (``SparseLayout``), and
converts only the key and embedding columns. Both must agree
(tests/test_cube_builder.py checks that).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

import numpy as np

from ctr_foundation.errors import DataError
from ctr_foundation.pass_format import SparseLayout, deleted_key_files, sparse_part_files

BLOCK_SIZE = 16 << 20


def _keys_to_uint64(col: pa.ChunkedArray) -> np.ndarray:
    """Decimal key text -> uint64; negative text (an int64 view) keeps its bits."""
    try:
        return pc.cast(col, pa.uint64()).to_numpy()
    except pa.ArrowInvalid:
        negative = pc.starts_with(col, "-").to_numpy(zero_copy_only=False)
        out = np.empty(len(col), dtype=np.uint64)
        text = col.to_numpy(zero_copy_only=False)
        if (~negative).any():
            out[~negative] = pc.cast(pa.array(text[~negative]), pa.uint64()).to_numpy()
        out[negative] = pc.cast(pa.array(text[negative]), pa.int64()).to_numpy().view(np.uint64)
        return out


def iter_part_file(part: Path, layout: SparseLayout) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(keys uint64[n], embeddings float32[n, d]) blocks of one part file."""
    ncols = 1 + layout.value_columns
    names = [f"c{i}" for i in range(ncols)]
    emb_cols = [names[i] for i in layout.embedding_column_indices()]
    types = {n: pa.float32() for n in emb_cols}
    types["c0"] = pa.string()
    compression = "gzip" if part.name.endswith(".gz") else None
    if part.stat().st_size == 0:
        return
    try:
        stream = pa.input_stream(str(part), compression=compression)
        try:
            reader = pacsv.open_csv(
                stream,
                read_options=pacsv.ReadOptions(column_names=names, block_size=BLOCK_SIZE),
                parse_options=pacsv.ParseOptions(delimiter=" ", quote_char=False),
                convert_options=pacsv.ConvertOptions(include_columns=["c0", *emb_cols], column_types=types),
            )
        except pa.ArrowInvalid as e:
            if "Empty CSV file" in str(e):  # pservers write a (gzipped) empty part per idle shard
                return
            raise
        for batch in reader:
            if batch.num_rows == 0:
                continue
            keys = _keys_to_uint64(pa.chunked_array([batch.column(0)]))
            values = np.empty((batch.num_rows, layout.embedding_dim), dtype=np.float32)
            for j in range(layout.embedding_dim):
                col = batch.column(1 + j)
                if col.null_count:
                    raise DataError(f"{part}: empty embedding values in column {emb_cols[j]}")
                values[:, j] = col.to_numpy()
            yield keys, values
    except pa.ArrowInvalid as e:
        raise DataError(
            f"{part}: {e} (expected {ncols} columns for {layout.to_json()}; is meta.json's sparse_layout right?)"
        ) from e


def iter_sparse_table_fast(
    pass_dir: str | os.PathLike, layout: SparseLayout
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Stream (keys, embeddings) blocks from every part file of a pass's sparse table."""
    for part in sparse_part_files(pass_dir):
        yield from iter_part_file(part, layout)


def iter_deleted_keys(pass_dir: str | os.PathLike) -> Iterator[np.ndarray]:
    """uint64 blocks of the keys a delta pass deletes (``deleted/part-*``: one decimal key per line,
    uint64 or its int64 text, plain or .gz; blank lines skipped)."""
    for part in deleted_key_files(pass_dir):
        if part.stat().st_size == 0:
            continue
        compression = "gzip" if part.name.endswith(".gz") else None
        try:
            reader = pacsv.open_csv(
                pa.input_stream(str(part), compression=compression),
                read_options=pacsv.ReadOptions(column_names=["key"], block_size=BLOCK_SIZE),
                parse_options=pacsv.ParseOptions(delimiter=" ", quote_char=False),
                convert_options=pacsv.ConvertOptions(column_types={"key": pa.string()}),
            )
            for batch in reader:
                if batch.num_rows:
                    yield _keys_to_uint64(pa.chunked_array([batch.column(0)]))
        except pa.ArrowInvalid as e:
            if "Empty CSV file" in str(e):
                continue
            raise DataError(f"{part}: not one decimal key per line ({e})") from e
