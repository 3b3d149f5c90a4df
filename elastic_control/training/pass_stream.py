"""One trainer's lines of a pass, epoch after epoch: held-out lines kept apart, optional shuffling.

A pass reads its share more than once (the key count before the first epoch, then every epoch), so
``ParsedShare`` parses the files once and replays the parsed chunks while they fit in memory.

Trainer 0 holds out every ``stride``-th line of its share until it has
``need`` lines: they are never trained on, in any epoch, and score the pass
(held-out AUC and log loss, the early stop, golden.jsonl). Reading is in file
order, so the same positions are held out again in later epochs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from elastic_control.data.line_batch import LineBatch, concat_batches, permute_rows, take_rows

# A trainer's parsed share of one pass is kept for the pass's later reads up to this size: 170k
# Criteo-like lines (39 features each), far above an hour's share at the benchmarks' sizes, and small
# beside a trainer pod's memory. A larger share is read (and parsed) again for each use instead.
SHARE_CACHE_BYTES = 256 * 2**20


def batch_bytes(batch: LineBatch) -> int:
    """About what ``batch`` holds in memory: its columns, plus its raw lines when read from text."""
    arrays = (batch.shows, batch.clicks, batch.feature_line, batch.feasigns, batch.feature_slots)
    size = sum(a.nbytes for a in arrays)
    if batch.lines is not None:  # estimated, not summed: about 20 characters a feature, 60 bytes a str
        size += 20 * len(batch.feasigns) + 60 * len(batch.lines)
    return size


class ParsedShare:
    """A trainer's share of one pass: ``read(first)`` parses it, and the first complete read is replayed
    to every later one when it fits in ``budget`` bytes.

    ``read`` gets ``first=True`` only for the first read, the one that counts (and checks) bad lines.
    A read that stops early, or a share over the budget, keeps nothing: the next read parses again.
    """

    def __init__(self, read: Callable[[bool], Iterable[LineBatch]], budget: int = SHARE_CACHE_BYTES):
        self._read, self._budget = read, budget
        self._chunks: list[LineBatch] | None = None
        self.reads = 0  # reads of the files (the replays not counted)

    def __iter__(self) -> Iterator[LineBatch]:
        if self._chunks is not None:
            yield from self._chunks
            return
        first = self.reads == 0
        self.reads += 1
        kept: list[LineBatch] | None = []
        size = 0
        for chunk in self._read(first):
            if kept is not None:
                size += batch_bytes(chunk)
                if size <= self._budget:
                    kept.append(chunk)
                else:
                    kept = None  # over the budget: later reads parse the files again
            yield chunk
        self._chunks = kept


@dataclass
class Holdout:
    need: int
    stride: int
    lines: list[LineBatch] = field(default_factory=list)
    end: int | None = None  # once the first epoch is over: position after the last held-out line

    @property
    def count(self) -> int:
        return sum(len(b) for b in self.lines)

    def batch(self) -> LineBatch:
        return concat_batches(self.lines) if self.lines else LineBatch.empty()


def without_holdout(chunks: Iterable[LineBatch], holdout: Holdout, *, first_epoch: bool) -> Iterator[LineBatch]:
    """The chunks minus the held-out lines; the first epoch also collects them into ``holdout.lines``."""
    seen = 0
    remaining = holdout.need if first_epoch else 0
    last = -1
    for chunk in chunks:
        idx = np.arange(seen, seen + len(chunk))
        on_stride = idx % holdout.stride == holdout.stride - 1 if holdout.stride > 0 else np.zeros(len(chunk), bool)
        if first_epoch:
            held = np.flatnonzero(on_stride)[:remaining]
            remaining -= len(held)
            if len(held):
                holdout.lines.append(take_rows(chunk, held))
                last = int(idx[held[-1]])
        else:
            held = np.flatnonzero(on_stride & (idx < (holdout.end or 0)))
        seen += len(chunk)
        if len(held):
            chunk = take_rows(chunk, np.setdiff1d(np.arange(len(chunk)), held, assume_unique=True))
        if len(chunk):
            yield chunk
    if first_epoch:
        holdout.end = last + 1


def shuffled(chunks: Iterable[LineBatch], window: int, rng: np.random.Generator) -> Iterator[LineBatch]:
    """Lines shuffled within consecutive windows of about ``window`` lines (0: unchanged)."""
    if window <= 0:
        yield from chunks
        return
    pending: list[LineBatch] = []
    have = 0
    for chunk in chunks:
        pending.append(chunk)
        have += len(chunk)
        if have >= window:
            merged = concat_batches(pending)
            yield permute_rows(merged, rng.permutation(len(merged)))
            pending, have = [], 0
    if have:
        merged = concat_batches(pending)
        yield permute_rows(merged, rng.permutation(len(merged)))


def planned_epochs(
    setting: int | str, first_epoch_steps: int, *, min_steps: int, max_epochs: int, first_pass_steps: int | None = None
) -> int:
    """Epochs of a pass: the setting, or with ``auto`` the whole number of epochs nearest ``min_steps``
    steps, and at least ``first_pass_steps`` steps when given (the first pass of a fresh model); 1 to
    ``max_epochs``.

    Nearest, not "at least": a pass a little short of the target (93 steps of 100) trains one epoch, not
    two. Measured on synthetic hours of 93 steps per trainer: with two epochs the second was worse on the
    held-out lines in every pass and the early stop put the first back, so one epoch exports the same
    model in half the time (gap to Bayes-optimal 0.0078-0.0080 against 0.0077). Passes of a few steps
    still get their many epochs (19 steps: 5). The first pass keeps "at least": its 800 steps were tuned
    as a floor.
    """
    if setting != "auto":
        return int(setting)
    if first_epoch_steps <= 0:
        return 1
    epochs = math.floor(min_steps / first_epoch_steps + 0.5)
    if first_pass_steps:
        epochs = max(epochs, math.ceil(first_pass_steps / first_epoch_steps))
    return max(1, min(max_epochs, epochs))


def unjudged_pass(setting: int | str, early_stop: bool, holdout_lines: int, min_holdout: int) -> bool:
    """EPOCHS=auto with the early stop on a pass of fewer than ``min_holdout`` held-out lines: the pass
    trains a fixed few epochs (``unjudged_pass_epochs``, at most its plan) and its held-out lines judge
    none of them.

    Why: the early stop's plan is many epochs (a fresh model's 800 steps) for the stop to cut, and on a
    small pass the cut is noise. The eight small real logs measured (CHANGELOG.md, "Small passes
    are not judged by their held-out lines") hold out 50-250 lines a pass; there the held-out loss picked
    epoch 1 or 2 while the next hour's AUC rose to epoch 3-5 and stayed (the 2,000-line log: 0.6933 at 1
    epoch, 0.6986-0.7004 at 2-5, 0.6466 at the plan's 20): the stop exported 0.6904, and the two-pass
    100,000 log 0.7213 against 0.7300 with 3 epochs a pass. An explicit EPOCHS keeps the early stop:
    the user chose the epochs for it to cut.
    """
    return setting == "auto" and early_stop and holdout_lines < min_holdout


# The smallest batch the small-pass rule below cuts (``pass_batch_size``): smaller batches gained
# nothing more on the small real logs measured, and every step costs a round trip to the pservers.
MIN_PASS_BATCH = 16


def pass_batch_size(share_lines: int, batch_size: int, min_batches: int) -> int:
    """The batch of a pass: ``batch_size``, or, when a trainer's share of the pass has fewer than
    ``min_batches`` batches of it, ``share_lines // min_batches`` lines, down to MIN_PASS_BATCH (0: off).
    The trainer applies it to the first pass of a fresh model only.

    Why: on a first pass of a few thousand lines, batches of 128 give each trainer 15-40 steps an epoch,
    and the early stop ends the pass after 3-6 epochs (the dense tower memorises its lines epoch by
    epoch, however many steps an epoch has), before the model has moved far from its initialisation.
    Smaller batches there gained 0.002-0.008 AUC on six of eight small real logs. Not in later passes:
    on the two-pass logs small batches in the second pass too were no better on average and lost
    0.002-0.005 on one; and not on larger hours: on the Criteo split's (16,600 lines a trainer) every
    batch under 128 lost (64: -0.001, 32: -0.002, 16: -0.003). CHANGELOG.md, "Small first passes,
    smaller batches".
    """
    if min_batches <= 0 or share_lines >= batch_size * min_batches:
        return batch_size
    return max(min(batch_size, MIN_PASS_BATCH), share_lines // min_batches)


class KeyCounts:
    """How often each key occurs in a stream of key arrays (sorted unique keys + counts, merged in blocks)."""

    def __init__(self, block: int = 4_000_000):
        self.keys = np.zeros(0, np.uint64)
        self.counts = np.zeros(0, np.int64)
        self._pending: list[np.ndarray] = []
        self._pending_size = 0
        self._block = block
        # The last ``index`` call's (keys, positions, found) for a read-only key array: the per-key inputs
        # of one batch (L2 scale, rate factors, the wide prior's anchors and weights) all look up the same
        # distinct keys (feeding.feed_keys makes them read-only) in the pass's counts, so they share one
        # search. Read-only, so the array cannot have changed since; one tuple, replaced whole, so a
        # reader in another thread sees an old or a new entry, never half of each; dropped when the
        # counted keys change.
        self._last: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def add(self, keys: np.ndarray) -> None:
        self._pending.append(np.asarray(keys, dtype=np.uint64))
        self._pending_size += len(keys)
        if self._pending_size >= self._block:
            self._merge()

    def _merge(self) -> None:
        if not self._pending:
            return
        new_keys, new_counts = np.unique(np.concatenate(self._pending), return_counts=True)
        self._pending, self._pending_size = [], 0
        keys = np.concatenate([self.keys, new_keys])
        counts = np.concatenate([self.counts, new_counts])
        self.keys, inverse = np.unique(keys, return_inverse=True)
        self.counts = np.bincount(inverse, weights=counts, minlength=len(self.keys)).astype(np.int64)
        self._last = None

    def __len__(self) -> int:
        self._merge()
        return len(self.keys)

    @property
    def distinct(self) -> np.ndarray:
        """The counted keys, sorted and complete (pending blocks merged): ``counts``' order."""
        self._merge()
        return self.keys

    def index(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(position in ``self.keys``, whether counted) of each key; positions of keys not counted are
        valid but meaningless. The same array object asked again is not searched again."""
        self._merge()
        last = self._last
        if last is not None and last[0] is keys:
            return last[1], last[2]
        array = np.asarray(keys, dtype=np.uint64)
        if not len(self.keys):
            idx, hit = np.zeros(len(array), np.intp), np.zeros(len(array), bool)
        else:
            idx = np.minimum(np.searchsorted(self.keys, array), len(self.keys) - 1)
            hit = self.keys[idx] == array
        if isinstance(keys, np.ndarray) and not keys.flags.writeable:
            self._last = (keys, idx, hit)
        return idx, hit

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """int64 count of each key (0 for a key never counted)."""
        idx, hit = self.index(keys)
        if not len(self.keys):
            return np.zeros(len(idx), np.int64)
        return np.where(hit, self.counts[idx], 0)

    def inverse(self, keys: np.ndarray) -> np.ndarray:
        """float32 1 / count of each key (1 for a key never counted)."""
        return (1.0 / np.maximum(self.lookup(keys), 1)).astype(np.float32)

    def absorb(self, other: KeyCounts) -> None:
        """Add another count's keys and counts to this one."""
        self._merge()
        other._merge()
        keys = np.concatenate([self.keys, other.keys])
        counts = np.concatenate([self.counts, other.counts])
        self.keys, inverse = np.unique(keys, return_inverse=True)
        self.counts = np.bincount(inverse, weights=counts, minlength=len(self.keys)).astype(np.int64)
        self._last = None
