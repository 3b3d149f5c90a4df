"""The pass folder, the models donefile, and the saved sparse table.

Layout written by trainer 0 (see docs/contracts.md)::

    MODEL_PATH/
      donefile                      one JSON line per COMPLETE pass, append-only
      pass-YYYYMMDD-HH/
        dense/inference.pdmodel     paddle inference model; input "emb_concat"
        dense/inference.pdiparams   [-1, len(slots) * embedding_dim + len(dense_slots)] -> click probability
        sparse/000/part-*.gz        the sparse table as fleet.save_persistables writes it
        deleted/part-*[.gz]         (delta passes) keys removed since the parent pass, one per line
        meta.json                   slots, dims, key transform, data window, sparse layout, metrics,
                                    "kind": "base"|"delta", "parent": the pass a delta applies on
        golden.jsonl                {"line": ..., "prob": ...} computed by the training program

A pass folder without its donefile line is incomplete, whatever it contains. A *delta*
pass's sparse table holds only the keys whose rows changed since its parent pass (new
keys included), in the same text layout; its content is the parent's table with those
rows replaced and the deleted keys removed (docs/contracts.md, "Delta passes").
"""

from __future__ import annotations

import datetime as dt
import gzip
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ctr_foundation.dense_features import DenseNorm
from ctr_foundation.errors import DataError
from ctr_foundation.records import read_donefile

DENSE_DIR = "dense"
DENSE_PREFIX = "inference"  # dense/inference.pdmodel + .pdiparams
DENSE_INPUT = "emb_concat"
SPARSE_DIR = "sparse"
SPARSE_TABLE_SUBDIR = "000"
DELETED_DIR = "deleted"
META_FILE = "meta.json"
PASS_KINDS = ("base", "delta")
PASS_PREFIX = "pass-"

# Values that fleet's SparseAccessor (what sparse_embedding gets in 2.6.2) writes per key in text form, before the
# embedding: slot, unseen_days, delta_score, show, click.
ACCESSOR_HEAD_COLUMNS = 5
# Optimizer state columns a sparse rule keeps beside a part of ``n`` values (embed_w: n = 1; embedx_w: n = d - 1).
SPARSE_RULE_STATE = {
    "naive": lambda n: 0,
    "adagrad": lambda n: 1,
    "std_adagrad": lambda n: n,
    "adam": lambda n: 2 * n + 2,
}


def pass_name(hour: dt.datetime, minutes: bool = False) -> str:
    """``pass-YYYYMMDD-HH``, or ``pass-YYYYMMDD-HHMM`` for sub-hour passes (both sort in time order)."""
    return f"{PASS_PREFIX}{hour:%Y%m%d-%H%M}" if minutes else f"{PASS_PREFIX}{hour:%Y%m%d-%H}"


@dataclass(frozen=True)
class SparseLayout:
    """Where the embedding sits in a text line of the saved sparse table.

    Paddle 2.6.2's SparseAccessor stores a dim-d embedding as embed_w (1 value) followed,
    after embed_w's optimizer state, by embedx_w (d-1 values).
    """

    embedding_dim: int
    optimizer: str = "adam"  # embedx_w's rule
    embed_optimizer: str | None = None  # embed_w's rule; None = the same as embedx_w's

    def __post_init__(self):
        for rule in (self.optimizer, self.embed_optimizer):
            if rule is not None and rule not in SPARSE_RULE_STATE:
                raise DataError(f"unknown sparse optimizer {rule!r}; known: {sorted(SPARSE_RULE_STATE)}")

    @property
    def embed_rule(self) -> str:
        return self.embed_optimizer or self.optimizer

    @property
    def state_columns(self) -> tuple[int, int]:
        return SPARSE_RULE_STATE[self.embed_rule](1), SPARSE_RULE_STATE[self.optimizer](self.embedding_dim - 1)

    @property
    def value_columns(self) -> int:
        """Columns after the key."""
        e, x = self.state_columns
        return ACCESSOR_HEAD_COLUMNS + 1 + e + (self.embedding_dim - 1) + x

    def embedding_column_indices(self) -> np.ndarray:
        """Indices (0 = the key) of the embedding's d columns in a line."""
        e, _ = self.state_columns
        embed_w = 1 + ACCESSOR_HEAD_COLUMNS
        embedx = embed_w + 1 + e
        return np.array([embed_w] + list(range(embedx, embedx + self.embedding_dim - 1)))

    def to_json(self) -> dict:
        return {
            "accessor": "SparseAccessor",
            "optimizer": self.optimizer,
            "embed_optimizer": self.embed_rule,
            "embedding_dim": self.embedding_dim,
            "value_columns": self.value_columns,
        }


@dataclass(frozen=True)
class PassInfo:
    name: str
    path: Path
    meta: dict

    @property
    def slots(self) -> list[int]:
        return list(self.meta["slots"])

    @property
    def embedding_dim(self) -> int:
        return int(self.meta["embedding_dim"])

    @property
    def dense_slots(self) -> list[int]:
        """The dense slots (slot.conf ``SLOT dense``), whose standardised values follow the pooled rows."""
        return list(self.meta.get("dense_slots") or [])

    @property
    def dense_norm(self):
        """The dense slots' ``dense_features.DenseNorm`` (None without dense slots)."""
        norm = DenseNorm.from_json(self.meta.get("dense_norm"), f"{self.path / META_FILE}: dense_norm")
        if self.dense_slots and (norm is None or list(norm.slots) != self.dense_slots):
            raise DataError(f"{self.path / META_FILE}: dense_slots {self.dense_slots} without their dense_norm")
        return norm

    @property
    def sparse_dim(self) -> int | None:
        return self.meta.get("sparse_dim")

    @property
    def kind(self) -> str:
        """``base`` (the whole table) or ``delta`` (changes since ``parent``); passes without one are bases."""
        kind = self.meta.get("kind") or "base"
        if kind not in PASS_KINDS:
            raise DataError(f"{self.path / META_FILE}: kind {kind!r} is not one of {PASS_KINDS}")
        if kind == "delta" and not (isinstance(self.meta.get("parent"), str) and self.meta["parent"]):
            raise DataError(f"{self.path / META_FILE}: a delta pass needs the name of its 'parent' pass")
        return kind

    @property
    def parent(self) -> str | None:
        return self.meta.get("parent") if self.kind == "delta" else None

    @property
    def layout(self) -> SparseLayout:
        s = self.meta.get("sparse_layout", {})
        return SparseLayout(self.embedding_dim, s.get("optimizer", "adam"), s.get("embed_optimizer"))

    @property
    def dense_model_prefix(self) -> Path:
        return self.path / DENSE_DIR / DENSE_PREFIX


def load_pass(pass_dir: str | os.PathLike) -> PassInfo:
    pass_dir = Path(pass_dir)
    meta_path = pass_dir / META_FILE
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"{pass_dir} is not a pass folder: {META_FILE} is missing") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{meta_path}: invalid JSON: {e}") from e
    return PassInfo(meta.get("pass", pass_dir.name), pass_dir, meta)


def complete_passes(model_path: str | os.PathLike) -> list[PassInfo]:
    """Passes named in the donefile whose folders still exist, oldest first."""
    out = []
    for entry in read_donefile(model_path):
        p = Path(model_path) / entry.pass_name
        if (p / META_FILE).exists():
            out.append(load_pass(p))
    return out


def latest_complete_pass(model_path: str | os.PathLike) -> PassInfo | None:
    passes = complete_passes(model_path)
    return passes[-1] if passes else None


# A chain longer than this is a loop or a mistake (BASE_EVERY is at most 100000 passes).
MAX_CHAIN = 100_000


def pass_chain(pass_dir: str | os.PathLike) -> list[PassInfo]:
    """The passes whose tables make up ``pass_dir``'s whole table, oldest first: its base, then every delta
    down to ``pass_dir`` itself (just the pass for a base). Parents are sibling folders of the pass; a
    missing parent or a loop is a DataError naming it."""
    info = load_pass(pass_dir)
    chain = [info]
    seen = {info.path.resolve()}
    while chain[-1].kind == "delta":
        parent_dir = chain[-1].path.parent / chain[-1].parent
        if not (parent_dir / META_FILE).exists():
            raise DataError(
                f"{chain[-1].path} is a delta on {chain[-1].parent}, but {parent_dir} is not a pass folder "
                "(deleted, or not copied with it): its whole table cannot be assembled"
            )
        parent = load_pass(parent_dir)
        if parent.path.resolve() in seen or len(chain) > MAX_CHAIN:
            raise DataError(f"{info.path}: its chain of parents loops at {parent.name}")
        seen.add(parent.path.resolve())
        chain.append(parent)
    return chain[::-1]


def sparse_part_files(pass_dir: str | os.PathLike) -> list[Path]:
    table = Path(pass_dir) / SPARSE_DIR / SPARSE_TABLE_SUBDIR
    if not table.is_dir():
        raise DataError(f"{table}: the sparse table folder is missing")
    return sorted(p for p in table.iterdir() if p.name.startswith("part-"))


def deleted_key_files(pass_dir: str | os.PathLike) -> list[Path]:
    """The ``deleted/part-*`` files of a delta pass (none: nothing was deleted)."""
    folder = Path(pass_dir) / DELETED_DIR
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.name.startswith("part-"))


def _parse_key(tok: str) -> int:
    v = int(tok)
    return v + (1 << 64) if v < 0 else v


def iter_sparse_table(
    pass_dir: str | os.PathLike, layout: SparseLayout, chunk_rows: int = 200_000
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Stream (keys uint64[n], embeddings float32[n, d]) chunks from a saved table.

    Raises DataError naming the file and line if a line has the wrong number of columns.
    """
    cols = layout.embedding_column_indices()
    want = 1 + layout.value_columns
    keys: list[int] = []
    rows: list[list[str]] = []
    for part in sparse_part_files(pass_dir):
        opener = gzip.open if part.name.endswith(".gz") else open
        with opener(part, "rt", encoding="ascii") as f:
            for lineno, line in enumerate(f, start=1):
                toks = line.split()
                if not toks:
                    continue
                if len(toks) != want:
                    raise DataError(
                        f"{part}:{lineno}: {len(toks)} columns, expected {want} for "
                        f"{layout.to_json()} (is meta.json's sparse_layout right?)"
                    )
                keys.append(_parse_key(toks[0]))
                rows.append([toks[i] for i in cols])
                if len(keys) >= chunk_rows:
                    yield np.array(keys, dtype=np.uint64), np.array(rows, dtype=np.float32)
                    keys, rows = [], []
    if keys:
        yield np.array(keys, dtype=np.uint64), np.array(rows, dtype=np.float32)


def read_sparse_table(pass_dir: str | os.PathLike, layout: SparseLayout) -> tuple[np.ndarray, np.ndarray]:
    """The whole table, keys sorted ascending (small tables; large ones: iter_sparse_table)."""
    chunks = list(iter_sparse_table(pass_dir, layout))
    if not chunks:
        return np.zeros(0, np.uint64), np.zeros((0, layout.embedding_dim), np.float32)
    keys = np.concatenate([c[0] for c in chunks])
    values = np.concatenate([c[1] for c in chunks])
    order = np.argsort(keys, kind="stable")
    return keys[order], values[order]
