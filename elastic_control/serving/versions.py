"""Where serving learns the active version, and how it gets a version's dense model and lookups.

Three sources, one interface (``current()`` -> the active version record or None;
``record_for(version)`` -> the record of any version the source holds, for pinned A/B challengers;
``materialise(record)`` -> a LoadedVersion ready to score; ``pins`` -> where pins are written):

- ``FileServerSource``: polls ``cube/current.json`` on the file server (written by cube-transfer after
  every shard activated), downloads ``cube/VERSION/dense/`` and ``cube/VERSION/meta.json`` into a
  local cache; a challenger's record comes from ``cube/VERSION/manifest.json``.
- ``CubeRootSource``: the same files in a local cube root (tests, one machine).
- ``ModelDirSource``: the newest complete pass of a MODEL_PATH, its sparse table held in memory (no
  cube; for tests and quick local checks); a challenger is any complete pass there.

A LoadedVersion holds no predictor: paddle predictors are created by each batch worker in its own
thread (batcher.py).
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

from ctr_foundation.dense_features import DenseNorm
from ctr_foundation.errors import ComponentError, DataError
from ctr_foundation.fileserver_client import FileServerClient, NotFound
from ctr_foundation.names import CUBE_PREFIX, REMOTE_CURRENT
from ctr_foundation.pass_format import (
    DENSE_DIR,
    DENSE_PREFIX,
    META_FILE,
    PassInfo,
    complete_passes,
    latest_complete_pass,
    load_pass,
)
from ctr_foundation.records import CurrentVersion, read_current
from elastic_control.inference.scoring import InMemoryTable
from elastic_control.serving.lookup import CubeLookup, CubeUnavailable, Lookup, TableLookup
from elastic_control.serving.pins import PinStore

log = logging.getLogger("elastic_control.serving")
MANIFEST_FILE = "manifest.json"


@dataclass
class LoadedVersion:
    """Everything needed to score with one version; replaced whole on a switch, never mutated but for
    ``retired``, set once when nothing routes to it any more."""

    version: str
    slots: tuple[int, ...]
    sparse_dim: int | None
    width: int  # floats per cube row (the embedding dim, or more for model families that need more per key)
    dense_prefix: Path  # dense/inference(.pdmodel, .pdiparams)
    lookup: Lookup
    record: CurrentVersion | None = None
    loaded_at: float = field(default_factory=time.time)
    load_id: int = 0  # unique per load: batch workers key their predictors by it
    owns_lookup: bool = True  # False: the source's lookup, shared by every version (release leaves it open)
    # dense slots (slot.conf "SLOT dense") and their standardisation, from the version's meta.json: their
    # standardised values follow the pooled rows in the dense model's input (scoring.model_input)
    dense_slots: tuple[int, ...] = ()
    dense_norm: DenseNorm | None = None
    # Set when serving retires the version. Parts pinned to it before the switch may still be scored with it
    # (their lookups were in flight): they go without its hot-key cache and take a predictor that is not
    # kept, since a cache or predictor created after the retirement would never be dropped (it was: about
    # 1.5 MB a reload under load).
    retired: bool = False

    @property
    def input_width(self) -> int:
        """Columns of the dense model's input: the pooled rows, then one per dense slot."""
        return len(self.slots) * self.width + len(self.dense_slots)

    def release(self) -> None:
        """Called once nothing routes to this version any more."""
        if self.owns_lookup:
            self.lookup.close()

    def probe(self) -> str | None:
        """None if every cube shard answers a lookup of this version, else why not."""
        try:
            self.lookup.probe(self.version)
        except CubeUnavailable as e:
            return str(e)
        return None


def _version_fields(record: CurrentVersion, meta: dict) -> tuple[tuple[int, ...], int | None]:
    """Slots and sparse_dim: meta.json (the pass) wins; current.json fills gaps."""
    try:
        slots = tuple(int(s) for s in (meta.get("slots") or record.slots))
    except (TypeError, ValueError) as e:
        raise DataError(f"version {record.version}: slots unreadable in meta.json and current.json") from e
    if not slots:
        raise DataError(f"version {record.version}: slots missing from meta.json and current.json")
    sparse_dim = meta.get("sparse_dim", record.sparse_dim)
    return slots, (int(sparse_dim) if sparse_dim else None)


def _dense_fields(info: PassInfo) -> dict:
    """The LoadedVersion fields of a version's dense slots, read by PassInfo (meta.json's owner); a version
    without dense slots has none, and the model's input is the pooled rows alone."""
    return {"dense_slots": tuple(int(s) for s in info.dense_slots), "dense_norm": info.dense_norm}


def _check_dense(dense_dir: Path, version: str) -> Path:
    prefix = dense_dir / DENSE_PREFIX
    if not prefix.with_suffix(".pdmodel").exists():
        raise DataError(f"version {version}: no dense model at {prefix}.pdmodel")
    return prefix


class CubeRootSource:
    """``CUBE_ROOT/current.json``, ``CUBE_ROOT/VERSION/dense/``, ``CUBE_ROOT/VERSION/meta.json``."""

    def __init__(self, cube_root: str | Path, cube_urls: Sequence[str], lookup_timeout: float = 5.0):
        self.root = Path(cube_root)
        self.cube_urls = list(cube_urls)
        self.lookup_timeout = lookup_timeout
        # One lookup (its threads, connections and each shard's health) for every version: each lookup names
        # its version, so nothing of it belongs to one version, and a hot reload starts no threads.
        self._lookup = CubeLookup(self.cube_urls, lookup_timeout) if self.cube_urls else None
        self.describe = f"cube root {self.root}"
        self.pins = PinStore.local(self.root)

    def current(self) -> CurrentVersion | None:
        return read_current(self.root)

    def _read_manifest(self, version: str) -> dict | None:
        path = self.root / version / MANIFEST_FILE
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None

    def record_for(self, version: str) -> CurrentVersion:
        """The record of any complete cube version (a pinned challenger), from its manifest."""
        current = self.current()
        if current is not None and current.version == version:
            return current
        manifest = self._read_manifest(version)
        if manifest is None:
            raise DataError(f"version {version} is not a cube version here ({self.describe}: no manifest.json)")
        return _record_from_manifest(version, manifest)

    def _version_dir(self, record: CurrentVersion) -> Path:
        return self.root / record.version

    def materialise(self, record: CurrentVersion) -> LoadedVersion:
        vdir = self._version_dir(record)
        meta_path = vdir / META_FILE
        meta = json.loads(meta_path.read_text(encoding="utf-8")) if meta_path.exists() else {}
        slots, sparse_dim = _version_fields(record, meta)
        prefix = _check_dense(vdir / DENSE_DIR, record.version)
        if not self.cube_urls:
            raise ComponentError("no cube-server URLs: pass --cube-servers or set ELASTIC_CTR_CUBE_SERVERS")
        if record.shards != len(self.cube_urls):
            raise ComponentError(
                f"version {record.version} has {record.shards} shards but serving knows "
                f"{len(self.cube_urls)} cube servers ({', '.join(self.cube_urls)})"
            )
        width = int(record.dim or meta.get("embedding_dim") or 0)
        if width <= 0:
            raise DataError(f"version {record.version}: row width (dim) missing from current.json and meta.json")
        return LoadedVersion(
            record.version,
            slots,
            sparse_dim,
            width,
            prefix,
            self._lookup,
            record,
            owns_lookup=False,
            **_dense_fields(PassInfo(record.version, vdir, meta)),
        )

    def prune(self, keep: set[str]) -> None:
        """Nothing to prune: a cube root belongs to cube-transfer."""


def _source_pass_name(source: object, version: str) -> str:
    """The pass a manifest was built from: ``source_pass`` is ``{"name", "path"}`` (a bare name in older
    manifests); the version's own name when it says nothing usable."""
    if isinstance(source, dict):
        source = source.get("name")
    return source if isinstance(source, str) and source else version


def _record_from_manifest(version: str, manifest: dict) -> CurrentVersion:
    try:
        return CurrentVersion(
            version=version,
            pass_name=_source_pass_name(manifest.get("source_pass"), version),
            shards=int(manifest["shards"]),
            dim=int(manifest["dim"]),
            slots=tuple(int(s) for s in manifest.get("slots") or ()),
            sparse_dim=int(manifest["sparse_dim"]) if manifest.get("sparse_dim") else None,
            dense=f"{CUBE_PREFIX}/{version}/{DENSE_DIR}/",
        )
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"version {version}: manifest.json is not a cube manifest ({type(e).__name__}: {e})") from e


class FileServerSource(CubeRootSource):
    """The file server's ``cube/`` tree; dense models are downloaded into ``cache_dir``."""

    def __init__(
        self,
        fileserver_url: str,
        cache_dir: str | Path,
        cube_urls: Sequence[str],
        lookup_timeout: float = 5.0,
        token: str | None = None,
    ):
        super().__init__(cache_dir, cube_urls, lookup_timeout)
        self.fs = FileServerClient(fileserver_url, token=token, timeout=30.0)
        self.describe = f"file server {fileserver_url}"
        self.pins = PinStore.remote(self.fs)

    def current(self) -> CurrentVersion | None:
        try:
            return CurrentVersion.from_json(self.fs.get_json(REMOTE_CURRENT), f"{self.describe}: {REMOTE_CURRENT}")
        except NotFound:
            return None

    def _read_manifest(self, version: str) -> dict | None:
        try:
            return self.fs.get_json(f"{CUBE_PREFIX}/{version}/{MANIFEST_FILE}")
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
        self.pins = None

    def current(self) -> CurrentVersion | None:
        info = latest_complete_pass(self.model_path)
        return None if info is None else self._record(info)

    def record_for(self, version: str) -> CurrentVersion:
        for info in complete_passes(self.model_path):
            if info.name == version:
                return self._record(info)
        raise DataError(f"version {version} is not a complete pass in {self.model_path}")

    @staticmethod
    def _record(info) -> CurrentVersion:
        # No cube here: the "dense" folder is the pass's own, and there are no shards.
        return CurrentVersion(
            info.name, info.name, 0, info.embedding_dim, tuple(info.slots), info.sparse_dim, str(info.path)
        )

    def materialise(self, record: CurrentVersion) -> LoadedVersion:
        info = load_pass(record.dense)
        slots, sparse_dim = _version_fields(record, info.meta)
        prefix = _check_dense(info.path / DENSE_DIR, info.name)
        table = InMemoryTable.from_pass(info)
        lookup = TableLookup(table, info.name)
        return LoadedVersion(info.name, slots, sparse_dim, table.dim, prefix, lookup, record, **_dense_fields(info))

    def prune(self, keep: set[str]) -> None:
        pass


def probe_keys(shards: int) -> np.ndarray:
    """One key per shard (key % N selects the shard), for readiness probes."""
    return np.arange(max(shards, 1), dtype=np.uint64)
