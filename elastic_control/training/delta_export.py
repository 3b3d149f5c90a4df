"""Incremental passes from the real parameter server: deltas, admission, eviction (docs/contracts.md).

Measured on Paddle 2.6.2 (``SparseAccessor``, ``MemorySparseTable``) before relying on it:

- every push adds its ``show`` (1 per occurrence in a batch; clicks are pushed as 0) to the key's ``show``
  and ``delta_score`` columns (delta_score += 0.1 per show) and sets ``unseen_days`` to 0;
- ``save_one_model(table, path, 1)`` ("xbox delta") writes exactly the keys whose delta_score reached
  ``delta_threshold`` and then resets their delta_score to 0: with a tiny positive threshold, exactly the
  keys pushed since the previous mode-1 save (a second save right after writes nothing), whole lines;
  ``save_one_model(table, path, 0)`` writes every key and resets nothing;
- a key pulled but never pushed is not created (the pull answers zeros), and a pull of a key that is not
  in the table answers zeros too;
- ``shrink_sparse_table`` deletes the keys with ``unseen_days > delete_after_unseen_days`` (and
  ``score < delete_threshold``, 0 here), and ``load_one_table`` at run time replaces the lines of the keys
  it reads, leaving the others untouched. Paddle only advances unseen_days with a mode-3 save, which
  writes the whole table: instead of that, the keys to evict are decided here (``KeyState``) and removed
  by loading, for them only, a line with a huge unseen_days ("tombstones"), then shrinking;
- ``CountFilterEntry``/``ShowClickEntry`` (sparse_embedding's ``entry``) have no effect on this table in
  2.6.2 (its C++ core does not parse them), so admission is done here: a mask in the training program;
- a shard file of a save is ``part-PPP-SSSSS`` with SSSSS = ``key % shard_num``, in every mode.

Per pass, while every trainer waits at the export barrier (trainer 0 flushed its pushes), trainer 0:
1. saves mode 1 into the staging folder: the keys pushed during the pass;
2. updates the key state: new keys, admissions (``show >= ADMIT_MIN_COUNT``), then evictions, which it
   removes from the pservers;
3. a delta: splits the mode-1 lines into ``sparse/`` (admitted) and ``pending/`` (not yet), writes the
   evicted keys to ``deleted/`` (admitted ones) and ``pending/deleted/`` (the others);
   a base: saves mode 0 (the whole table, after the evictions) and splits it the same way, plus
   ``key_state.npz``.
Golden lines are scored afterwards with the same admitted set, so serving (cube holds only ``sparse/``)
answers what training computed.

Resume (``assemble_resume_table``): each pserver merges the chain of the last complete pass (base +
deltas, ``sparse/`` and ``pending/``, deletes applied, delta_score reset) for its own shards into a
hidden folder and loads that; no full checkpoint is kept.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ctr_foundation.env_vars import TEST_FULL_SAVE
from ctr_foundation.errors import DataError
from ctr_foundation.pass_format import DELETED_DIR, SPARSE_DIR, SPARSE_TABLE_SUBDIR, PassInfo, pass_chain
from ctr_foundation.sparse_table_reader import iter_deleted_keys
from elastic_control.config.data_config import DataConfig
from elastic_control.training.key_state import KEY_STATE_FILE, PENDING_DIR, KeyState
from elastic_control.training.table_files import (
    PartLines,
    key_files,
    move_table,
    overlay,
    read_part_lines,
    table_parts,
    write_lines,
    zero_delta_score,
)

SAVE_ALL, SAVE_DELTA = 0, 1  # Paddle's save modes (MemorySparseTable::Save)
# delta_score grows 0.1 per pushed occurrence: any push passes this threshold, an untouched key (0) does not.
DELTA_THRESHOLD = 1e-6
# Keys are never aged by Paddle here (no mode-3 save), so real keys keep unseen_days 0: only tombstones pass.
TOMBSTONE_UNSEEN_DAYS = 2_000_000
DELETE_AFTER_UNSEEN_DAYS = 1_000_000
RAW_DELTA_DIR = ".raw-delta"
TOMBSTONE_DIR = ".tombstones"
RESUME_PREFIX = ".resume-"


def accessor_overrides(config: DataConfig) -> dict:
    """``ctr_accessor_param`` settings the incremental export relies on (none when it is off)."""
    if not config.incremental:
        return {}
    return {
        "ctr_accessor_param.delta_threshold": DELTA_THRESHOLD,
        "ctr_accessor_param.base_threshold": 0.0,
        "ctr_accessor_param.delta_keep_days": float(TOMBSTONE_UNSEEN_DAYS * 10),
        "ctr_accessor_param.delete_threshold": 0.0,
        "ctr_accessor_param.delete_after_unseen_days": float(DELETE_AFTER_UNSEEN_DAYS),
        "ctr_accessor_param.show_click_decay_rate": 1.0,
    }


@dataclass(frozen=True)
class PassPlan:
    kind: str  # base | delta
    parent: str | None
    depth: int  # deltas since the base (0 for a base)

    def meta(self) -> dict:
        return {"kind": self.kind, "parent": self.parent, "depth": self.depth}


def plan_next(last: PassInfo | None, config: DataConfig) -> PassPlan:
    """Base or delta for the pass after ``last``: the first pass and every BASE_EVERY-th are bases."""
    if not config.delta_passes or last is None:
        return PassPlan("base", None, 0)
    depth = int(last.meta.get("depth", len(pass_chain(last.path)) - 1))
    if depth + 1 >= config.base_every:
        return PassPlan("base", None, 0)
    return PassPlan("delta", last.name, depth + 1)


def local_shards(index: int, pservers: int, shards: int) -> range:
    """The table shards pserver ``index`` holds (Paddle's sparse_local_shard_num split)."""
    per = math.ceil(shards / pservers)
    start = index * per
    return range(min(start, shards), min(start + per, shards))


class IncrementalExport:
    """Trainer 0's sparse export when deltas, admission or eviction are on (see the module docstring)."""

    def __init__(self, config: DataConfig, worker, table_id: int, shards: int, state: KeyState, log=print):
        self.config, self.worker, self.table_id, self.shards = config, worker, table_id, shards
        self.state, self.log = state, log

    def export(self, stage: Path, plan: PassPlan) -> dict:
        """Write the pass's sparse part into ``stage`` (the pass staging folder); returns its key metrics."""
        raw = stage / RAW_DELTA_DIR
        self.worker.save_one_model(self.table_id, str(raw), SAVE_DELTA)
        pushed = {s: read_part_lines(p) for s, p in table_parts(raw).items()}
        all_pushed = PartLines.concat([pushed[s] for s in sorted(pushed)])
        if len(np.unique(all_pushed.keys)) != len(all_pushed):
            raise DataError(f"{raw}: a key appears twice in one delta save")
        admit = self._qualifies(all_pushed)
        admitted, stats = self.state.observe(all_pushed.keys, admit, all_pushed.shows())
        evicted, evicted_admitted = np.zeros(0, np.uint64), np.zeros(0, bool)
        if self.config.evict_after_passes:
            evicted, evicted_admitted = self.state.evict(self.config.evict_after_passes)
            if len(evicted):
                self._remove_from_pservers(stage, evicted)
        stats.evicted, stats.evicted_admitted = len(evicted), int(evicted_admitted.sum())

        sparse, pending = stage / SPARSE_DIR, stage / PENDING_DIR
        if plan.kind == "delta":
            if self.config.admit_min_count:
                offset = 0  # all_pushed is the shards' lines in shard order: ``admitted`` lines up with them
                for shard, part in sorted(table_parts(raw).items()):
                    lines = pushed[shard]
                    mask = admitted[offset : offset + len(lines)]
                    offset += len(lines)
                    self._write_split(part.name, lines, mask, sparse, pending)
            else:
                move_table(raw, sparse)
            key_files(evicted[evicted_admitted], stage / DELETED_DIR)
            key_files(evicted[~evicted_admitted], pending / DELETED_DIR)
            rows = int(admitted.sum())
        else:
            self.worker.save_one_model(self.table_id, str(sparse), SAVE_ALL)
            if self.config.admit_min_count:
                for part in table_parts(sparse).values():
                    lines = read_part_lines(part)
                    self._write_split(part.name, lines, self.state.is_admitted(lines.keys), sparse, pending)
            self.state.save(stage / KEY_STATE_FILE)
            rows = self.state.admitted_count
        shutil.rmtree(raw, ignore_errors=True)
        full = TEST_FULL_SAVE.get()
        if full:  # test hook: the pserver's whole table right after this export, to compare with the chain
            name = stage.name.lstrip(".").rsplit(".", 2)[0]  # staging folder: .PASS.RANDOM.tmp
            self.worker.save_one_model(self.table_id, str(Path(full) / name), SAVE_ALL)
        out = {**self.state.counts(), **{f"keys_{k}": v for k, v in asdict(stats).items()}, "rows": rows}
        out["keys_deleted"] = int(evicted_admitted.sum()) if plan.kind == "delta" else 0
        return out

    def _qualifies(self, pushed: PartLines) -> np.ndarray:
        if not self.config.admit_min_count:
            return np.ones(len(pushed), bool)
        return pushed.shows() >= self.config.admit_min_count

    def _write_split(self, name: str, lines: PartLines, admitted: np.ndarray, sparse: Path, pending: Path) -> None:
        """One shard's lines into sparse/000/NAME (admitted) and pending/000/NAME (the rest)."""
        write_lines(sparse / SPARSE_TABLE_SUBDIR / name, lines.take(np.flatnonzero(admitted)).lines)
        write_lines(pending / SPARSE_TABLE_SUBDIR / name, lines.take(np.flatnonzero(~admitted)).lines)

    def _remove_from_pservers(self, stage: Path, keys: np.ndarray) -> None:
        """Delete ``keys`` from the table: load a tombstone line for each (huge unseen_days), then shrink."""
        folder = stage / TOMBSTONE_DIR
        table = folder / SPARSE_TABLE_SUBDIR
        table.mkdir(parents=True, exist_ok=True)
        shard_of = keys % np.uint64(self.shards)
        for s in range(self.shards):
            mine = keys[shard_of == s].tolist()
            # slot unseen_days delta_score show click embed_w: the 6 values Paddle's parser requires.
            text = "".join(f"{k} 0 {TOMBSTONE_UNSEEN_DAYS} 0 0 0 0\n" for k in mine)
            (table / f"part-000-{s:05d}").write_text(text, encoding="ascii")
        self.worker.load_one_table(self.table_id, str(folder), SAVE_ALL)
        self.worker.shrink_sparse_table(self.table_id, 0)
        shutil.rmtree(folder, ignore_errors=True)


# -- resume (each pserver) ---------------------------------------------------------------------------
def shard_lines(where: Path, parts: dict[int, Path], shard: int, shards: int) -> PartLines:
    """The lines of shard ``shard`` of a table of ``shards`` in one saved table's part files (``table_parts``).

    A table saved with as many shards has them in the shard's own file. One saved with another count (by a
    job of another number of pservers, or before tables had 2 shards a pserver) has them spread over its
    files: every file is read and its keys ``key % shards == shard`` kept."""
    if (max(parts) + 1 if parts else 0) == shards:
        lines = read_part_lines(parts[shard]) if shard in parts else PartLines.empty()
        bad = lines.keys % np.uint64(shards) != shard
        if bad.any():
            raise DataError(f"{where}: key {int(lines.keys[bad][0])} is in the file of shard {shard}")
        return lines
    kept = []
    for path in parts.values():
        lines = read_part_lines(path)
        kept.append(lines.take(np.flatnonzero(lines.keys % np.uint64(shards) == shard)))
    return PartLines.concat(kept)


def assemble_resume_table(
    pass_dir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    shards: int,
    mine: range,
    log: Callable[[str], None] = print,
) -> Path:
    """Write the whole table of ``pass_dir`` (its chain: base, then deltas; admitted and pending keys) for
    the shards in ``mine`` of a table of ``shards`` into ``out/000/part-000-SSSSS`` (empty files for the
    other shards: Paddle's load wants one file per shard and reads only its own), delta_score reset; the
    chain's passes may have been saved with other shard counts (``shard_lines``). Returns ``out``."""
    out = Path(out)
    shutil.rmtree(out, ignore_errors=True)
    table = out / SPARSE_TABLE_SUBDIR
    table.mkdir(parents=True)
    chain = pass_chain(pass_dir)
    layers = []
    for info in chain:
        deleted = np.concatenate(
            [*iter_deleted_keys(info.path), *iter_deleted_keys(info.path / PENDING_DIR), np.zeros(0, np.uint64)]
        )
        layers.append((info, table_parts(info.path / SPARSE_DIR), table_parts(info.path / PENDING_DIR), deleted))
    rows = 0
    for s in range(shards):
        path = table / f"part-000-{s:05d}"
        if s not in mine:
            path.write_bytes(b"")
            continue
        merged = PartLines.empty()
        for info, files, pending, deleted in layers:
            newer = PartLines.concat([shard_lines(info.path, parts, s, shards) for parts in (files, pending)])
            merged = overlay(merged, newer, deleted)
        write_lines(path, zero_delta_score(merged.lines))
        rows += len(merged)
    log(f"assembled {rows} rows of {chain[-1].name} from {len(chain)} pass(es) ({chain[0].name} and its deltas)")
    return out
