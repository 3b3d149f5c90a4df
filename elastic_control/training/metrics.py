"""Metrics computed in numpy: AUC, log loss, and a bounded window of recent predictions."""

from __future__ import annotations

from collections import deque

import numpy as np


def auc(labels, scores) -> float:
    """Area under the ROC curve with ties counted as half (NaN when one class is absent)."""
    labels = np.asarray(labels).astype(bool).ravel()
    scores = np.asarray(scores, dtype=np.float64).ravel()
    pos = int(labels.sum())
    neg = len(labels) - pos
    if pos == 0 or neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(len(scores))
    # Average ranks over ties.
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    avg = first + (counts + 1) / 2.0
    ranks[order] = np.repeat(avg, counts)
    return float((ranks[labels].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def log_loss(labels, probs, eps: float = 1e-7) -> float:
    labels = np.asarray(labels, dtype=np.float64).ravel()
    p = np.clip(np.asarray(probs, dtype=np.float64).ravel(), eps, 1 - eps)
    return float(-(labels * np.log(p) + (1 - labels) * np.log(1 - p)).mean())


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
