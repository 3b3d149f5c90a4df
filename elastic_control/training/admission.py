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
from elastic_control.training.pass_stream import KeyCounts

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
    ``min_count`` since the last export. ``values`` counts the keys it is given (in training order).

    The occurrences fed since the export are an array aligned with the pass's distinct keys (the
    trainer's KeyCounts of its share, known before the first step), so a batch costs a search of its
    distinct keys and no Python loop over them (a dict of counts took a get and a set per key)."""

    def __init__(self, state: KeyState, min_count: int):
        super().__init__(state, min_count)
        self._pass: KeyCounts | None = None
        self._fed = np.zeros(0, np.int64)

    def start_pass(self, pass_counts: KeyCounts) -> None:
        """``pass_counts``: this trainer's key counts of its share of the pass; every key fed in the pass
        is one of them. The occurrences fed restart at 0 (the pass starts after an export)."""
        self._pass = pass_counts
        self._fed = np.zeros(len(pass_counts), np.int64)

    def admitted(self, keys: np.ndarray) -> np.ndarray:
        # One search of the batch's distinct keys in the state and one in the pass's counts.
        uniq, inverse, counts = np.unique(np.asarray(keys, np.uint64), return_inverse=True, return_counts=True)
        out, shows = self.state.admitted_and_shows(uniq)
        rest = np.flatnonzero(~out)
        if len(rest) == 0:
            return out[inverse]
        pending = uniq[rest]
        if self._pass is None:
            raise ValueError("training admission fed before start_pass")
        pos, hit = self._pass.index(pending)
        if not hit.all():
            raise ValueError(f"key {int(pending[~hit][0])} fed but not among the pass's keys (start_pass)")
        out[rest] = shows[rest] + self._fed[pos] >= self.min_count  # counted before this batch
        self._fed[pos] += counts[rest]  # distinct keys: no repeated positions
        return out[inverse]
