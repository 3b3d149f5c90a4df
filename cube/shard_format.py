"""The cube shard files (Arrow IPC) and the version manifest.

One version folder ``CUBE_ROOT/VERSION/`` holds, for I in 0..N-1 (shard = key % N),
``shard-I.arrow`` and ``manifest.json``; a *delta* version (built from a delta pass on
top of its parent version) also holds ``deleted-I.arrow``. A shard file is an Arrow
IPC *file* with ONE record batch:

    keys    uint64, sorted ascending, unique
    values  FixedSizeList<float32>[dim]
    schema metadata: version, shard, shards, dim, format, format_version
                     (+ kind=delta, parent=P in the changed rows of a delta version)

``deleted-I.arrow``: one record batch, ``keys`` uint64 sorted unique, the keys of
shard I that the delta removes (metadata format=elastic-ctr-cube-deleted).

Reading: a file is read into the process's own memory while its sha256 is computed,
and only then parsed. Files are never memory-mapped: a mapped file that someone
truncates kills the process with SIGBUS on the next touch of a vanished page, and a
file overwritten in place changes what a mapping serves. A private copy checked
against the manifest can do neither (see cube/README.md, "Integrity").
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

import numpy as np

from ctr_foundation.errors import DataError

MANIFEST = "manifest.json"
FORMAT_NAME = "elastic-ctr-cube-shard"
DELETED_FORMAT_NAME = "elastic-ctr-cube-deleted"
FORMAT_VERSION = 1
KINDS = ("base", "delta")
READ_CHUNK = 16 << 20
HUGE_MIN = 4 << 20  # arrays from this size on get their own anonymous mapping (private_array)


class CorruptShardError(DataError):
    """A shard file is truncated, damaged, or does not match its manifest."""


def shard_file_name(shard: int) -> str:
    return f"shard-{shard}.arrow"


def deleted_file_name(shard: int) -> str:
    return f"deleted-{shard}.arrow"


def valid_version_name(version) -> bool:
    return (
        isinstance(version, str)
        and 0 < len(version) <= 200
        and not version.startswith(".")
        and all(c.isascii() and (c.isalnum() or c in "-_.") for c in version)
    )


def shard_schema(
    *, version: str, shard: int, shards: int, dim: int, kind: str = "base", parent: str | None = None
) -> pa.Schema:
    meta = {
        "version": version,
        "shard": str(shard),
        "shards": str(shards),
        "dim": str(dim),
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
    }
    if kind == "delta":  # base files keep the original metadata (and bytes)
        meta.update(kind="delta", parent=parent or "")
    return pa.schema([("keys", pa.uint64()), ("values", pa.list_(pa.float32(), dim))], metadata=meta)


def write_shard(
    path: str | os.PathLike,
    keys: np.ndarray,
    values: np.ndarray,
    *,
    version: str,
    shard: int,
    shards: int,
    kind: str = "base",
    parent: str | None = None,
) -> None:
    """Write one shard file (keys must already be sorted and unique)."""
    keys = np.ascontiguousarray(keys, dtype=np.uint64)
    values = np.ascontiguousarray(values, dtype=np.float32)
    dim = values.shape[1]
    schema = shard_schema(version=version, shard=shard, shards=shards, dim=dim, kind=kind, parent=parent)
    flat = pa.array(values.reshape(-1), type=pa.float32())
    batch = pa.record_batch(
        [pa.array(keys, type=pa.uint64()), pa.FixedSizeListArray.from_arrays(flat, dim)], schema=schema
    )
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        writer.write_batch(batch)


def write_deleted(path: str | os.PathLike, keys: np.ndarray, *, version: str, shard: int, shards: int) -> None:
    """Write the deleted keys of one shard of a delta version (sorted, unique)."""
    meta = {
        "version": version,
        "shard": str(shard),
        "shards": str(shards),
        "format": DELETED_FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
    }
    schema = pa.schema([("keys", pa.uint64())], metadata=meta)
    batch = pa.record_batch([pa.array(np.ascontiguousarray(keys, dtype=np.uint64), type=pa.uint64())], schema=schema)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        writer.write_batch(batch)


@dataclass
class ShardData:
    """One shard's keys and values in this process's own memory (never a file mapping)."""

    version: str
    shard: int
    shards: int
    dim: int
    keys: np.ndarray  # uint64 [n], sorted, unique
    values: np.ndarray  # float32 [n, dim]
    kind: str = "base"
    parent: str | None = None
    path: Path | None = None
    _source: object = field(default=None, repr=False)  # the buffer the arrays point into

    @property
    def rows(self) -> int:
        return len(self.keys)


def file_stamp(path: str | os.PathLike) -> str:
    """Identity of a file's current content on disk (a replaced or rewritten file gets a new stamp)."""
    st = os.stat(path)
    return f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def private_array(shape, dtype) -> np.ndarray:
    """An uninitialised array in anonymous memory of this process, on huge pages where the kernel allows.

    Anonymous, so no file can be truncated under it (no SIGBUS); huge pages, because a fresh
    shard of hundreds of MB otherwise costs ~10^5 page faults to fill, and random lookups over it
    miss the TLB less.
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < HUGE_MIN:
        return np.empty(shape, dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return np.frombuffer(region, dtype=dtype).reshape(shape)


def read_verified(path: str | os.PathLike, *, size: int | None = None, sha256: str | None = None) -> np.ndarray:
    """The whole file as a private uint8 array, refused unless its size and sha256 match (when given).

    The digest is computed over the very bytes that are returned, in one pass.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            actual = os.fstat(f.fileno()).st_size
            if size is not None and actual != size:
                raise CorruptShardError(f"{path}: size {actual} bytes, the manifest says {size} (truncated?)")
            buf = private_array(actual, np.uint8)
            view = memoryview(buf)
            h = hashlib.sha256() if sha256 is not None else None
            got = 0
            while got < actual:
                n = f.readinto(view[got : got + READ_CHUNK])
                if not n:
                    raise CorruptShardError(f"{path}: shrank while being read ({got} of {actual} bytes)")
                if h is not None:
                    h.update(view[got : got + n])
                got += n
            if f.read(1):
                raise CorruptShardError(f"{path}: grew while being read")
    except FileNotFoundError:
        raise DataError(f"shard file {path} does not exist") from None
    except IsADirectoryError:
        raise CorruptShardError(f"{path} is a folder, not a shard file") from None
    except OSError as e:
        raise CorruptShardError(f"{path}: cannot read ({e.strerror or e})") from e
    if h is not None and h.hexdigest() != sha256:
        raise CorruptShardError(f"{path}: sha256 does not match the manifest (corrupt or changed in place)")
    return buf


def _open_ipc(path: Path, source, format_name: str):
    try:
        reader = pa.ipc.open_file(source if isinstance(source, pa.NativeFile) else pa.py_buffer(source))
        meta = {k.decode(): v.decode() for k, v in (reader.schema.metadata or {}).items()}
        if meta.get("format") != format_name:
            raise CorruptShardError(f"{path}: not a {format_name} file (schema metadata format={meta.get('format')!r})")
        if reader.num_record_batches != 1:
            raise CorruptShardError(f"{path}: expected 1 record batch, found {reader.num_record_batches}")
        batch = reader.get_batch(0)
        batch.validate(full=False)
        return meta, batch
    except CorruptShardError:
        raise
    except (pa.ArrowException, OSError, ValueError, UnicodeDecodeError) as e:
        raise CorruptShardError(f"{path}: cannot read the Arrow file ({e})") from e


def _check_sorted(path: Path, keys: np.ndarray) -> None:
    if len(keys) > 1 and not bool(np.all(keys[1:] > keys[:-1])):
        raise CorruptShardError(f"{path}: keys are not sorted and unique")


def read_shard(
    path: str | os.PathLike, *, size: int | None = None, sha256: str | None = None, verify_order: bool = True
) -> ShardData:
    """Read a shard file into private memory and check it; raise CorruptShardError if it is damaged."""
    path = Path(path)
    buf = read_verified(path, size=size, sha256=sha256)
    meta, batch = _open_ipc(path, buf, FORMAT_NAME)
    try:
        dim = int(meta["dim"])
        key_col, val_col = batch.column(0), batch.column(1)
        if batch.num_columns != 2 or key_col.type != pa.uint64() or val_col.type != pa.list_(pa.float32(), dim):
            raise CorruptShardError(f"{path}: unexpected columns {batch.schema}")
        if key_col.null_count or val_col.null_count:
            raise CorruptShardError(f"{path}: null keys or values")
        keys = key_col.to_numpy(zero_copy_only=True)
        flat = val_col.values
        values = flat.to_numpy(zero_copy_only=True)[val_col.offset * dim : (val_col.offset + len(val_col)) * dim]
        values = values.reshape(len(keys), dim)
        shard = ShardData(
            version=meta["version"],
            shard=int(meta["shard"]),
            shards=int(meta["shards"]),
            dim=dim,
            keys=keys,
            values=values,
            kind=meta.get("kind", "base"),
            parent=meta.get("parent") or None,
            path=path,
            _source=buf,
        )
    except CorruptShardError:
        raise
    except (pa.ArrowException, KeyError, ValueError) as e:
        raise CorruptShardError(f"{path}: cannot read shard file ({e})") from e
    if verify_order:
        _check_sorted(path, keys)
    return shard


def read_deleted(
    path: str | os.PathLike, *, size: int | None = None, sha256: str | None = None
) -> tuple[dict, np.ndarray]:
    """(metadata, sorted unique uint64 keys) of a deleted-I.arrow file, checked like a shard file."""
    path = Path(path)
    buf = read_verified(path, size=size, sha256=sha256)
    meta, batch = _open_ipc(path, buf, DELETED_FORMAT_NAME)
    col = batch.column(0)
    if batch.num_columns != 1 or col.type != pa.uint64() or col.null_count:
        raise CorruptShardError(f"{path}: expected one non-null uint64 column 'keys'")
    keys = col.to_numpy(zero_copy_only=True)
    _check_sorted(path, keys)
    return meta, keys


def check_file(path: str | os.PathLike) -> dict:
    """Structure of a shard or deleted-keys file (format, one batch, column types, sorted keys), read
    through a short-lived memory map; returns its schema metadata plus ``rows``.

    For cube-agent's checks of its own staging files before they are installed: no copy of a
    large file is made (cube-server never maps files; see the module docstring).
    """
    path = Path(path)
    try:
        source = pa.memory_map(str(path), "r")
    except (OSError, pa.ArrowException) as e:
        raise CorruptShardError(f"{path}: cannot open ({e})") from e
    try:
        format_name = FORMAT_NAME if path.name.startswith("shard-") else DELETED_FORMAT_NAME
        meta, batch = _open_ipc(path, source, format_name)
        keys = batch.column(0)
        if keys.type != pa.uint64() or keys.null_count:
            raise CorruptShardError(f"{path}: the keys column is not non-null uint64")
        if format_name == FORMAT_NAME:
            try:
                dim = int(meta["dim"])
            except (KeyError, ValueError) as e:
                raise CorruptShardError(f"{path}: no valid 'dim' in the schema metadata") from e
            if batch.num_columns != 2 or batch.column(1).type != pa.list_(pa.float32(), dim):
                raise CorruptShardError(f"{path}: unexpected columns {batch.schema}")
            if batch.column(1).null_count:
                raise CorruptShardError(f"{path}: null values")
        elif batch.num_columns != 1:
            raise CorruptShardError(f"{path}: expected one column 'keys'")
        _check_sorted(path, keys.to_numpy(zero_copy_only=True))
        rows = batch.num_rows
        del keys, batch
        return {**meta, "rows": rows}
    finally:
        source.close()


def sha256_file(path: str | os.PathLike, bufsize: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def verify_file(path: str | os.PathLike, *, size: int, sha256: str) -> None:
    """Stream a file through sha256 (no copy kept); CorruptShardError unless size and digest match."""
    path = Path(path)
    try:
        actual = path.stat().st_size
    except FileNotFoundError:
        raise CorruptShardError(f"{path}: missing") from None
    if actual != size:
        raise CorruptShardError(f"{path}: size {actual} != manifest's {size}")
    try:
        digest = sha256_file(path)
    except OSError as e:
        raise CorruptShardError(f"{path}: cannot read ({e.strerror or e})") from e
    if digest != sha256:
        raise CorruptShardError(f"{path}: sha256 does not match {MANIFEST}")


def read_manifest(version_dir: str | os.PathLike) -> dict:
    path = Path(version_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"{version_dir}: no {MANIFEST} (not a complete cube version)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptShardError(f"{path}: invalid JSON: {e}") from e
    except OSError as e:
        raise CorruptShardError(f"{path}: cannot read ({e.strerror or e})") from e
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CorruptShardError(f"{path}: not a cube manifest (no 'files' object)")
    kind = manifest.get("kind", "base")
    if kind not in KINDS:
        raise CorruptShardError(f"{path}: unknown kind {kind!r} (expected one of {KINDS})")
    if kind == "delta" and not valid_version_name(manifest.get("parent")):
        raise CorruptShardError(f"{path}: a delta version needs a valid 'parent' (got {manifest.get('parent')!r})")
    return manifest


def manifest_kind(manifest: dict) -> str:
    return manifest.get("kind", "base")


def file_entry(manifest: dict, name: str, where: str | os.PathLike) -> dict:
    """The manifest's {size, sha256, ...} of one file; CorruptShardError if missing or malformed."""
    entry = manifest["files"].get(name)
    if (
        not isinstance(entry, dict)
        or not isinstance(entry.get("size"), int)
        or not isinstance(entry.get("sha256"), str)
    ):
        raise CorruptShardError(f"{where}: {MANIFEST} has no size and sha256 for {name}")
    return entry


def verify_version_dir(version_dir: str | os.PathLike, *, check_sha: bool = True) -> dict:
    """Check every file of a version folder against its manifest; return the manifest."""
    version_dir = Path(version_dir)
    manifest = read_manifest(version_dir)
    for name in manifest["files"]:
        entry = file_entry(manifest, name, version_dir)
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
