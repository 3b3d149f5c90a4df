"""What the trainers know about every key of the sparse table between passes: alive, admitted, last seen.

With incremental exports on (``DataConfig.incremental``), trainer 0 keeps, for every key the pservers hold
(sorted uint64 ``keys``): the pass it was last pushed in (``last_seen``, a pass sequence number), its push
count (``shows``: the pserver's ``show`` column as its last saved line says) and whether it is *admitted*
(``ADMIT_MIN_COUNT``: pushed at least N times; without admission every key is). That is what decides which
keys a delta holds in ``sparse/`` (admitted) or ``pending/`` (not yet), which keys are evicted
(``EVICT_AFTER_PASSES``: unseen for N passes), and the admission masks of the next pass's batches.
Memory: 17 bytes per live key.

The state is never stored whole except in base passes (``key_state.npz``); everywhere else it is replayed
from the pass folders (``from_chain``, ``apply_pass``): the resume point, and the other trainers, which only
need the admitted keys, rebuild it from the same files trainer 0 wrote, so every trainer masks the same keys.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ctr_foundation.errors import DataError
from ctr_foundation.pass_format import SPARSE_DIR, PassInfo, pass_chain
from ctr_foundation.sparse_table_reader import iter_deleted_keys
from elastic_control.training.table_files import PartLines, read_part_lines, table_parts

KEY_STATE_FILE = "key_state.npz"  # base passes: every live key, passes unseen, admitted
PENDING_DIR = "pending"  # pending/000/part-*: lines of keys not admitted yet; pending/deleted/part-*: evicted ones


@dataclass
class PassKeys:
    """What one pass did to the table's keys."""

    pushed: int = 0  # keys pushed during the pass (the rows of its delta save)
    new: int = 0  # of which new keys
    newly_admitted: int = 0
    evicted: int = 0
    evicted_admitted: int = 0  # evicted keys that were admitted (the cube-visible deletes)


class KeyState:
    def __init__(self, keys=None, last_seen=None, admitted=None, shows=None, seq: int = 0):
        self.keys = np.zeros(0, np.uint64) if keys is None else np.asarray(keys, np.uint64)
        n = len(self.keys)
        self.last_seen = np.zeros(n, np.int32) if last_seen is None else np.asarray(last_seen, np.int32)
        self.admitted = np.ones(n, bool) if admitted is None else np.asarray(admitted, bool)
        self.shows = np.zeros(n, np.float32) if shows is None else np.asarray(shows, np.float32)
        self.seq = seq  # sequence number of the last pass folded in

    # -- queries ---------------------------------------------------------------------------------
    @property
    def live(self) -> int:
        return len(self.keys)

    @property
    def admitted_count(self) -> int:
        return int(self.admitted.sum())

    def _find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(positions, present) of ``keys`` in the state."""
        keys = np.asarray(keys, np.uint64)
        if len(self.keys) == 0:
            return np.zeros(len(keys), np.int64), np.zeros(len(keys), bool)
        pos = np.searchsorted(self.keys, keys)
        pos_c = np.minimum(pos, len(self.keys) - 1)
        return pos_c, self.keys[pos_c] == keys

    def is_admitted(self, keys: np.ndarray) -> np.ndarray:
        """bool per key: live and admitted (unknown keys are not)."""
        return self.admitted_and_shows(keys)[0]

    def shows_of(self, keys: np.ndarray) -> np.ndarray:
        """float32 per key: its push count as last saved (0 for unknown keys)."""
        return self.admitted_and_shows(keys)[1]

    def admitted_and_shows(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(is_admitted, shows_of) of each key, from one search."""
        pos, present = self._find(keys)
        admitted, shows = np.zeros(len(pos), bool), np.zeros(len(pos), np.float32)
        admitted[present], shows[present] = self.admitted[pos[present]], self.shows[pos[present]]
        return admitted, shows

    def counts(self) -> dict:
        live, admitted = self.live, self.admitted_count
        return {"keys_live": live, "keys_admitted": admitted, "keys_pending": live - admitted}

    # -- trainer 0, during an export -----------------------------------------------------------------
    def observe(
        self, pushed: np.ndarray, admit: np.ndarray, shows: np.ndarray | None = None
    ) -> tuple[np.ndarray, PassKeys]:
        """Start the next pass (``seq + 1``): ``pushed`` keys (unique) were pushed during it, ``admit``
        says for each whether it qualifies for admission now (its count reached ADMIT_MIN_COUNT) and
        ``shows`` is its push count now (unknown: 0).

        Returns (admitted bool per pushed key, counts): an admitted key stays admitted until evicted.
        """
        self.seq += 1
        pushed = np.asarray(pushed, np.uint64)
        admit = np.asarray(admit, bool)
        shows = np.zeros(len(pushed), np.float32) if shows is None else np.asarray(shows, np.float32)
        pos, present = self._find(pushed)
        was = np.zeros(len(pushed), bool)
        was[present] = self.admitted[pos[present]]
        now = was | admit
        stats = PassKeys(pushed=len(pushed), new=int((~present).sum()), newly_admitted=int((now & ~was).sum()))
        self.last_seen[pos[present]] = self.seq
        self.admitted[pos[present]] = now[present]
        self.shows[pos[present]] = shows[present]
        if (~present).any():
            new = ~present
            keys = np.concatenate([self.keys, pushed[new]])
            order = np.argsort(keys, kind="stable")
            self.keys = keys[order]
            self.last_seen = np.concatenate([self.last_seen, np.full(int(new.sum()), self.seq, np.int32)])[order]
            self.admitted = np.concatenate([self.admitted, now[new]])[order]
            self.shows = np.concatenate([self.shows, shows[new]])[order]
        return now, stats

    def evict(self, after_passes: int) -> tuple[np.ndarray, np.ndarray]:
        """Remove the keys unseen for ``after_passes`` passes (not pushed in the last ``after_passes``
        passes, this one included); returns (their keys, whether each was admitted)."""
        gone = (self.seq - self.last_seen) >= after_passes
        keys, admitted = self.keys[gone], self.admitted[gone]
        if len(keys):
            self.remove(gone)
        return keys, admitted

    def remove(self, mask: np.ndarray) -> None:
        keep = ~mask
        self.keys, self.last_seen = self.keys[keep], self.last_seen[keep]
        self.admitted, self.shows = self.admitted[keep], self.shows[keep]

    def remove_keys(self, keys: np.ndarray) -> None:
        pos, present = self._find(keys)
        if present.any():
            mask = np.zeros(len(self.keys), bool)
            mask[pos[present]] = True
            self.remove(mask)

    # -- persistence (base passes) ------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        np.savez(
            path,
            keys=self.keys,
            unseen=(self.seq - self.last_seen).astype(np.int32),
            admitted=self.admitted,
            shows=self.shows,
        )

    # -- replay from pass folders (resume, and the trainers that only mask) ---------------------------
    @classmethod
    def from_chain(cls, pass_dir: str | os.PathLike) -> KeyState:
        """The state right after pass ``pass_dir``: its base, then every delta after it."""
        chain = pass_chain(pass_dir)
        state = cls.from_base(chain[0])
        for info in chain[1:]:
            state.apply_pass(info)
        return state

    @classmethod
    def from_base(cls, info: PassInfo) -> KeyState:
        saved = info.path / KEY_STATE_FILE
        if saved.exists():
            try:
                with np.load(saved) as z:
                    keys, unseen, admitted, shows = z["keys"], z["unseen"], z["admitted"], z["shows"]
            except (OSError, KeyError, ValueError) as e:
                raise DataError(f"{saved}: cannot read the key state: {e}") from e
            return cls(keys, -unseen.astype(np.int32), admitted, shows, seq=0)
        # A base written without incremental export: every key seen at the base, admitted if in sparse/.
        (admitted_keys, admitted_shows), (pending_keys, pending_shows) = (
            _rows_of(info, SPARSE_DIR),
            _rows_of(info, PENDING_DIR),
        )
        keys = np.concatenate([admitted_keys, pending_keys])
        admitted = np.concatenate([np.ones(len(admitted_keys), bool), np.zeros(len(pending_keys), bool)])
        order = np.argsort(keys, kind="stable")
        shows = np.concatenate([admitted_shows, pending_shows])[order]
        return cls(keys[order], np.zeros(len(keys), np.int32), admitted[order], shows, seq=0)

    def apply_pass(self, info: PassInfo) -> PassKeys:
        """Fold in a pass trainer 0 wrote after the current state: a delta's pushed keys, admissions and
        deletes (a base replaces the state)."""
        if info.kind == "base":
            fresh = KeyState.from_base(info)
            self.keys, self.last_seen, self.admitted = fresh.keys, fresh.last_seen, fresh.admitted
            self.shows, self.seq = fresh.shows, 0
            return PassKeys()
        deleted = np.concatenate(
            [*iter_deleted_keys(info.path), *iter_deleted_keys(info.path / PENDING_DIR), np.zeros(0, np.uint64)]
        )
        (admitted_keys, admitted_shows), (pending_keys, pending_shows) = (
            _rows_of(info, SPARSE_DIR),
            _rows_of(info, PENDING_DIR),
        )
        pushed = np.concatenate([admitted_keys, pending_keys])
        admit = np.concatenate([np.ones(len(admitted_keys), bool), np.zeros(len(pending_keys), bool)])
        self.remove_keys(deleted)  # trainer 0 evicts after the pushes; evicted keys were not pushed
        _, stats = self.observe(pushed, admit, np.concatenate([admitted_shows, pending_shows]))
        stats.evicted = len(deleted)
        return stats


def _rows_of(info: PassInfo, sub: str) -> tuple[np.ndarray, np.ndarray]:
    """(keys, shows) of a pass's sparse/ or pending/ table, shard order."""
    lines = PartLines.concat([read_part_lines(p) for _, p in sorted(table_parts(info.path / sub).items())])
    return lines.keys, lines.shows()
