"""The project's one implementation of binary-classification metrics: AUC, log loss, calibration, reliability.

Exact and mergeable; used by offline evaluation, the promotion gate and shadow
reports (tables merged across workers), by the trainer (held-out AUC of each
pass and the progressive-validation window, ``RecentWindow``), by the
synthetic generator (Bayes-optimal AUC) and by the demo. ``auc`` and
``log_loss`` are the one-call forms for arrays in memory.

The aggregate is a table of distinct scores with their positive and negative
counts (``ScoreCounts``). Scores are click probabilities in [0, 1]; the bit
pattern of a non-negative float32 is monotone in its value, so the table is
keyed by ``score.view(uint32)``. Merging two tables (two workers, two files)
is a sorted union that adds counts, so metrics derived from a merged table are
*identical* (bit for bit) to the single-process ones, however the data was
split: they are computed from the same table in the same order.

Memory is bounded by the number of distinct float32 scores, not by the number
of examples. If a table grows past ``max_distinct`` entries it is coarsened by
dropping low mantissa bits (each bin then holds the scores sharing the kept
bits) and AUC becomes approximate with a stated bound: a positive/negative pair
inside one bin is counted as a tie (1/2) where the exact AUC counts 0, 1/2 or
1, so ``|AUC - exact| <= 0.5 * sum_b pos_b * neg_b / (P * N)``, which is
computed and reported (``auc_error_bound``). Log loss, calibration and the
reliability table then come from float64 running sums (exact up to rounding).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ctr_foundation.errors import DataError

FLOAT32_MANTISSA_BITS = 23
DEFAULT_MAX_DISTINCT = 32_000_000  # about 640 MB per table (uint32 key + two int64 counts)
RELIABILITY_BINS = 10
# Examples buffered before they are counted into the table (5 bytes each: a uint32 key and a label). Each
# flush sorts the buffer and merges it into the table, and the merge costs about as much as the sort:
# a buffer the size of a typical share (10M examples in one flush rather than three) counts 10M examples
# in about two thirds of the time.
DEFAULT_BUFFER_EXAMPLES = 16_000_000


def score_keys(scores: np.ndarray) -> np.ndarray:
    """uint32 keys ordered like the float32 scores; raises DataError outside [0, 1] or NaN."""
    s = np.asarray(scores, dtype=np.float32)
    if s.size and not (np.all(s >= 0) and np.all(s <= 1)):  # NaN fails both comparisons
        bad = s[~((s >= 0) & (s <= 1))][:3]
        raise DataError(f"scores must be probabilities in [0, 1]; got {bad.tolist()}")
    return (s + np.float32(0)).view(np.uint32)  # -0.0 + 0.0 is +0.0, whose key is 0


def keys_to_scores(keys: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(keys, dtype=np.uint32).view(np.float32)


def clip_probability(p: np.ndarray) -> np.ndarray:
    """The clipping scikit-learn's log_loss applies to float32 predictions."""
    eps = np.finfo(np.float32).eps
    return np.clip(np.asarray(p, dtype=np.float64), eps, 1 - eps)


def _logloss_terms(p64: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    p = clip_probability(p64)
    return -np.log(p), -np.log1p(-p)


@dataclass
class ScoreCounts:
    """Distinct score keys (sorted) with positive and negative counts, plus running sums.

    ``shift`` is the number of low mantissa bits dropped from the keys (0 = exact).
    """

    keys: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint32))
    pos: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    neg: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    shift: int = 0
    # float64 sums, kept only once the table is coarsened (shift > 0): an exact table's sums follow from
    # its keys (``exact_sums``), and summarize computes its metrics from the keys.
    sum_pred: float = 0.0
    sum_logloss: float = 0.0
    rel_count: np.ndarray = field(default_factory=lambda: np.zeros(RELIABILITY_BINS, np.int64))
    rel_pos: np.ndarray = field(default_factory=lambda: np.zeros(RELIABILITY_BINS, np.int64))
    rel_sum_pred: np.ndarray = field(default_factory=lambda: np.zeros(RELIABILITY_BINS, np.float64))

    @property
    def n(self) -> int:
        return int(self.pos.sum() + self.neg.sum())

    @property
    def positives(self) -> int:
        return int(self.pos.sum())

    @property
    def exact(self) -> bool:
        return self.shift == 0

    def to_arrays(self) -> dict[str, np.ndarray]:
        """Plain arrays for np.savez (the partial-file format)."""
        return {
            "keys": self.keys,
            "pos": self.pos,
            "neg": self.neg,
            "shift": np.array(self.shift),
            "sums": np.array([self.sum_pred, self.sum_logloss]),
            "rel_count": self.rel_count,
            "rel_pos": self.rel_pos,
            "rel_sum_pred": self.rel_sum_pred,
        }

    @classmethod
    def from_arrays(cls, a) -> ScoreCounts:
        return cls(
            np.asarray(a["keys"], np.uint32),
            np.asarray(a["pos"], np.int64),
            np.asarray(a["neg"], np.int64),
            int(a["shift"]),
            float(a["sums"][0]),
            float(a["sums"][1]),
            np.asarray(a["rel_count"], np.int64),
            np.asarray(a["rel_pos"], np.int64),
            np.asarray(a["rel_sum_pred"], np.float64),
        )


def _reliability_bin(p64: np.ndarray) -> np.ndarray:
    return np.minimum((p64 * RELIABILITY_BINS).astype(np.int64), RELIABILITY_BINS - 1)


def _run_starts(sorted_values: np.ndarray) -> np.ndarray:
    """Where each run of equal values starts in a sorted array (non-empty)."""
    change = np.empty(len(sorted_values), bool)
    change[0] = True
    np.not_equal(sorted_values[1:], sorted_values[:-1], out=change[1:])
    return np.flatnonzero(change)


def _segment_sums(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """int64 sums of the segments of ``values`` beginning at ``starts`` (exact: integer prefix sums; a
    reduceat with millions of short segments costs several times more)."""
    total = np.empty(len(values) + 1, np.int64)
    total[0] = 0
    np.cumsum(values, out=total[1:])
    return np.diff(total[np.append(starts, len(values))])


def _unique_counts(keys: np.ndarray, pos: np.ndarray, neg: np.ndarray):
    """Sorted distinct keys with their counts added (a stable sort merges pre-sorted runs in linear time)."""
    if len(keys) == 0:
        return keys.astype(np.uint32), pos.astype(np.int64), neg.astype(np.int64)
    order = np.argsort(keys, kind="stable")
    k = keys[order]
    starts = _run_starts(k)
    return k[starts], _segment_sums(pos[order], starts), _segment_sums(neg[order], starts)


def _chunk_counts(keys: np.ndarray, labels: np.ndarray):
    """(keys, pos, neg) of one chunk: one in-place sort of key<<1|label, then run lengths.

    A score key is at most 1.0f's bits (0x3F800000, ``score_keys``), so key<<1|label fits in 32 bits, and
    sorting 32-bit values costs about two thirds of sorting 64-bit ones.
    """
    v = (keys.astype(np.uint32) << np.uint32(1)) | labels.astype(np.uint32)
    v.sort()
    starts = _run_starts(v)
    runs = np.diff(np.append(starts, len(v)))
    vals = v[starts]
    k = vals >> np.uint32(1)
    is_pos = (vals & np.uint32(1)).astype(bool)
    # A key has at most two runs, its negatives then its positives: its first run holds its negatives
    # (if any), its last run its positives (if any).
    first = _run_starts(k)
    last = np.append(first[1:], len(k)) - 1
    neg = np.where(is_pos[first], 0, runs[first]).astype(np.int64)
    pos = np.where(is_pos[last], runs[last], 0).astype(np.int64)
    return k[first], pos, neg


def _coarsen(keys: np.ndarray, shift: int) -> np.ndarray:
    mask = np.uint32((0xFFFFFFFF >> shift) << shift)
    return keys & mask


class CountsBuilder:
    """Accumulates (label, score) chunks into a ScoreCounts with bounded memory."""

    def __init__(self, max_distinct: int = DEFAULT_MAX_DISTINCT, buffer_size: int = DEFAULT_BUFFER_EXAMPLES):
        self.table = ScoreCounts()
        self.max_distinct = max_distinct
        self.buffer_size = buffer_size
        self._keys: list[np.ndarray] = []
        self._labels: list[np.ndarray] = []
        self._buffered = 0

    def add(self, labels: np.ndarray, scores: np.ndarray) -> None:
        labels = np.asarray(labels).astype(bool, copy=False)
        keys = score_keys(scores)
        if len(labels) != len(keys):
            raise ValueError("labels and scores differ in length")
        if self.table.shift:  # a coarsened table keeps running sums of the examples it bins
            _add_sums(self.table, keys, labels)
        self._keys.append(keys)
        self._labels.append(labels)
        self._buffered += len(keys)
        if self._buffered >= self.buffer_size:
            self._flush()

    def _flush(self) -> None:
        if not self._keys:
            return
        keys = np.concatenate(self._keys)
        labels = np.concatenate(self._labels)
        self._keys, self._labels, self._buffered = [], [], 0
        if self.table.shift:
            keys = _coarsen(keys, self.table.shift)
        t = self.table
        ck, cp, cn = _chunk_counts(keys, labels) if len(keys) else (keys, np.zeros(0, np.int64), np.zeros(0, np.int64))
        was_exact = t.exact
        parts = [(t.keys, t.pos, t.neg, t.shift), (ck, cp, cn, t.shift)]
        keys, pos, neg, shift = _union(parts, self.max_distinct)
        if was_exact and shift:  # coarsened now: its sums start from the exact tables it was made of
            _set_sums(t, [ScoreCounts(*p) for p in parts])
        t.keys, t.pos, t.neg, t.shift = keys, pos, neg, shift

    def result(self) -> ScoreCounts:
        self._flush()
        return self.table


def _union(parts, max_distinct: int):
    """Sorted union of (keys, pos, neg, shift) parts with counts added; coarsened only past ``max_distinct``."""
    shift = max((p[3] for p in parts), default=0)
    parts = [p for p in parts if len(p[0])] or parts[:1]
    if len(parts) == 1 and parts[0][3] == shift and len(parts[0][0]) <= max_distinct:
        return parts[0]  # already a sorted distinct table
    keys = np.concatenate([_coarsen(k, shift) if s != shift else k for k, _, _, s in parts])
    keys, pos, neg = _unique_counts(keys, np.concatenate([p[1] for p in parts]), np.concatenate([p[2] for p in parts]))
    while len(keys) > max_distinct and shift < FLOAT32_MANTISSA_BITS:
        shift += 1  # each dropped bit roughly halves the distinct count
        keys, pos, neg = _unique_counts(_coarsen(keys, shift), pos, neg)
    return keys, pos, neg, shift


def merge_counts(tables: list[ScoreCounts], max_distinct: int = DEFAULT_MAX_DISTINCT) -> ScoreCounts:
    """The exact union of several tables (counts added; sums too when the union is coarsened)."""
    out = ScoreCounts(*_union([(t.keys, t.pos, t.neg, t.shift) for t in tables], max_distinct))
    if out.shift:
        _set_sums(out, tables)
    return out


def _add_sums(t: ScoreCounts, keys: np.ndarray, labels: np.ndarray) -> None:
    """Add examples (exact score keys, bool labels) to a coarsened table's running sums."""
    p64 = keys_to_scores(keys).astype(np.float64)
    t.sum_pred += float(p64.sum())
    lp, lq = _logloss_terms(p64)
    t.sum_logloss += float(np.where(labels, lp, lq).sum())
    b = _reliability_bin(p64)
    t.rel_count += np.bincount(b, minlength=RELIABILITY_BINS)
    t.rel_pos += np.bincount(b, weights=labels, minlength=RELIABILITY_BINS).astype(np.int64)
    t.rel_sum_pred += np.bincount(b, weights=p64, minlength=RELIABILITY_BINS)


def _set_sums(out: ScoreCounts, tables: list[ScoreCounts]) -> None:
    """``out``'s sums: those of the coarsened tables, and those that follow from the exact ones' keys."""
    out.sum_pred, out.sum_logloss = 0.0, 0.0
    out.rel_count = np.zeros(RELIABILITY_BINS, np.int64)
    out.rel_pos = np.zeros(RELIABILITY_BINS, np.int64)
    out.rel_sum_pred = np.zeros(RELIABILITY_BINS, np.float64)
    for t in tables:
        sum_pred, sum_logloss, rel_count, rel_pos, rel_sum = (
            (t.sum_pred, t.sum_logloss, t.rel_count, t.rel_pos, t.rel_sum_pred) if t.shift else exact_sums(t)
        )
        out.sum_pred += sum_pred
        out.sum_logloss += sum_logloss
        out.rel_count = out.rel_count + rel_count
        out.rel_pos = out.rel_pos + rel_pos
        out.rel_sum_pred = out.rel_sum_pred + rel_sum


def exact_sums(t: ScoreCounts) -> tuple[float, float, np.ndarray, np.ndarray, np.ndarray]:
    """(sum of predictions, sum of log losses, reliability counts, positives, sums of predictions) of an
    exact table, from its keys in their fixed order: the same however the data was split."""
    p64 = keys_to_scores(t.keys).astype(np.float64)
    # Each log only where it is weighted: the other entries multiply a count of 0 (0.0 either way).
    lp, lq = np.zeros(len(p64)), np.zeros(len(p64))
    has_pos, has_neg = t.pos > 0, t.neg > 0
    p = clip_probability(p64)
    lp[has_pos] = -np.log(p[has_pos])
    lq[has_neg] = -np.log1p(-p[has_neg])
    w = (t.pos + t.neg).astype(np.float64)
    b = _reliability_bin(p64)
    return (
        float(np.dot(w, p64)),
        float(np.dot(t.pos, lp) + np.dot(t.neg, lq)),
        np.bincount(b, weights=w, minlength=RELIABILITY_BINS).astype(np.int64),
        np.bincount(b, weights=t.pos, minlength=RELIABILITY_BINS).astype(np.int64),
        np.bincount(b, weights=w * p64, minlength=RELIABILITY_BINS),
    )


def counts_from_arrays(labels: np.ndarray, scores: np.ndarray, max_distinct: int = DEFAULT_MAX_DISTINCT) -> ScoreCounts:
    b = CountsBuilder(max_distinct)
    b.add(labels, scores)
    return b.result()


def auc_from_counts(t: ScoreCounts) -> tuple[float | None, float]:
    """(ROC AUC, error bound); AUC is None when only one class is present.

    Each positive scores 1 against every negative below it and 1/2 against
    every negative with the same score (the trapezoidal rule scikit-learn uses).
    """
    P, N = t.pos.sum(), t.neg.sum()
    if P == 0 or N == 0:
        return None, 0.0
    neg_below = np.cumsum(t.neg) - t.neg
    pairs = float(P) * float(N)
    wins = float(np.sum(t.pos.astype(np.float64) * (2.0 * neg_below + t.neg))) / 2.0
    bound = 0.0 if t.exact else 0.5 * float(np.sum(t.pos.astype(np.float64) * t.neg)) / pairs
    return wins / pairs, bound


def roc_points(t: ScoreCounts, max_points: int = 2000) -> tuple[np.ndarray, np.ndarray]:
    """(false positive rate, true positive rate) from the highest threshold down, thinned for plotting."""
    P, N = max(t.pos.sum(), 1), max(t.neg.sum(), 1)
    tpr = np.concatenate([[0.0], np.cumsum(t.pos[::-1]) / P])
    fpr = np.concatenate([[0.0], np.cumsum(t.neg[::-1]) / N])
    if len(tpr) > max_points:
        idx = np.unique(np.linspace(0, len(tpr) - 1, max_points).astype(np.int64))
        tpr, fpr = tpr[idx], fpr[idx]
    return fpr, tpr


def summarize(t: ScoreCounts) -> dict:
    """All scalar metrics plus the reliability table of an aggregate."""
    n, P = t.n, t.positives
    if n == 0:
        raise DataError("no examples were scored (is the data window empty?)")
    auc, bound = auc_from_counts(t)
    if t.exact:
        # From the table in a fixed order: identical however the data was split.
        sum_pred, sum_logloss, rel_count, rel_pos, rel_sum = exact_sums(t)
        logloss = sum_logloss / n
    else:
        sum_pred, logloss = t.sum_pred, t.sum_logloss / n
        rel_count, rel_pos, rel_sum = t.rel_count, t.rel_pos, t.rel_sum_pred
    observed = P / n
    reliability = []
    for i in range(RELIABILITY_BINS):
        c = int(rel_count[i])
        reliability.append(
            {
                "bin": [i / RELIABILITY_BINS, (i + 1) / RELIABILITY_BINS],
                "count": c,
                "mean_predicted": float(rel_sum[i] / c) if c else None,
                "observed_ctr": float(rel_pos[i] / c) if c else None,
            }
        )
    return {
        "examples": n,
        "positives": P,
        "auc": auc,
        "auc_exact": t.exact,
        "auc_error_bound": bound,
        "score_bits_dropped": t.shift,
        "distinct_scores": int(len(t.keys)),
        "logloss": logloss,
        "mean_predicted_ctr": sum_pred / n,
        "observed_ctr": observed,
        "calibration": (sum_pred / n) / observed if P else None,
        "reliability": reliability,
    }


# ---- one-call forms and the trainer's running window -------------------------------------------


def auc_standard_error(auc: float, positives: int, negatives: int) -> float | None:
    """The standard error of an AUC measured on so many positives and negatives (Hanley and McNeil, 1982)."""
    if positives < 1 or negatives < 1:
        return None
    q1, q2 = auc / (2 - auc), 2 * auc * auc / (1 + auc)
    variance = auc * (1 - auc) + (positives - 1) * (q1 - auc * auc) + (negatives - 1) * (q2 - auc * auc)
    return math.sqrt(max(variance, 0.0) / (positives * negatives))


def auc(labels, scores) -> float:
    """Exact ROC AUC of in-memory arrays, ties counted 1/2 (scikit-learn's ``roc_auc_score``).

    NaN when only one class is present or a score is NaN (a diverged model must not stop a
    training run through its progress metric); DataError for scores outside [0, 1].
    """
    scores = np.asarray(scores, dtype=np.float32).ravel()
    if np.isnan(scores).any():
        return float("nan")
    value, _bound = auc_from_counts(counts_from_arrays(np.asarray(labels).ravel(), scores))
    return float("nan") if value is None else float(value)


def line_log_losses(labels, probs) -> np.ndarray:
    """Each line's log loss (float64), predictions clipped as scikit-learn clips float32 input."""
    y = np.asarray(labels, dtype=np.float64).ravel()
    lp, lq = _logloss_terms(np.asarray(probs, dtype=np.float64).ravel())
    return np.where(y > 0.5, lp, lq)


def log_loss(labels, probs) -> float:
    """Mean log loss, predictions clipped as scikit-learn clips float32 input."""
    return float(line_log_losses(labels, probs).mean())


class RecentWindow:
    """The last ``size`` (label, prob) pairs, for a running AUC that reflects the current model."""

    def __init__(self, size: int = 100_000):
        self._labels: deque = deque()
        self._probs: deque = deque()
        self._n = 0
        self.size = size

    def add(self, labels: np.ndarray, probs: np.ndarray) -> None:
        self._labels.append(np.asarray(labels).ravel())
        self._probs.append(np.asarray(probs).ravel())
        self._n += len(self._labels[-1])
        while self._n - len(self._labels[0]) >= self.size:
            self._n -= len(self._labels.popleft())
            self._probs.popleft()

    def auc(self) -> float:
        if not self._labels:
            return float("nan")
        return auc(np.concatenate(self._labels), np.concatenate(self._probs))
