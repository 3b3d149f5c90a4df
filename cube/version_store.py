"""Which shard versions a cube-server worker holds, and how all workers agree on it.

A server keeps up to three versions mapped side by side: ``active`` (what
un-pinned lookups get), ``prepared`` (loaded by the agent, not yet active)
and ``previous`` (the one active before the last switch, so requests pinned
to it keep working while the other shards finish their switch).

Several worker processes share one port (SO_REUSEPORT), and a control call
(load, activate) reaches only one of them. So the desired state lives in a
small JSON file, ``STATE_DIR/state.json``, with a generation number: the
worker that takes the call validates the shard, writes the next generation
(under an flock, so concurrent calls serialise), and answers only once every
worker has applied it, which each worker reports in ``STATE_DIR/worker-K.json``.
Workers watch the file; a restarted worker (or a restarted server) comes back
with exactly the versions recorded there, never a different mix.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ctr_foundation.atomic import atomic_write_json
from ctr_foundation.errors import DataError, UsageError
from cube.lookup_index import ShardIndex
from cube.shard_format import CorruptShardError, fault_in, open_shard

STATE_FILE = "state.json"
ROLES = ("active", "prepared", "previous")


@dataclass
class ControlState:
    generation: int = 0
    workers: int = 1
    shard: int = 0
    active: str | None = None
    prepared: str | None = None
    previous: str | None = None
    paths: dict[str, str] = field(default_factory=dict)  # version -> shard file, relative to the data dir

    def held(self) -> set[str]:
        return {v for v in (self.active, self.prepared, self.previous) if v}

    def to_json(self) -> dict:
        return {
            "generation": self.generation,
            "workers": self.workers,
            "shard": self.shard,
            "active": self.active,
            "prepared": self.prepared,
            "previous": self.previous,
            "paths": {v: p for v, p in self.paths.items() if v in self.held()},
        }

    @classmethod
    def from_json(cls, obj: dict) -> ControlState:
        return cls(
            **{
                k: obj.get(k, getattr(cls(), k))
                for k in ("generation", "workers", "shard", "active", "prepared", "previous", "paths")
            }
        )

    def with_prepared(self, version: str, path: str) -> ControlState:
        """Next state after loading ``version`` (a reload of a held version just refreshes its path)."""
        nxt = ControlState.from_json(self.to_json())
        nxt.generation += 1
        if version not in self.held():
            nxt.prepared = version
        nxt.paths[version] = path
        return nxt

    def with_active(self, version: str) -> ControlState:
        if version not in self.held():
            raise UsageError(
                f"version {version!r} is not loaded (held: {sorted(self.held()) or 'none'}); load it first"
            )
        nxt = ControlState.from_json(self.to_json())
        nxt.generation += 1
        if version != self.active:
            nxt.previous, nxt.active = self.active, version
            if nxt.prepared in (version, nxt.previous):
                nxt.prepared = None
        nxt.paths = {v: p for v, p in self.paths.items() if v in nxt.held()}
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


def resolve_shard_path(data_dir: Path, rel: str) -> Path:
    """A shard path from a control call or the state file, refused if it escapes the data dir."""
    root = data_dir.resolve()
    path = (root / rel).resolve()
    if root != path and root not in path.parents:
        raise UsageError(f"shard path {rel!r} is outside the server's data folder {root}")
    return path


def load_index(data_dir: Path, rel: str, *, version: str, shard: int) -> ShardIndex:
    """Map, check and fault in one shard file; refuse a file for another version or shard."""
    path = resolve_shard_path(data_dir, rel)
    if not path.is_file():
        raise DataError(f"shard file {path} does not exist")
    mapped = open_shard(path)
    if mapped.version != version:
        raise CorruptShardError(f"{path} holds version {mapped.version!r}, not {version!r}")
    if mapped.shard != shard:
        raise CorruptShardError(f"{path} is shard {mapped.shard} of {mapped.shards}, this server serves shard {shard}")
    fault_in(mapped)
    return ShardIndex(mapped)


class VersionSet:
    """The ShardIndex objects one worker holds; replaced as a whole, never mutated in place."""

    def __init__(self, state: ControlState, indexes: dict[str, ShardIndex]):
        self.state = state
        self.indexes = indexes

    @property
    def active(self) -> ShardIndex | None:
        return self.indexes.get(self.state.active) if self.state.active else None

    def get(self, version: str | None) -> ShardIndex | None:
        if version is None:
            return self.active
        return self.indexes.get(version)

    def materialise(self, state: ControlState, data_dir: Path) -> VersionSet:
        """The VersionSet for ``state``, reusing indexes already mapped (loads the rest)."""
        indexes = {}
        for version in state.held():
            have = self.indexes.get(version)
            rel = state.paths[version]
            if have is not None and self.state.paths.get(version) == rel:
                indexes[version] = have
            else:
                indexes[version] = load_index(data_dir, rel, version=version, shard=state.shard)
        return VersionSet(state, indexes)
