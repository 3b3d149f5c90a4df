"""Feature admission (``ADMIT_MIN_COUNT=N``): a feasign's embedding counts only once it was seen N times.

The training program multiplies every looked-up embedding by a 0/1 mask fed beside the batch's ids (one
value per id), so a key that is not admitted contributes zeros to its slot's sum and gets a zero
gradient: its embedding stays as the pserver created it, while the pserver still counts its pushes
(``show``), which is what admits it.

- For the pass's table, admission is decided by trainer 0 at each export from those counts
  (``KeyState``): a key pushed N times by then is admitted and in the pass's ``sparse/`` (cube serves it);
  before that it is only in ``pending/``, which cube never reads, so serving answers zeros for it. Trainer
  0 scores golden.jsonl with exactly that admitted set (``AdmissionMask``), so serving reproduces it.
- While training, a trainer also admits a key as soon as its own count says it reached N
  (``TrainingAdmission``: the count saved at the last export, plus the occurrences this trainer fed since).
  That count is a lower bound of what the pservers count, so a key a trainer starts training is always
  admitted at the next export: new features are used within the pass, not one pass late.

Paddle's own ``CountFilterEntry`` does nothing for the 2.6.2 ``MemorySparseTable`` (see delta_export).
"""

from __future__ import annotations

import numpy as np

from elastic_control.training.key_state import KeyState

MASK_INPUT = "key_admitted"  # per looked-up key (model.KEYS_INPUT's order): 1 admitted, 0 not


def embedding_hook(paddle):
    """For model.build_training_net: ``hook(rows) -> rows * mask`` with the mask as a new input."""

    def hook(rows):
        return rows * paddle.static.data(name=MASK_INPUT, shape=[-1, 1], dtype="float32")

    return hook


class AdmissionMask:
    """The masks of a batch, from the admitted keys of a KeyState (what the pass's table says)."""

    def __init__(self, state: KeyState, min_count: int):
        self.state, self.min_count = state, min_count

    def admitted(self, keys: np.ndarray) -> np.ndarray:
        return self.state.is_admitted(keys)

    def values(self, keys: np.ndarray) -> np.ndarray:
        """float32 [k, 1]: 1 for admitted keys, 0 for the others (unknown keys included)."""
        return self.admitted(keys).astype(np.float32).reshape(-1, 1)


class TrainingAdmission(AdmissionMask):
    """The masks of the batches a trainer trains on: admitted keys, and keys this trainer has seen reach
    ``min_count`` since the last export. ``values`` counts the keys it is given (in training order)."""

    def __init__(self, state: KeyState, min_count: int):
        super().__init__(state, min_count)
        self.seen: dict[int, int] = {}  # occurrences fed since the last export, keys not admitted then

    def start_pass(self) -> None:
        self.seen = {}

    def admitted(self, keys: np.ndarray) -> np.ndarray:
        keys = np.asarray(keys, np.uint64)
        out = self.state.is_admitted(keys)
        rest = np.flatnonzero(~out)
        if len(rest) == 0:
            return out
        uniq, inverse, counts = np.unique(keys[rest], return_inverse=True, return_counts=True)
        mine = np.array([self.seen.get(k, 0) for k in uniq.tolist()], np.float64)
        before = self.state.shows_of(uniq) + mine  # counted before this batch
        out[rest] = (before >= self.min_count)[inverse]
        for k, c in zip(uniq.tolist(), counts.tolist(), strict=True):
            self.seen[k] = self.seen.get(k, 0) + c
        return out
