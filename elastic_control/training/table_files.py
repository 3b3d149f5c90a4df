"""Whole-line work on the sparse table files the pservers write (Paddle 2.6.2 ``SparseAccessor`` text save).

A saved table is a folder ``000/`` of ``part-PPP-SSSSS[.gz]`` files, one per table shard: PPP is the
pserver that wrote it, SSSSS the global shard, which is ``key % shards`` (checked on 2.6.2 with keys above
2**63). A key therefore always lands in the file of the same shard, in every save: that is what lets the
delta export split files and the resume merge a chain shard by shard. Lines are kept byte for byte (Paddle
prints 6 significant digits; re-printing would lose more), except the ``delta_score`` column that the resume
resets (``zero_delta_score``).

Line layout: ``key slot unseen_days delta_score show click embed_w ...`` (``pass_format.SparseLayout``).
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

import numpy as np

from ctr_foundation.errors import DataError
from ctr_foundation.pass_format import SPARSE_TABLE_SUBDIR
from ctr_foundation.sparse_table_reader import BLOCK_SIZE, _keys_to_uint64

PART_NAME = re.compile(r"^part-(\d+)-(\d+)(\.gz)?$")
SHOW_COLUMN = 4  # key slot unseen_days delta_score show ...


def part_shard(path: str | os.PathLike) -> int:
    """The global table shard of a part file, from its name (``part-PPP-SSSSS[.gz]``)."""
    m = PART_NAME.match(Path(path).name)
    if not m:
        raise DataError(f"{path}: not a sparse table part file (expected part-PPP-SSSSS[.gz])")
    return int(m.group(2))


def table_parts(folder: str | os.PathLike) -> dict[int, Path]:
    """``{shard: part file}`` of a saved table folder (the one holding ``000/``); none if it is missing."""
    table = Path(folder) / SPARSE_TABLE_SUBDIR
    if not table.is_dir():
        return {}
    out: dict[int, Path] = {}
    for p in sorted(table.iterdir()):
        if not p.name.startswith("part-"):
            continue
        shard = part_shard(p)
        if shard in out:
            raise DataError(f"{table}: two part files for shard {shard}: {out[shard].name} and {p.name}")
        out[shard] = p
    return out


@dataclass
class PartLines:
    """The lines of one part file (without their newlines) and the key of each."""

    lines: pa.Array  # string
    keys: np.ndarray  # uint64, in line order

    def __len__(self) -> int:
        return len(self.keys)

    def column(self, index: int, dtype=pa.float32()) -> np.ndarray:
        """Column ``index`` of every line (0 = key), converted to ``dtype``."""
        parts = pc.split_pattern(self.lines, " ", max_splits=index + 1)
        return pc.cast(pc.list_element(parts, index), dtype).to_numpy(zero_copy_only=False)

    def shows(self) -> np.ndarray:
        """The ``show`` column: how many times each key was pushed (one per occurrence in a batch)."""
        return self.column(SHOW_COLUMN) if len(self) else np.zeros(0, np.float32)

    def take(self, index: np.ndarray) -> PartLines:
        index = np.asarray(index, dtype=np.int64)
        return PartLines(self.lines.take(pa.array(index)), self.keys[index])

    @classmethod
    def empty(cls) -> PartLines:
        return cls(pa.array([], pa.string()), np.zeros(0, np.uint64))

    @classmethod
    def concat(cls, parts: list[PartLines]) -> PartLines:
        parts = [p for p in parts if len(p)]
        if not parts:
            return cls.empty()
        return cls(pa.concat_arrays([p.lines for p in parts]), np.concatenate([p.keys for p in parts]))


def read_part_lines(path: str | os.PathLike) -> PartLines:
    """Every line of a (plain or .gz) part file, with its key."""
    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return PartLines.empty()
    compression = "gzip" if path.name.endswith(".gz") else None
    try:
        table = pacsv.read_csv(
            pa.input_stream(str(path), compression=compression),
            read_options=pacsv.ReadOptions(column_names=["line"], block_size=BLOCK_SIZE),
            # Lines have no tabs or quotes: each whole line is one value.
            parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False, escape_char=False),
            convert_options=pacsv.ConvertOptions(column_types={"line": pa.string()}),
        )
    except pa.ArrowInvalid as e:
        if "Empty CSV file" in str(e):
            return PartLines.empty()
        raise DataError(f"{path}: cannot read the sparse table lines: {e}") from e
    lines = table.column("line").combine_chunks()
    if len(lines) == 0:
        return PartLines.empty()
    keys = _keys_to_uint64(pa.chunked_array([pc.list_element(pc.split_pattern(lines, " ", max_splits=1), 0)]))
    return PartLines(lines, keys)


def read_part_keys(path: str | os.PathLike) -> np.ndarray:
    """Just the keys of a part file (uint64, line order)."""
    return read_part_lines(path).keys


def write_lines(path: str | os.PathLike, lines: pa.Array) -> None:
    """Write lines, one per line (gzip when the name ends in .gz); an empty file when there are none."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.name.endswith(".gz"):
        sink = pa.CompressedOutputStream(str(path), "gzip")
    else:
        sink = pa.OSFile(str(path), "wb")
    with sink:
        if len(lines):
            pacsv.write_csv(
                pa.table({"line": lines}),
                sink,
                pacsv.WriteOptions(include_header=False, quoting_style="none"),
            )


def zero_delta_score(lines: pa.Array) -> pa.Array:
    """The lines with their ``delta_score`` (4th column) set to 0.

    A pserver that loads a line keeps its delta_score, and the next delta save (mode 1) writes every key
    whose delta_score is positive: a table assembled for a resume must look as if it had just been saved.
    """
    if len(lines) == 0:
        return lines
    return pc.replace_substring_regex(lines, pattern=r"^(\S+ \S+ \S+) \S+", replacement=r"\1 0")


def last_rows(keys: np.ndarray) -> np.ndarray:
    """Indices of the last occurrence of each distinct key, in ascending index order."""
    if len(keys) == 0:
        return np.zeros(0, np.int64)
    rev = keys[::-1]
    _, first_in_rev = np.unique(rev, return_index=True)
    return np.sort(len(keys) - 1 - first_in_rev)


def overlay(older: PartLines, newer: PartLines, deleted: np.ndarray) -> PartLines:
    """``older`` with ``deleted`` keys removed, then ``newer``'s lines laid over it (newer wins)."""
    if len(deleted) and len(older):
        older = older.take(np.flatnonzero(~np.isin(older.keys, deleted)))
    both = PartLines.concat([older, newer])
    return both.take(last_rows(both.keys))


def key_files(keys: np.ndarray, folder: str | os.PathLike, name: str = "part-00000") -> Path | None:
    """Write uint64 keys, one decimal per line, to ``folder/name`` (the ``deleted/part-*`` format)."""
    keys = np.asarray(keys, dtype=np.uint64)
    if len(keys) == 0:
        return None
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("".join(f"{k}\n" for k in np.sort(keys).tolist()), encoding="ascii")
    return path


def move_table(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Move a saved table folder (``src/000``) to ``dst/000``."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    shutil.move(str(Path(src) / SPARSE_TABLE_SUBDIR), str(dst / SPARSE_TABLE_SUBDIR))
