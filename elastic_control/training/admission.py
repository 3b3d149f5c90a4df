"""Feature admission (``ADMIT_MIN_COUNT=N``): a feasign's embedding counts only once it was seen N times.

The training program multiplies every looked-up embedding by a 0/1 mask fed beside the slot's ids (one
value per id, same LoD), so a key that is not admitted contributes zeros to its slot's sum and gets a zero
gradient: its embedding stays as the pserver created it, while the pserver still counts its pushes
(``show``), which is what admits it. Admission is decided by trainer 0 at the end of each pass from those
counts (``KeyState``): a key pushed N times by the end of pass p is admitted for pass p+1 and is in pass
p's ``sparse/`` (so cube serves it); before that it is only in ``pending/``, which cube never reads, so
serving answers zeros for it, as training did. Every trainer masks with the same admitted set (rebuilt
from the pass folders), and trainer 0 scores golden.jsonl with it.

Paddle's own ``CountFilterEntry`` does nothing for the 2.6.2 ``MemorySparseTable`` (see delta_export).
"""

from __future__ import annotations

import numpy as np

from elastic_control.training.key_state import KeyState


def mask_input_name(slot: int) -> str:
    return f"slot_{slot}_admitted"


def embedding_hook(paddle):
    """For model.build_training_net: ``hook(slot, emb) -> emb * mask`` with the mask as a new LoD input."""

    def hook(slot: int, emb):
        mask = paddle.static.data(name=mask_input_name(slot), shape=[-1, 1], dtype="float32", lod_level=1)
        return emb * mask

    return hook


class AdmissionMask:
    """The masks of a batch, from the admitted keys of a KeyState."""

    def __init__(self, state: KeyState):
        self.state = state

    def values(self, keys: np.ndarray) -> np.ndarray:
        """float32 [k, 1]: 1 for admitted keys, 0 for the others (unknown keys included)."""
        return self.state.is_admitted(keys).astype(np.float32).reshape(-1, 1)
