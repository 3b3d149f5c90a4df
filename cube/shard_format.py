"""The cube shard file (Arrow IPC) and the version manifest.

One version folder ``CUBE_ROOT/VERSION/`` holds ``shard-I.arrow`` for I in
0..N-1 (shard = key % N) and ``manifest.json``. A shard file is an Arrow IPC
*file* with ONE record batch, so a memory-mapped reader gets the key and value
buffers as contiguous arrays without copying:

    keys    uint64, sorted ascending, unique
    values  FixedSizeList<float32>[dim]
    schema metadata: version, shard, shards, dim (all strings)
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

import numpy as np

from ctr_foundation.errors import DataError

MANIFEST = "manifest.json"
FORMAT_NAME = "elastic-ctr-cube-shard"
FORMAT_VERSION = 1


class CorruptShardError(DataError):
    """A shard file is truncated, damaged, or does not match its manifest."""


def shard_file_name(shard: int) -> str:
    return f"shard-{shard}.arrow"


def shard_schema(*, version: str, shard: int, shards: int, dim: int) -> pa.Schema:
    meta = {
        "version": version,
        "shard": str(shard),
        "shards": str(shards),
        "dim": str(dim),
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
    }
    return pa.schema([("keys", pa.uint64()), ("values", pa.list_(pa.float32(), dim))], metadata=meta)


def write_shard(
    path: str | os.PathLike, keys: np.ndarray, values: np.ndarray, *, version: str, shard: int, shards: int
) -> None:
    """Write one shard file (keys must already be sorted and unique)."""
    keys = np.ascontiguousarray(keys, dtype=np.uint64)
    values = np.ascontiguousarray(values, dtype=np.float32)
    dim = values.shape[1]
    schema = shard_schema(version=version, shard=shard, shards=shards, dim=dim)
    flat = pa.array(values.reshape(-1), type=pa.float32())
    batch = pa.record_batch(
        [pa.array(keys, type=pa.uint64()), pa.FixedSizeListArray.from_arrays(flat, dim)], schema=schema
    )
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        writer.write_batch(batch)


@dataclass
class MappedShard:
    """A shard file memory-mapped read-only; ``keys``/``values`` point into the map."""

    path: Path
    version: str
    shard: int
    shards: int
    dim: int
    keys: np.ndarray  # uint64 [n], zero-copy view of the map
    values: np.ndarray  # float32 [n, dim], zero-copy view of the map
    _source: object = None  # keeps the memory map alive as long as the arrays

    @property
    def rows(self) -> int:
        return len(self.keys)


def open_shard(path: str | os.PathLike, *, verify_order: bool = True) -> MappedShard:
    """Memory-map a shard file and check its structure; raise CorruptShardError if it is damaged."""
    path = Path(path)
    try:
        source = pa.memory_map(str(path), "r")
        reader = pa.ipc.open_file(source)
        meta = {k.decode(): v.decode() for k, v in (reader.schema.metadata or {}).items()}
        if meta.get("format") != FORMAT_NAME:
            raise CorruptShardError(f"{path}: not a cube shard file (schema metadata format={meta.get('format')!r})")
        if reader.num_record_batches != 1:
            raise CorruptShardError(f"{path}: expected 1 record batch, found {reader.num_record_batches}")
        batch = reader.get_batch(0)
        batch.validate(full=False)
        dim = int(meta["dim"])
        key_col, val_col = batch.column(0), batch.column(1)
        if key_col.null_count or val_col.null_count:
            raise CorruptShardError(f"{path}: null keys or values")
        keys = key_col.to_numpy(zero_copy_only=True)
        flat = val_col.values
        values = flat.to_numpy(zero_copy_only=True)[val_col.offset * dim : (val_col.offset + len(val_col)) * dim]
        values = values.reshape(len(keys), dim)
    except CorruptShardError:
        raise
    except (pa.ArrowException, OSError, KeyError, ValueError) as e:
        raise CorruptShardError(f"{path}: cannot read shard file ({e})") from e
    shard = MappedShard(path, meta["version"], int(meta["shard"]), int(meta["shards"]), dim, keys, values, source)
    if verify_order and len(keys) > 1 and not bool(np.all(keys[1:] > keys[:-1])):
        raise CorruptShardError(f"{path}: keys are not sorted and unique")
    return shard


def fault_in(shard: MappedShard) -> None:
    """Touch every page of the mapped arrays so the first lookups do not page-fault."""
    page_keys, page_floats = 4096 // 8, 4096 // 4
    if shard.rows:
        int(shard.keys[::page_keys].sum())
        float(shard.values.reshape(-1)[::page_floats].sum())


def sha256_file(path: str | os.PathLike, bufsize: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(version_dir: str | os.PathLike) -> dict:
    path = Path(version_dir) / MANIFEST
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"{version_dir}: no {MANIFEST} (not a complete cube version)") from None
    except json.JSONDecodeError as e:
        raise CorruptShardError(f"{path}: invalid JSON: {e}") from e


def verify_version_dir(version_dir: str | os.PathLike, *, check_sha: bool = True) -> dict:
    """Check every shard of a version folder against its manifest; return the manifest."""
    version_dir = Path(version_dir)
    manifest = read_manifest(version_dir)
    for name, entry in manifest["files"].items():
        p = version_dir / name
        if not p.exists():
            raise CorruptShardError(f"{p}: missing (listed in {MANIFEST})")
        if p.stat().st_size != entry["size"]:
            raise CorruptShardError(f"{p}: size {p.stat().st_size} != manifest's {entry['size']}")
        if check_sha and sha256_file(p) != entry["sha256"]:
            raise CorruptShardError(f"{p}: sha256 does not match {MANIFEST}")
    return manifest


def complete_versions(cube_root: str | os.PathLike) -> list[str]:
    """Version folders under a cube root that hold a manifest, oldest first (names sort by time)."""
    root = Path(cube_root)
    if not root.is_dir():
        return []
    return sorted(
        p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / MANIFEST).exists()
    )
