"""Which shard versions a cube-server worker holds, and how all workers agree on it.

A server keeps several versions side by side: ``active`` (what un-pinned lookups
get), ``prepared`` (loaded by the agent, not yet active), ``previous`` (the one
active before the last switch, so requests pinned to it keep working while the
other shards finish their switch) and any ``pinned`` versions (kept for lookups
pinned to them, e.g. an A/B challenger arm).

Several worker processes share one port (SO_REUSEPORT), and a control call
(load, activate, unpin) reaches only one of them. So the desired state lives in a
small JSON file, ``STATE_DIR/state.json``, with a generation number: the
worker that takes the call validates the shard, writes the next generation
(under an flock, so concurrent calls serialise), and answers only once every
worker has applied it, which each worker reports in ``STATE_DIR/worker-K.json``.
Workers watch the file; a restarted worker (or a restarted server) comes back
with exactly the versions recorded there whose files still verify.

Every version is loaded from files checked against the manifest of their folder
(size and sha256) into the worker's own memory; a delta version is its parent's
content with the delta laid over it (cube/delta_merge.py), the parent taken from
memory when the worker holds it, else loaded from its folder beside the version's
(recursively, down to a base).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ctr_foundation.atomic import atomic_write_json
from ctr_foundation.errors import DataError, ElasticControlError, UsageError
from cube.delta_merge import Delta, apply, fold_all
from cube.lookup_index import ShardIndex
from cube.shard_format import (
    CorruptShardError,
    ShardData,
    deleted_file_name,
    file_entry,
    file_stamp,
    manifest_kind,
    read_deleted,
    read_manifest,
    read_shard,
    shard_file_name,
    verify_file,
)

STATE_FILE = "state.json"
COMPACTED = "compacted"  # VERSION/compacted/: a full copy of a delta version (cube roots of cube-transfer)
ROLES = ("active", "prepared", "previous")
MAX_CHAIN = 10_000  # a longer parent chain is a loop in the manifests
MAX_DROPPED = 20  # start-up drops remembered in the state file (newest)


@dataclass
class ControlState:
    generation: int = 0
    workers: int = 1
    shard: int = 0
    active: str | None = None
    prepared: str | None = None
    previous: str | None = None
    pinned: list[str] = field(default_factory=list)
    paths: dict[str, str] = field(default_factory=dict)  # version -> shard file, relative to the data dir
    stamps: dict[str, str] = field(default_factory=dict)  # version -> file_stamp() of that file when loaded
    dropped: dict[str, str] = field(default_factory=dict)  # version -> why it was dropped at start-up

    def held(self) -> set[str]:
        return {v for v in (self.active, self.prepared, self.previous) if v} | set(self.pinned)

    def to_json(self) -> dict:
        held = self.held()
        return {
            "generation": self.generation,
            "workers": self.workers,
            "shard": self.shard,
            "active": self.active,
            "prepared": self.prepared,
            "previous": self.previous,
            "pinned": list(self.pinned),
            "paths": {v: p for v, p in self.paths.items() if v in held},
            "stamps": {v: s for v, s in self.stamps.items() if v in held},
            "dropped": dict(list((v, r) for v, r in self.dropped.items() if v not in held)[-MAX_DROPPED:]),
        }

    @classmethod
    def from_json(cls, obj: dict) -> ControlState:
        fields = (
            "generation",
            "workers",
            "shard",
            "active",
            "prepared",
            "previous",
            "pinned",
            "paths",
            "stamps",
            "dropped",
        )
        out = cls(**{k: obj[k] for k in fields if k in obj})
        out.pinned, out.paths, out.stamps, out.dropped = (
            list(out.pinned),
            dict(out.paths),
            dict(out.stamps),
            dict(out.dropped),
        )
        return out

    def copy(self) -> ControlState:
        return ControlState.from_json(self.to_json())

    def with_prepared(self, version: str, path: str, stamp: str, *, pin: bool = False) -> ControlState:
        """Next state after loading ``version`` (a reload of a held version refreshes its path and stamp)."""
        nxt = self.copy()
        nxt.generation += 1
        if pin:
            if version not in nxt.pinned:
                nxt.pinned.append(version)
        elif version not in self.held():
            nxt.prepared = version
        nxt.paths[version], nxt.stamps[version] = path, stamp
        return nxt

    def with_active(self, version: str) -> ControlState:
        if version not in self.held():
            raise UsageError(
                f"version {version!r} is not loaded (held: {sorted(self.held()) or 'none'}); load it first"
            )
        nxt = self.copy()
        nxt.generation += 1
        if version != self.active:
            nxt.previous, nxt.active = self.active, version
            if nxt.prepared in (version, nxt.previous):
                nxt.prepared = None
        return nxt

    def without(self, version: str) -> ControlState:
        """Next state with ``version`` no longer prepared or pinned (the active and previous stay)."""
        nxt = self.copy()
        nxt.generation += 1
        if nxt.prepared == version:
            nxt.prepared = None
        nxt.pinned = [v for v in nxt.pinned if v != version]
        return nxt

    def dropping(self, reasons: dict[str, str]) -> ControlState:
        """Next state without the versions of ``reasons`` in any role (their files failed to verify)."""
        nxt = self.copy()
        nxt.generation += 1
        for role in ROLES:
            if getattr(nxt, role) in reasons:
                setattr(nxt, role, None)
        nxt.pinned = [v for v in nxt.pinned if v not in reasons]
        nxt.dropped.update(reasons)
        return nxt


class StateFile:
    """``STATE_DIR/state.json`` plus per-worker acknowledgements."""

    def __init__(self, state_dir: str | os.PathLike):
        self.dir = Path(state_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / STATE_FILE

    def read(self) -> ControlState | None:
        try:
            return ControlState.from_json(json.loads(self.path.read_text(encoding="utf-8")))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError) as e:
            raise DataError(f"{self.path}: not a cube-server state file ({e}); move it away to start afresh") from e

    def write(self, state: ControlState) -> None:
        atomic_write_json(self.path, state.to_json())

    def stamp(self) -> tuple:
        """Cheap change detector for the watcher (the file is replaced on every write)."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return ()
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    @contextlib.contextmanager
    def locked(self):
        """Serialise read-modify-write of the state across workers."""
        with open(self.dir / ".lock", "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def write_ack(self, worker: int, ack: dict) -> None:
        atomic_write_json(self.dir / f"worker-{worker}.json", ack)

    def read_acks(self, workers: int) -> dict[int, dict]:
        out = {}
        for k in range(workers):
            with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                out[k] = json.loads((self.dir / f"worker-{k}.json").read_text(encoding="utf-8"))
        return out


def resolve_shard_path(data_dir: Path, rel) -> Path:
    """A shard path from a control call or the state file, refused if it escapes the data dir."""
    if not isinstance(rel, str) or not rel or "\x00" in rel:
        raise UsageError(f"shard path {rel!r} must be a non-empty string without NUL bytes")
    root = data_dir.resolve()
    path = (root / rel).resolve()
    if root != path and root not in path.parents:
        raise UsageError(f"shard path {rel!r} is outside the server's data folder {root}")
    return path


@dataclass(frozen=True)
class LocalVersion:
    """One version's files for one shard, as the manifest of its folder lists them."""

    version: str
    shard: int
    kind: str
    parent: str | None
    rows_file: Path
    rows_entry: dict
    deleted_entry: dict | None

    @classmethod
    def at(cls, rows_file: Path, version: str, shard: int) -> LocalVersion:
        vdir = rows_file.parent
        manifest = read_manifest(vdir)
        if manifest.get("version") != version:
            raise CorruptShardError(f"{vdir}/manifest.json is for version {manifest.get('version')!r}, not {version!r}")
        kind = manifest_kind(manifest)
        entry = file_entry(manifest, rows_file.name, vdir)
        deleted = file_entry(manifest, deleted_file_name(shard), vdir) if kind == "delta" else None
        return cls(version, shard, kind, manifest.get("parent"), rows_file, entry, deleted)

    @property
    def deleted_file(self) -> Path:
        return self.rows_file.with_name(deleted_file_name(self.shard))

    def parent_rows_file(self) -> Path:
        """Where the parent version's rows of this shard are: its folder beside this version's (its
        ``compacted/`` full copy when a cube root has one: the chain ends there)."""
        folder = self.rows_file.parent
        if folder.name == COMPACTED:
            folder = folder.parent
        parent = folder.parent / self.parent
        compacted = parent / COMPACTED / shard_file_name(self.shard)
        return compacted if compacted.is_file() else parent / shard_file_name(self.shard)

    def files(self) -> list[tuple[Path, dict]]:
        out = [(self.rows_file, self.rows_entry)]
        if self.deleted_entry is not None:
            out.append((self.deleted_file, self.deleted_entry))
        return out

    def _check(self, data: ShardData, what: Path) -> None:
        if data.version != self.version:
            raise CorruptShardError(f"{what} holds version {data.version!r}, not {self.version!r}")
        if data.shard != self.shard:
            raise CorruptShardError(f"{what} is shard {data.shard} of {data.shards}, not shard {self.shard}")
        if data.kind != self.kind:
            raise CorruptShardError(f"{what} holds {data.kind} rows but its manifest says {self.kind}")

    def read_base(self) -> ShardData:
        data = read_shard(self.rows_file, size=self.rows_entry["size"], sha256=self.rows_entry["sha256"])
        self._check(data, self.rows_file)
        return data

    def read_delta(self) -> tuple[ShardData, Delta]:
        rows = read_shard(self.rows_file, size=self.rows_entry["size"], sha256=self.rows_entry["sha256"])
        self._check(rows, self.rows_file)
        if rows.parent != self.parent:
            raise CorruptShardError(f"{self.rows_file} applies on {rows.parent!r}, its manifest says {self.parent!r}")
        meta, deleted = read_deleted(
            self.deleted_file, size=self.deleted_entry["size"], sha256=self.deleted_entry["sha256"]
        )
        if meta.get("version") != self.version or meta.get("shard") != str(self.shard):
            raise CorruptShardError(f"{self.deleted_file} is not shard {self.shard} of version {self.version!r}")
        return rows, Delta.of(rows.keys, rows.values, deleted)

    def verify(self) -> None:
        """Size and sha256 of this version's own files (streamed, nothing kept)."""
        for path, entry in self.files():
            verify_file(path, size=entry["size"], sha256=entry["sha256"])


def version_chain(rows_file: Path, version: str, shard: int, stop=lambda v: False) -> list[LocalVersion]:
    """The version and its ancestors on disk, newest first, down to a base or a version ``stop`` accepts."""
    chain = [LocalVersion.at(rows_file, version, shard)]
    while chain[-1].kind == "delta" and not stop(chain[-1].parent):
        if len(chain) > MAX_CHAIN:
            raise CorruptShardError(f"{rows_file}: the parent chain of {version!r} does not end (a loop?)")
        cur = chain[-1]
        try:
            chain.append(LocalVersion.at(cur.parent_rows_file(), cur.parent, shard))
        except DataError as e:
            raise DataError(f"version {version!r} needs its ancestor {cur.parent!r}, which is not usable: {e}") from e
    return chain


def verify_chain(data_dir: Path, rel: str, version: str, shard: int) -> None:
    """Check every file a version needs (its own and its ancestors') against their manifests."""
    for lv in version_chain(resolve_shard_path(data_dir, rel), version, shard):
        lv.verify()


class ChainLoader:
    """Loads versions of one shard, reusing contents already in memory (``have``) for parents."""

    def __init__(self, data_dir: Path, shard: int, have: dict[str, ShardData] | None = None):
        self.data_dir, self.shard = data_dir, shard
        self.memo: dict[str, ShardData] = dict(have or {})

    def depth(self, version: str, rel: str) -> int:
        """Deltas between the version and its base on disk (orders loads so parents come first)."""
        try:
            path = resolve_shard_path(self.data_dir, rel)
            return len(version_chain(path, version, self.shard, self.memo.__contains__))
        except ElasticControlError:
            return 0  # the load itself will report the error

    def content(self, version: str, rel: str) -> ShardData:
        if version in self.memo:
            return self.memo[version]
        chain = version_chain(resolve_shard_path(self.data_dir, rel), version, self.shard, self.memo.__contains__)
        bottom = chain[-1]
        if bottom.kind == "delta":
            parent = self.memo[bottom.parent]
        else:
            parent = bottom.read_base()
            chain = chain[:-1]
            self.memo[bottom.version] = parent
        deltas = []
        for lv in reversed(chain):  # oldest first
            rows, delta = lv.read_delta()
            if rows.dim != parent.dim or rows.shards != parent.shards:
                raise CorruptShardError(
                    f"{lv.rows_file}: dim {rows.dim} of {rows.shards} shards does not fit its parent's "
                    f"dim {parent.dim} of {parent.shards} shards"
                )
            deltas.append(delta)
        if not deltas:
            return parent
        keys, values = apply(parent.keys, parent.values, fold_all(deltas))
        top = chain[0]
        data = ShardData(version, self.shard, parent.shards, parent.dim, keys, values, kind="delta", parent=top.parent)
        self.memo[version] = data
        return data


def load_index(data_dir: Path, rel: str, *, version: str, shard: int, have: dict | None = None) -> ShardIndex:
    """Read, check and index one version of a shard (its whole chain when it is a delta)."""
    return ShardIndex(ChainLoader(data_dir, shard, have).content(version, rel))


class VersionSet:
    """The ShardIndex objects one worker holds; replaced as a whole, never mutated in place."""

    def __init__(
        self,
        state: ControlState,
        indexes: dict[str, ShardIndex],
        stamps: dict[str, str] | None = None,
        errors: dict[str, str] | None = None,
    ):
        self.state = state
        self.indexes = indexes
        self.stamps = stamps or {}  # version -> the stamp it was loaded under
        self.errors = errors or {}  # version -> why it could not be loaded

    @property
    def active(self) -> ShardIndex | None:
        return self.indexes.get(self.state.active) if self.state.active else None

    def get(self, version: str | None) -> ShardIndex | None:
        if version is None:
            return self.active
        return self.indexes.get(version)

    def role(self, version: str) -> str:
        for r in ROLES:
            if getattr(self.state, r) == version:
                return r
        return "pinned"

    def materialise(self, state: ControlState, data_dir: Path, preloaded: dict | None = None) -> VersionSet:
        """The VersionSet for ``state``: reuses indexes already loaded under the same path and stamp, loads
        the rest; a version that fails is left out and its error recorded (the others still load)."""
        indexes, stamps, errors = {}, {}, {}
        have = {}
        for version in state.held():
            key = (state.paths.get(version), state.stamps.get(version, ""))
            mine = self.indexes.get(version)
            if mine is not None and (self.state.paths.get(version), self.stamps.get(version, "")) == key:
                indexes[version] = mine
            elif preloaded and preloaded.get(version, (None, None))[0] == key:
                indexes[version] = preloaded[version][1]
            else:
                continue
            stamps[version] = key[1]
            have[version] = indexes[version].shard
        todo = [v for v in state.held() if v not in indexes]
        for version, index in self.indexes.items():  # held before: still a good parent for what is loaded now
            if version not in todo:
                have.setdefault(version, index.shard)
        loader = ChainLoader(data_dir, state.shard, have)
        todo.sort(key=lambda v: loader.depth(v, state.paths.get(v, "")))
        for version in todo:
            rel = state.paths.get(version)
            try:
                if rel is None:
                    raise DataError(f"the state file names no shard file for {version!r}")
                indexes[version] = ShardIndex(loader.content(version, rel))
                stamps[version] = state.stamps.get(version, "")
            except ElasticControlError as e:
                errors[version] = str(e)
        return VersionSet(state, indexes, stamps, errors)


def stamp_of(data_dir: Path, rel: str) -> str:
    try:
        return file_stamp(resolve_shard_path(data_dir, rel))
    except FileNotFoundError:
        raise DataError(f"shard file {resolve_shard_path(data_dir, rel)} does not exist") from None
