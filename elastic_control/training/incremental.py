"""What a trainer keeps between passes when deltas, admission or eviction are on (the trainer's hooks).

Trainer 0 owns the key state and writes the passes (``delta_export.IncrementalExport``); the other
trainers need it only for admission masks and replay it from each pass folder trainer 0 wrote, after the
export barrier. After a restart every trainer replays the chain of the last complete pass.
"""

from __future__ import annotations

from pathlib import Path

from ctr_foundation.pass_format import PassInfo, load_pass
from elastic_control.config.data_config import DataConfig
from elastic_control.training.admission import AdmissionMask, TrainingAdmission, embedding_hook
from elastic_control.training.delta_export import IncrementalExport, PassPlan, accessor_overrides, plan_next
from elastic_control.training.key_state import KeyState


class Incremental:
    def __init__(self, config: DataConfig, *, is_chief: bool, log=print):
        self.config, self.is_chief, self.log = config, is_chief, log
        self.state = KeyState()
        self.last: PassInfo | None = None
        n = config.admit_min_count
        # Golden scoring uses the admitted keys of the pass's table; training also admits within the pass.
        self.mask = AdmissionMask(self.state, n) if n else None
        self.train_mask = TrainingAdmission(self.state, n) if n else None

    @classmethod
    def for_role(cls, config: DataConfig, *, is_chief: bool, log=print) -> Incremental | None:
        """None when incremental exports are off (then nothing changes: full passes as before)."""
        return cls(config, is_chief=is_chief, log=log) if config.incremental else None

    @property
    def tracks_keys(self) -> bool:
        """Trainer 0 always; the others only to mask (admission)."""
        return self.is_chief or self.mask is not None

    def accessor(self) -> dict:
        return accessor_overrides(self.config)

    def embedding_hook(self, paddle):
        return embedding_hook(paddle) if self.mask is not None else None

    def _set_state(self, state: KeyState) -> None:
        self.state = state
        for mask in (self.mask, self.train_mask):
            if mask is not None:
                mask.state = state

    @property
    def needs_pass_keys(self) -> bool:
        """Training admission counts what it feeds against the pass's key counts (start_pass)."""
        return self.train_mask is not None

    def start_pass(self, pass_counts=None) -> None:
        """``pass_counts``: this trainer's KeyCounts of its share (needed with admission)."""
        if self.train_mask is not None:
            if pass_counts is None:
                raise ValueError("training admission needs the pass's key counts")
            self.train_mask.start_pass(pass_counts)

    def resume(self, last_pass_dir: str | Path) -> None:
        """Rebuild the key state after the last complete pass (its chain down to its base)."""
        self.last = load_pass(last_pass_dir)
        if self.tracks_keys:
            self._set_state(KeyState.from_chain(last_pass_dir))
            self.log(
                f"key state after {self.last.name}: " + ", ".join(f"{k} {v}" for k, v in self.state.counts().items())
            )

    # -- trainer 0 ---------------------------------------------------------------------------------
    def plan(self) -> PassPlan:
        return plan_next(self.last, self.config)

    def export(self, worker, table_id: int, shards: int, stage: Path, plan: PassPlan) -> dict:
        return IncrementalExport(self.config, worker, table_id, shards, self.state, self.log).export(stage, plan)

    def exported(self, pass_dir: str | Path) -> None:
        self.last = load_pass(pass_dir)

    # -- the other trainers --------------------------------------------------------------------------
    def follow(self, pass_dir: str | Path) -> None:
        """Fold in the pass trainer 0 just published (non-chief trainers)."""
        info = load_pass(pass_dir)
        if self.tracks_keys:
            if info.kind == "delta" and (self.last is None or info.parent != self.last.name):
                # Should not happen (a pass always applies on the previous one): replay its whole chain.
                self._set_state(KeyState.from_chain(info.path))
            else:
                self.state.apply_pass(info)
        self.last = info
