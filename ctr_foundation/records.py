"""The small JSON records that cross component boundaries, each with its one reader and writer.

- ``DonefileEntry``: one line of ``MODEL_PATH/donefile`` (trainer 0 appends, cube-transfer and
  the local backend read). Times are timezone-aware; a naive ISO time is read as UTC (the
  writer has always written UTC), a bare number as epoch seconds.
- ``CurrentVersion``: ``current.json``, the active cube version (cube-transfer writes it into
  its cube root and onto the file server; serving and ``status`` read it).
- ``ClientConfig``: ``STATE/client.json`` (``-c`` writes it on either backend; the client reads it).
- golden lines: ``golden.jsonl`` of a pass (trainer 0 writes; serving/evaluation tests and the
  demo check that they reproduce its probabilities).
"""

from __future__ import annotations

import datetime as dt
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ctr_foundation.atomic import append_line_durably, atomic_write_json, atomic_write_text
from ctr_foundation.errors import ConfigError, DataError
from ctr_foundation.names import CLIENT_CONFIG_FILE, CURRENT_FILE

DONEFILE = "donefile"
GOLDEN_FILE = "golden.jsonl"


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def parse_time(value) -> dt.datetime | None:
    """A timezone-aware time from epoch seconds or ISO-8601 text (naive text is UTC); None if unusable."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return dt.datetime.fromtimestamp(float(value), dt.timezone.utc)
    if isinstance(value, str) and value:
        try:
            parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
        return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.timezone.utc)
    return None


def format_time(when: dt.datetime) -> str:
    """ISO-8601 with its offset, e.g. ``2026-12-01T07:00:00.123456+00:00``."""
    if when.tzinfo is None:
        raise ValueError("record times must be timezone-aware")
    return when.isoformat()


def epoch_seconds(value) -> float | None:
    parsed = parse_time(value)
    return parsed.timestamp() if parsed else None


# ---- the models donefile ----------------------------------------------------------------


@dataclass(frozen=True)
class DonefileEntry:
    """One complete pass, as its donefile line says.

    ``extra`` keeps keys this version does not know (written by newer trainers), so a
    reader never drops them.
    """

    pass_name: str
    path: str
    window: dict
    time: dt.datetime | None
    metrics: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    @property
    def epoch(self) -> float | None:
        return self.time.timestamp() if self.time else None

    @property
    def kind(self) -> str:
        """``base`` or ``delta`` (delta passes, docs/contracts.md); lines without one are bases."""
        return str(self.extra.get("kind") or "base")

    @property
    def parent(self) -> str | None:
        return self.extra.get("parent") if self.kind == "delta" else None

    def summary(self) -> dict:
        """What a search prunes on: ``{"pass", "end", "logloss"}`` (the held-out log loss trainer 0 measured;
        published on a Kubernetes job by training/job_progress.py, read by tuning/candidates.py)."""
        return {"pass": self.pass_name, "end": self.window.get("end"), "logloss": self.metrics.get("logloss")}

    def to_json(self) -> dict:
        out = dict(self.extra)
        out.update(
            {
                "pass": self.pass_name,
                "path": self.path,
                "window": self.window,
                "time": format_time(self.time) if self.time else None,
                "metrics": self.metrics,
            }
        )
        return out

    @classmethod
    def from_json(cls, obj: dict) -> DonefileEntry:
        if not isinstance(obj, dict) or not isinstance(obj.get("pass"), str):
            raise ValueError("a donefile line must be a JSON object with a 'pass' name")
        known = {"pass", "path", "window", "time", "metrics"}
        return cls(
            pass_name=obj["pass"],
            path=str(obj.get("path") or ""),
            window=dict(obj.get("window") or {}),
            time=parse_time(obj.get("time")),
            metrics=dict(obj.get("metrics") or {}),
            extra={k: v for k, v in obj.items() if k not in known},
        )


def read_donefile(model_path: str | os.PathLike) -> list[DonefileEntry]:
    """Complete passes in order; a torn or foreign line (crash mid-append) is skipped."""
    path = Path(model_path) / DONEFILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    entries = []
    for raw in text.splitlines():
        raw = raw.strip()
        if not raw:
            continue
        try:
            entries.append(DonefileEntry.from_json(json.loads(raw)))
        except ValueError:  # json.JSONDecodeError is a ValueError
            continue
    return entries


def append_donefile(model_path: str | os.PathLike, entry: DonefileEntry) -> None:
    """Append one line durably: the pass counts from this moment on."""
    append_line_durably(Path(model_path) / DONEFILE, json.dumps(entry.to_json(), sort_keys=True))


# ---- current.json ---------------------------------------------------------------------------


@dataclass(frozen=True)
class CurrentVersion:
    """The cube version every shard serves, and where serving finds its dense model."""

    version: str
    pass_name: str
    shards: int
    dim: int
    slots: tuple[int, ...]
    sparse_dim: int | None
    dense: str  # file-server path of the version's dense model folder
    activated_at: dt.datetime | None = None
    donefile_time: dt.datetime | None = None
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        out = dict(self.extra)
        out.update(
            {
                "version": self.version,
                "pass": self.pass_name,
                "shards": self.shards,
                "dim": self.dim,
                "slots": list(self.slots),
                "sparse_dim": self.sparse_dim,
                "dense": self.dense,
                "activated_at": format_time(self.activated_at) if self.activated_at else None,
                "donefile_time": format_time(self.donefile_time) if self.donefile_time else None,
            }
        )
        return out

    @classmethod
    def from_json(cls, obj, where: str = CURRENT_FILE) -> CurrentVersion:
        if not isinstance(obj, dict):
            raise DataError(f"{where}: expected a JSON object")
        known = {"version", "pass", "shards", "dim", "slots", "sparse_dim", "dense", "activated_at", "donefile_time"}
        try:
            return cls(
                version=str(obj["version"]),
                pass_name=str(obj.get("pass") or obj["version"]),
                shards=int(obj["shards"]),
                dim=int(obj["dim"]),
                slots=tuple(int(s) for s in obj.get("slots") or ()),
                sparse_dim=int(obj["sparse_dim"]) if obj.get("sparse_dim") else None,
                dense=str(obj.get("dense") or ""),
                activated_at=parse_time(obj.get("activated_at")),
                donefile_time=parse_time(obj.get("donefile_time")),
                extra={k: v for k, v in obj.items() if k not in known},
            )
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"{where}: not a current-version record ({type(e).__name__}: {e})") from e

    def to_bytes(self) -> bytes:
        return (json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n").encode()


def read_current(cube_root: str | os.PathLike) -> CurrentVersion | None:
    path = Path(cube_root) / CURRENT_FILE
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: invalid JSON: {e}") from e
    return CurrentVersion.from_json(obj, str(path))


def write_current(cube_root: str | os.PathLike, record: CurrentVersion) -> None:
    atomic_write_json(Path(cube_root) / CURRENT_FILE, record.to_json())


# ---- client.json ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClientConfig:
    """Where the client finds serving and the file server (``elastic-control -c`` writes it)."""

    serving_url: str | None
    fileserver_url: str | None
    slot_conf: str | None = None
    slots: tuple[int, ...] = ()
    serving_grpc: str | None = None  # HOST:PORT of serving's gRPC API

    def to_json(self) -> dict:
        out = asdict(self)
        out["slots"] = list(self.slots)
        if out["serving_grpc"] is None:
            del out["serving_grpc"]
        return out

    @classmethod
    def from_json(cls, obj, where: str = CLIENT_CONFIG_FILE) -> ClientConfig:
        if not isinstance(obj, dict):
            raise ConfigError("expected a JSON object; re-run `elastic-control -c`", path=where)
        try:
            return cls(
                serving_url=obj.get("serving_url"),
                fileserver_url=obj.get("fileserver_url"),
                slot_conf=obj.get("slot_conf"),
                slots=tuple(int(s) for s in obj.get("slots") or ()),
                serving_grpc=obj.get("serving_grpc"),
            )
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{e}; re-run `elastic-control -c`", path=where) from e

    def save(self, path: str | os.PathLike) -> None:
        atomic_write_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> ClientConfig | None:
        """The saved config, or None when ``-c`` never ran."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"invalid JSON: {e}; re-run `elastic-control -c`", path=str(path)) from e
        return cls.from_json(obj, str(path))


# ---- golden.jsonl -------------------------------------------------------------------------------


def write_golden(path: str | os.PathLike, lines: Sequence[str], probs: Iterable[float]) -> None:
    """``{"line": ..., "prob": ...}`` per held-out line, written atomically."""
    probs = [float(p) for p in probs]
    if len(probs) != len(lines):
        raise ValueError(f"{len(lines)} golden lines but {len(probs)} probabilities")
    text = "".join(json.dumps({"line": ln, "prob": p}) + "\n" for ln, p in zip(lines, probs, strict=True))
    atomic_write_text(path, text)


def read_golden(path: str | os.PathLike) -> tuple[list[str], list[float]]:
    """(lines, probabilities) of a golden file; DataError naming the line if one is malformed."""
    lines, probs = [], []
    for n, raw in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
            lines.append(str(row["line"]))
            probs.append(float(row["prob"]))
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{path}:{n}: not a golden line ({e})") from e
    return lines, probs
