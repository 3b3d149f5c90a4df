"""The wide prior: hourly passes that remember what earlier passes learned about a key's wide weight.

With the count-scaled L2 alone, every pass pulls each of its keys' wide weights toward 0 as if the
pass were all the data there is, and its epochs refit the weights to the pass's own lines: two
passes of 5,000 real lines then score like logistic regression on the second hour alone (0.72
against 0.73 for both hours pooled, CHANGELOG.md, "Six more small real logs, and the wide prior").
Logistic regression over all hours is the same as the last hour's loss plus the earlier hours' loss,
and that earlier loss, near its minimum, is a quadratic around the weights they left: per key about
``p (1 - p) / 2 * occurrences`` times ``(w - w_before)^2`` (a Laplace approximation, diagonal).

So in a pass a key seen before is pulled toward its weight at the pass start, not toward 0, with
the strength ``l2_wide + wide_prior * earlier_occurrences`` (``wide_prior`` about 0.1, i.e.
``p (1 - p) / 2`` at a CTR of 0.25); a key new to the model keeps ``l2_wide`` toward 0 (the
feeds: ``anchors``, ``weights``; the term: model._l2_of_rows). Each trainer counts its own share
(the trainers' terms add up over the pass the way their data terms do), once per pass whatever
its epochs, and reads the weights at the pass start from the servers (``start_pass``).

The counts live in the trainer's memory: a restarted trainer starts them again from zero, so its
first pass after a restart pulls toward 0 like a fresh model (the model itself is resumed whole).
Memory: 16 bytes per distinct key this trainer has seen, plus 8 per key of the current pass.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from elastic_control.training.pass_stream import KeyCounts


class WidePrior:
    def __init__(self, strength: float, l2_wide: float):
        if strength <= 0 or l2_wide <= 0:
            raise ValueError(f"the wide prior needs positive strength and l2_wide, got {strength} and {l2_wide}")
        self.strength = float(strength)
        self.l2_wide = float(l2_wide)
        self.seen = KeyCounts()  # this trainer's occurrences in its shares of the finished passes
        # The current pass's counts, and per key of it (in their order) the anchor and the pull's weight:
        # a batch's keys are found by the same search as their L2 scale and rate factors (KeyCounts.index).
        self._pass = KeyCounts()
        self._anchors = np.zeros(0, np.float32)
        self._weights = np.zeros(0, np.float32)
        self._known = 0  # the pass's keys seen before

    def start_pass(self, pass_counts: KeyCounts, wide_weights: Callable[[np.ndarray], np.ndarray]) -> int:
        """A pass begins whose share has ``pass_counts``; ``wide_weights(keys)`` reads the keys' embed_w
        from the servers. Returns how many of the pass's keys were seen before."""
        keys = pass_counts.distinct
        earlier = self.seen.lookup(keys)
        known = earlier > 0
        self._pass, self._known = pass_counts, int(known.sum())
        self._anchors = np.zeros(len(keys), np.float32)
        if self._known:
            self._anchors[known] = np.asarray(wide_weights(keys[known]), dtype=np.float32)
        self._weights = np.where(known, self.l2_wide + self.strength * earlier, self.l2_wide).astype(np.float32)
        return self._known

    def end_pass(self, pass_counts: KeyCounts) -> None:
        self.seen.absorb(pass_counts)
        self._pass, self._known = KeyCounts(), 0
        self._anchors, self._weights = self._anchors[:0], self._weights[:0]

    def anchors(self, keys: np.ndarray) -> np.ndarray:
        """float32 per key occurrence: the weight its L2 pulls toward (0 for a key new to the model)."""
        if not self._known:
            return np.zeros(len(keys), np.float32)
        idx, hit = self._pass.index(keys)
        return np.where(hit, self._anchors[idx], 0).astype(np.float32)

    def weights(self, keys: np.ndarray) -> np.ndarray:
        """float32 per key occurrence: the pull's strength (l2_wide for a key new to the model)."""
        if not self._known:
            return np.full(len(keys), self.l2_wide, np.float32)
        idx, hit = self._pass.index(keys)
        return np.where(hit, self._weights[idx], self.l2_wide).astype(np.float32)
