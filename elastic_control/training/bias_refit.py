"""The logit bias refitted after each pass, so that the pass's mean prediction is its click rate.

In Paddle 2.6.2's asynchronous parameter-server mode the dense part's bias barely leaves its start (the base
rate's log-odds): on passes of a few thousand lines it moved by 0.001, and the model's mean prediction was
whatever the embeddings and the MLP made of it (1.05-1.07 times the click rate on its own training hour,
1.09-1.15 on the next one, CHANGELOG.md, "The bias refitted after each pass"). Logistic regression's
optimality condition for its intercept is exactly "mean prediction = click rate on the training lines": after
a pass's epochs the trainers score up to BIAS_REFIT_LINES lines of the pass between them (each the first 1/N
of them from its share), trainer 0 sums what they send on the pass's ``trained`` barrier and moves the bias by
the shift that meets that condition, at most MAX_SHIFT in logit. What a trainer sends is its click count and a
histogram of its logits (LOGIT_BINS bins of 0.02), enough to solve the condition by Newton's method within
0.1% of the click rate (one Newton step from the sums alone left 1.3% when the logits were 0.3 off). A shift
of the bias moves every logit alike, so it changes no AUC; it is pushed to the servers before the export, so
the pass's dense model, its golden lines and the next pass all have it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BIAS_REFIT_LINES = 20_000  # per pass, all trainers together: a click rate within ~1% (sd of 0.25 / sqrt(n))
MAX_SHIFT = 0.5  # in logit: a pass whose mean is off by more than this is left to the next passes
LOGIT_RANGE = 12.0  # logits beyond +-this fall in the end bins (their probabilities hardly move)
LOGIT_BIN = 0.02
LOGIT_BINS = int(2 * LOGIT_RANGE / LOGIT_BIN)
_CENTERS = -LOGIT_RANGE + LOGIT_BIN * (np.arange(LOGIT_BINS) + 0.5)


@dataclass
class PredictionSums:
    n: int = 0
    clicks: float = 0.0
    predicted: float = 0.0  # sum of p
    hist: np.ndarray | None = None  # lines per logit bin (LOGIT_BINS)

    def add(self, clicks: np.ndarray, probs: np.ndarray) -> None:
        p = np.clip(np.asarray(probs, np.float64), 1e-12, 1 - 1e-12)
        bins = np.clip(((np.log(p / (1 - p)) + LOGIT_RANGE) / LOGIT_BIN).astype(np.int64), 0, LOGIT_BINS - 1)
        counts = np.bincount(bins, minlength=LOGIT_BINS)
        self.hist = counts if self.hist is None else self.hist + counts
        self.n += len(p)
        self.clicks += float(np.sum(clicks))
        self.predicted += float(p.sum())

    def to_json(self) -> dict:
        nonzero = np.flatnonzero(self.hist) if self.hist is not None else np.zeros(0, np.int64)
        return {
            "n": self.n,
            "clicks": self.clicks,
            "predicted": self.predicted,
            "bins": nonzero.tolist(),
            "counts": self.hist[nonzero].tolist() if len(nonzero) else [],
        }

    @classmethod
    def merged(cls, parts: list[dict]) -> PredictionSums:
        total = cls(hist=np.zeros(LOGIT_BINS, np.int64))
        for d in parts:
            if d:
                total.n += int(d["n"])
                total.clicks += float(d["clicks"])
                total.predicted += float(d["predicted"])
                np.add.at(total.hist, np.asarray(d["bins"], np.int64), np.asarray(d["counts"], np.int64))
        return total

    @property
    def mean_prediction(self) -> float:
        return self.predicted / self.n if self.n else float("nan")

    @property
    def click_rate(self) -> float:
        return self.clicks / self.n if self.n else float("nan")

    def shift(self) -> float:
        """The logit shift whose mean prediction over the histogram is the click rate, clipped to
        +-MAX_SHIFT (0 without lines, or when every line or none clicked: no finite shift meets it)."""
        if not self.n or self.hist is None or not 0 < self.clicks < self.n:
            return 0.0
        w = self.hist / self.n
        # The histogram's own mean prediction, not the exact one: the shift corrects the binning too.
        target = self.click_rate
        shift = 0.0
        for _ in range(50):  # Newton on a monotone, convex-concave function: a few steps
            p = 1 / (1 + np.exp(-(_CENTERS + shift)))
            gap = float(w @ p) - target
            slope = float(w @ (p * (1 - p)))
            if abs(gap) < 1e-9 or slope <= 0:
                break
            shift = float(np.clip(shift - gap / slope, -2 * MAX_SHIFT, 2 * MAX_SHIFT))
        return float(np.clip(shift, -MAX_SHIFT, MAX_SHIFT))
