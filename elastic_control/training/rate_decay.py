"""The ``decay`` sparse rule's trainer side: each key's rate factor from how often it has been seen.

The pservers apply plain SGD to the parts of a row that use the rule; the training net multiplies a
key's gradient by the factor fed here (model.decayed_rows), so a key's step is

    rate * gradient / sqrt(1 + sightings / decay_sightings)

where ``sightings`` estimates the key's occurrences trained so far by all trainers: this trainer's
own (earlier epochs and passes, plus the share of the current epoch already fed, assuming a key's
occurrences are spread evenly over the shuffled epoch) times the number of trainers, each of which
reads an equal share of every pass. Frequent keys settle instead of jittering around their optimum
at a constant step (which kept the gap to Bayes-optimal on synthetic data wide), rare keys keep the full rate.

The counts live in the trainer's memory: a restarted trainer starts them again from zero, so for
one pass after a restart its keys learn at their first, larger rates (the model itself is resumed
whole). Memory: 16 bytes per distinct key this trainer has seen.
"""

from __future__ import annotations

import numpy as np

from elastic_control.training.pass_stream import KeyCounts


class RateDecay:
    def __init__(self, decay_sightings: float, trainers: int):
        if decay_sightings <= 0:
            raise ValueError(f"decay_sightings must be positive, got {decay_sightings}")
        self.decay_sightings = float(decay_sightings)
        self.trainers = max(int(trainers), 1)
        self.seen = KeyCounts()  # occurrences this trainer trained in finished epochs
        self._epoch = KeyCounts()  # the current pass's occurrences in this trainer's share (one epoch)
        # ``seen``'s count of each of the pass's keys, in ``_epoch.keys``' order: looked up once a pass,
        # so a batch searches only the pass's keys (one search, shared with the other per-key inputs:
        # KeyCounts.index), not every key the trainer has ever seen, which grows all job long.
        self._seen_of_pass = np.zeros(0, np.int64)
        self._epoch_lines = 1
        self._fed_lines = 0

    def start_epoch(self, pass_counts: KeyCounts, share_lines: int) -> None:
        """An epoch over this trainer's share begins: ``pass_counts`` are its keys' occurrences in it."""
        if pass_counts is not self._epoch or len(self._seen_of_pass) != len(pass_counts):
            # A new pass. A later epoch of the same one keeps end_epoch's update, which is this lookup's value.
            self._seen_of_pass = self.seen.lookup(pass_counts.distinct) if len(pass_counts) else np.zeros(0, np.int64)
        self._epoch = pass_counts
        self._epoch_lines = max(int(share_lines), 1)
        self._fed_lines = 0

    def fed(self, lines: int) -> None:
        """A batch of ``lines`` lines of the epoch was fed."""
        self._fed_lines += lines

    def end_epoch(self) -> None:
        self.seen.absorb(self._epoch)
        if len(self._seen_of_pass) == len(self._epoch.counts):
            self._seen_of_pass = self._seen_of_pass + self._epoch.counts  # what seen.lookup would give now
        self._fed_lines = 0

    def factors(self, keys: np.ndarray) -> np.ndarray:
        """float32 rate factor of each key occurrence in a batch."""
        progress = min(self._fed_lines / self._epoch_lines, 1.0)
        idx, hit = self._epoch.index(keys)
        if len(self._epoch.keys):
            own = np.where(hit, self._seen_of_pass[idx] + progress * self._epoch.counts[idx], 0.0)
        else:
            own = np.zeros(len(idx))
        if not hit.all():  # a key outside the pass's counts (not in training batches): its earlier sightings
            miss = ~hit
            own[miss] = self.seen.lookup(np.asarray(keys, dtype=np.uint64)[miss])
        return (1.0 / np.sqrt(1.0 + own * (self.trainers / self.decay_sightings))).astype(np.float32)
