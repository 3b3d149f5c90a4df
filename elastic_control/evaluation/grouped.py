"""Per-group ranking metrics: grouped AUC and NDCG@k (groups = users or queries).

Both need every example of a group together, so the parallel path hashes
groups into buckets (``group_bucket``) and computes one bucket at a time; the
per-bucket results (``GroupTotals``) add up exactly.

Definitions (stated because conventions differ):
- Grouped AUC = sum over groups with both classes of n_g * AUC_g, divided by
  the sum of n_g over those groups (impression-weighted). Single-class groups
  have no AUC and are counted in ``gauc_single_class_groups``.
- NDCG@k per group follows scikit-learn's ``ndcg_score`` (linear gain = the
  click label, discount 1/log2(rank+1), tied scores share the average gain of
  their block). Groups without a click have no ideal ranking: scikit-learn
  scores them 0, which would make the mean depend on how many such groups
  there are; they are excluded here and counted in ``ndcg_groups_without_click``.
  A one-example group with a click has NDCG 1.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from elastic_control.metrics import score_keys

HASH_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing spreads consecutive ids over buckets


def group_bucket(groups: np.ndarray, buckets: int) -> np.ndarray:
    """A stable bucket in [0, buckets) for each uint64 group key."""
    if buckets <= 1:
        return np.zeros(len(groups), np.int64)
    with np.errstate(over="ignore"):
        h = np.asarray(groups, np.uint64) * HASH_MULTIPLIER
    return ((h >> np.uint64(32)) % np.uint64(buckets)).astype(np.int64)


@dataclass
class GroupTotals:
    weighted_auc: float = 0.0  # sum of n_g * AUC_g over two-class groups
    auc_weight: int = 0  # sum of n_g over two-class groups
    auc_groups: int = 0
    single_class_groups: int = 0
    ndcg_sum: float = 0.0
    ndcg_groups: int = 0
    ndcg_without_click: int = 0
    groups: int = 0

    def add(self, other: GroupTotals) -> GroupTotals:
        return GroupTotals(*(a + b for a, b in zip(asdict(self).values(), asdict(other).values(), strict=True)))

    def summary(self, k: int) -> dict:
        return {
            "groups": self.groups,
            "gauc": self.weighted_auc / self.auc_weight if self.auc_weight else None,
            "gauc_groups": self.auc_groups,
            "gauc_single_class_groups": self.single_class_groups,
            f"ndcg@{k}": self.ndcg_sum / self.ndcg_groups if self.ndcg_groups else None,
            "ndcg_groups": self.ndcg_groups,
            "ndcg_groups_without_click": self.ndcg_without_click,
        }


def _runs(*columns: np.ndarray) -> np.ndarray:
    """Start indices of runs of equal rows in already sorted columns."""
    n = len(columns[0])
    change = np.zeros(n, bool)
    if n:
        change[0] = True
        for c in columns:
            change[1:] |= c[1:] != c[:-1]
    return np.flatnonzero(change)


def group_totals(groups: np.ndarray, labels: np.ndarray, scores: np.ndarray, k: int) -> GroupTotals:
    """Grouped AUC and NDCG@k totals over the complete groups in these arrays."""
    groups = np.asarray(groups, np.uint64)
    labels = np.asarray(labels).astype(np.int64)
    scores = np.asarray(scores)
    n = len(groups)
    if n == 0:
        return GroupTotals()
    # Sort by group, then score descending (for ranking); ties are handled as blocks. One sort of a
    # packed uint64: dense group id (33 bits) | inverted float32 score bits (30 bits: scores are in
    # [0, 1], so at most 0x3F800000) | label (1 bit).
    uniq, gid_of = np.unique(groups, return_inverse=True)
    if len(uniq) >= 1 << 33:
        raise ValueError("more than 2**33 groups in one bucket: use more buckets")
    inv_score = np.uint64(0x3F800000) - score_keys(scores.astype(np.float32)).astype(np.uint64)
    packed = (gid_of.astype(np.uint64) << np.uint64(31)) | (inv_score << np.uint64(1)) | labels.astype(np.uint64)
    packed.sort()
    g = packed >> np.uint64(31)
    y = (packed & np.uint64(1)).astype(np.int64)
    s = (packed >> np.uint64(1)) & np.uint64(0x3FFFFFFF)  # equal within a tie block; only compared
    gstart = _runs(g)
    gsize = np.diff(np.append(gstart, n))
    gid = np.repeat(np.arange(len(gstart)), gsize)
    gpos = np.add.reduceat(y, gstart)
    gneg = gsize - gpos

    # Tie blocks (same group, same score).
    bstart = _runs(g, s)
    bsize = np.diff(np.append(bstart, n))
    bpos = np.add.reduceat(y, bstart)
    bneg = bsize - bpos
    bgid = gid[bstart]

    # AUC per group: blocks are in descending score order, so negatives *below* a block
    # are the group's negatives after it.
    neg_cum_incl = np.cumsum(bneg)
    group_neg_end = np.cumsum(gneg)[bgid]
    neg_after = group_neg_end - neg_cum_incl
    wins2 = np.bincount(bgid, weights=bpos * (2.0 * neg_after + bneg), minlength=len(gstart))
    two_class = (gpos > 0) & (gneg > 0)
    auc_g = wins2[two_class] / (2.0 * gpos[two_class] * gneg[two_class])

    # NDCG@k: discount of rank r (0-based) is 1/log2(r+2) for r < k, else 0.
    rank = np.arange(n) - gstart[gid]
    disc = np.where(rank < k, 1.0 / np.log2(rank + 2.0), 0.0)
    block_disc = np.add.reduceat(disc, bstart)
    dcg = np.bincount(bgid, weights=(bpos / bsize) * block_disc, minlength=len(gstart))
    # Ideal DCG for binary gains: the clicks first, so the first min(pos, k) discounts.
    max_rank = int(min(k, gsize.max()))
    ideal_prefix = np.concatenate([[0.0], np.cumsum(1.0 / np.log2(np.arange(max_rank) + 2.0))])
    idcg = ideal_prefix[np.minimum(gpos, max_rank)]
    has_click = gpos > 0

    return GroupTotals(
        weighted_auc=float(np.sum(gsize[two_class] * auc_g)),
        auc_weight=int(gsize[two_class].sum()),
        auc_groups=int(two_class.sum()),
        single_class_groups=int((~two_class).sum()),
        ndcg_sum=float(np.sum(dcg[has_click] / idcg[has_click])),
        ndcg_groups=int(has_click.sum()),
        ndcg_without_click=int((~has_click).sum()),
        groups=len(gstart),
    )
