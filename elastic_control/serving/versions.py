"""Where serving learns the active version, and how it gets that version's dense model.

Three sources, one interface (``current()`` -> a version record or None;
``materialise(record, workers)`` -> a LoadedVersion ready to score):

- ``FileServerSource``: polls ``cube/current.json`` on the file server (written
  by cube-transfer after every shard activated), downloads
  ``cube/VERSION/dense/`` and ``cube/VERSION/meta.json`` into a local cache.
- ``CubeRootSource``: the same files in a local cube root (tests, one machine).
- ``ModelDirSource``: the newest complete pass of a MODEL_PATH, its sparse
  table held in memory (no cube; for tests and quick local checks).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ctr_foundation.errors import ComponentError, DataError
from ctr_foundation.names import CUBE_PREFIX, REMOTE_CURRENT
from ctr_foundation.pass_format import DENSE_DIR, DENSE_PREFIX, META_FILE, latest_complete_pass
from ctr_foundation.records import CurrentVersion, read_current
from elastic_control.inference.scoring import DenseModel, InMemoryTable
from elastic_control.serving.lookup import CubeLookup, Lookup, TableLookup

log = logging.getLogger("elastic_control.serving")


@dataclass
class LoadedVersion:
    """Everything needed to score with one version; replaced whole on a switch, never mutated."""

    version: str
    slots: tuple[int, ...]
    sparse_dim: int | None
    dim: int
    dense: list[DenseModel]  # one predictor per batch worker (a predictor is not thread-safe)
    lookup: Lookup
    record: CurrentVersion | None = None
    loaded_at: float = field(default_factory=time.time)


def _load_dense(dense_dir: Path, version: str, slots: Sequence[int], dim: int, workers: int) -> list[DenseModel]:
    prefix = dense_dir / DENSE_PREFIX
    if not prefix.with_suffix(".pdmodel").exists():
        raise DataError(f"version {version}: no dense model at {prefix}.pdmodel")
    first = DenseModel(prefix)
    # Fail at load, not on the first request, if the model does not take slots*dim inputs.
    width = len(slots) * dim
    out = first.predict(np.zeros((1, width), np.float32))
    if out.shape != (1,) or not np.isfinite(out).all():
        raise DataError(f"version {version}: dense model gave {out!r} for one zero row of width {width}")
    return [first] + [first.clone() for _ in range(workers - 1)]


def _version_fields(record: CurrentVersion, meta: dict) -> tuple[tuple[int, ...], int | None, int]:
    """Slots, sparse_dim and dim: meta.json (the pass) wins; current.json fills gaps."""
    try:
        slots = tuple(int(s) for s in (meta.get("slots") or record.slots))
        dim = int(meta.get("embedding_dim") or record.dim)
    except (TypeError, ValueError) as e:
        raise DataError(f"version {record.version}: slots/dim unreadable in meta.json and current.json") from e
    if not slots or dim <= 0:
        raise DataError(f"version {record.version}: slots/dim missing from meta.json and current.json")
    sparse_dim = meta.get("sparse_dim", record.sparse_dim)
    return slots, (int(sparse_dim) if sparse_dim else None), dim


class CubeRootSource:
    """``CUBE_ROOT/current.json``, ``CUBE_ROOT/VERSION/dense/``, ``CUBE_ROOT/VERSION/meta.json``."""

    def __init__(self, cube_root: str | Path, cube_urls: Sequence[str], lookup_timeout: float = 5.0):
        self.root = Path(cube_root)
        self.cube_urls = list(cube_urls)
        self.lookup_timeout = lookup_timeout
        self.describe = f"cube root {self.root}"

    def current(self) -> CurrentVersion | None:
        return read_current(self.root)

    def _version_dir(self, record: CurrentVersion) -> Path:
        return self.root / record.version

    def materialise(self, record: CurrentVersion, workers: int) -> LoadedVersion:
        vdir = self._version_dir(record)
        meta_path = vdir / META_FILE
        meta = json.loads(meta_path.read_text(encoding="utf-8")) if meta_path.exists() else {}
        slots, sparse_dim, dim = _version_fields(record, meta)
        dense = _load_dense(vdir / DENSE_DIR, record.version, slots, dim, workers)
        if not self.cube_urls:
            raise ComponentError("no cube-server URLs: pass --cube-servers or set ELASTIC_CTR_CUBE_SERVERS")
        if record.shards != len(self.cube_urls):
            raise ComponentError(
                f"version {record.version} has {record.shards} shards but serving knows "
                f"{len(self.cube_urls)} cube servers ({', '.join(self.cube_urls)})"
            )
        return LoadedVersion(
            record.version, slots, sparse_dim, dim, dense, CubeLookup(self.cube_urls, self.lookup_timeout), record
        )


class FileServerSource(CubeRootSource):
    """The file server's ``cube/`` tree; dense models are downloaded into ``cache_dir``."""

    def __init__(
        self, fileserver_url: str, cache_dir: str | Path, cube_urls: Sequence[str], lookup_timeout: float = 5.0
    ):
        from ctr_foundation.fileserver_client import FileServerClient

        super().__init__(cache_dir, cube_urls, lookup_timeout)
        self.fs = FileServerClient(fileserver_url, timeout=30.0)
        self.describe = f"file server {fileserver_url}"

    def current(self) -> CurrentVersion | None:
        from ctr_foundation.fileserver_client import NotFound

        try:
            return CurrentVersion.from_json(self.fs.get_json(REMOTE_CURRENT), f"{self.describe}: {REMOTE_CURRENT}")
        except NotFound:
            return None

    def _version_dir(self, record: CurrentVersion) -> Path:
        version = record.version
        local = self.root / version
        if not (local / DENSE_DIR / f"{DENSE_PREFIX}.pdmodel").exists():
            staging = self.root / f".{version}.download"
            shutil.rmtree(staging, ignore_errors=True)
            dense_remote = record.dense or f"{CUBE_PREFIX}/{version}/{DENSE_DIR}/"
            self.fs.get_tree(dense_remote, staging / DENSE_DIR)
            self.fs.get_file(f"{CUBE_PREFIX}/{version}/{META_FILE}", staging / META_FILE)
            shutil.rmtree(local, ignore_errors=True)
            staging.rename(local)
        return local

    def prune(self, keep: set[str]) -> None:
        """Delete downloaded versions other than ``keep`` (only this cache: never a cube root)."""
        for entry in self.root.iterdir():
            if entry.is_dir() and not entry.name.startswith(".") and entry.name not in keep:
                shutil.rmtree(entry, ignore_errors=True)


class ModelDirSource:
    """The newest complete pass of MODEL_PATH, scored from its in-memory sparse table."""

    def __init__(self, model_path: str | Path):
        self.model_path = Path(model_path)
        self.describe = f"model dir {self.model_path}"

    def current(self) -> CurrentVersion | None:
        info = latest_complete_pass(self.model_path)
        if info is None:
            return None
        # No cube here: the "dense" folder is the pass's own, and there are no shards.
        return CurrentVersion(
            info.name, info.name, 0, info.embedding_dim, tuple(info.slots), info.sparse_dim, str(info.path)
        )

    def materialise(self, record: CurrentVersion, workers: int) -> LoadedVersion:
        from ctr_foundation.pass_format import load_pass

        info = load_pass(record.dense)
        slots, sparse_dim, dim = _version_fields(record, info.meta)
        dense = _load_dense(info.path / DENSE_DIR, info.name, slots, dim, workers)
        return LoadedVersion(
            info.name, slots, sparse_dim, dim, dense, TableLookup(InMemoryTable.from_pass(info), info.name), record
        )
