"""How far can models outside the product get on the 5-hour Criteo split? (Not the product: a yardstick.)

    .venv/bin/python bench/criteo_ceiling.py [--criteo PATH] [--hours 5]

The split of `elastic-control data criteo --hours 5` (file order, ceil(lines / hours) per hour; train on
all hours but the last, score the last), every model trained on the training hours pooled:
- logistic regression on the one-hot feasigns the converter writes (elastic_control.data.criteo);
- gradient-boosted trees (scikit-learn's HistGradientBoosting) on the raw integers, each categorical's
  count in the training hours and its out-of-fold target encoding: the first settings (rate 0.05, at most
  400 rounds), and tuned ones (rate 0.03, up to 2,000 rounds, 31 leaves of at least 100 lines, half the
  features a split, L2 5) for three seeds, averaged;
- the trees and the logistic regression averaged in logit space.
Prints each AUC beside the target (0.7715: logistic regression + 0.005). Figures: docs/benchmarks.md
"Current figures"; earlier runs in CHANGELOG.md, "How far can anything get on the Criteo split".
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

from elastic_control.data.criteo import CATEGORICAL_FEATURES, INTEGER_FEATURES, bucketize_integer  # noqa: E402
from elastic_control.metrics import auc  # noqa: E402

TARGET = 0.7715
DEFAULT_CRITEO = Path(__file__).resolve().parents[2] / "shared" / "data" / "criteo" / "criteo_real_distinct.txt"


def target_encoding(column: list[str], y: np.ndarray, n_train: int, *, folds: int = 5, prior_weight: float = 20):
    """Smoothed click rate of each value: out-of-fold for the training lines, from all of them for the rest."""
    prior = y[:n_train].mean()
    out = np.zeros(len(column))
    fold = np.arange(n_train) % folds

    def rates(rows):
        clicks, seen = Counter(), Counter()
        for i in rows:
            clicks[column[i]] += y[i]
            seen[column[i]] += 1
        return clicks, seen

    for f in range(folds):
        clicks, seen = rates(np.flatnonzero(fold != f))
        for i in np.flatnonzero(fold == f):
            v = column[i]
            out[i] = (clicks[v] + prior_weight * prior) / (seen[v] + prior_weight)
    clicks, seen = rates(range(n_train))
    for i in range(n_train, len(column)):
        v = column[i]
        out[i] = (clicks[v] + prior_weight * prior) / (seen[v] + prior_weight)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--criteo", type=Path, default=DEFAULT_CRITEO)
    ap.add_argument("--hours", type=int, default=5)
    args = ap.parse_args()
    import scipy.sparse as sp
    from scipy.special import expit, logit
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.linear_model import LogisticRegression

    raw = [ln.rstrip("\n").split("\t") for ln in args.criteo.open(encoding="utf-8") if ln.strip()]
    n = len(raw)
    n_train = math.ceil(n / args.hours) * (args.hours - 1)
    y = np.array([int(r[0]) for r in raw])
    y_test = y[n_train:]
    print(f"{n} lines: train on the first {n_train}, score the last {n - n_train}", flush=True)

    t = time.monotonic()
    vocab: dict = {}
    rows, cols = [], []
    for i, r in enumerate(raw):
        for s in range(INTEGER_FEATURES + CATEGORICAL_FEATURES):
            text = r[1 + s].strip()
            value = bucketize_integer(text) if s < INTEGER_FEATURES else (text or "NA")
            rows.append(i)
            cols.append(vocab.setdefault((s, value), len(vocab)))
    onehot = sp.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(n, len(vocab)))
    best = None
    for c in (0.03, 0.05, 0.1):
        lr = LogisticRegression(C=c, solver="liblinear").fit(onehot[:n_train], y[:n_train])
        p = lr.predict_proba(onehot[n_train:])[:, 1]
        a = auc(y_test, p)
        print(f"logistic regression, one-hot feasigns, C={c}: AUC {a:.4f}", flush=True)
        if best is None or a > best[0]:
            best = (a, p)
    lr_auc, lr_p = best

    integers = np.array([[float(v) if v.strip() else np.nan for v in r[1 : 1 + INTEGER_FEATURES]] for r in raw])
    features = [integers]
    for c in range(CATEGORICAL_FEATURES):
        column = [r[1 + INTEGER_FEATURES + c] for r in raw]
        counts = Counter(column[:n_train])
        features.append(np.array([counts.get(v, 0) for v in column], float)[:, None])
        features.append(target_encoding(column, y, n_train)[:, None])
    x = np.hstack(features)
    trees = HistGradientBoostingClassifier(
        max_iter=400, learning_rate=0.05, early_stopping=True, validation_fraction=0.1, l2_regularization=1.0
    ).fit(x[:n_train], y[:n_train])
    gb_p = trees.predict_proba(x[n_train:])[:, 1]
    gb_auc = auc(y_test, gb_p)
    print(f"boosted trees ({trees.n_iter_} rounds), integers + counts + target encoding: AUC {gb_auc:.4f}", flush=True)
    seeds = []
    for seed in range(3):
        tuned = HistGradientBoostingClassifier(
            learning_rate=0.03,
            max_iter=2000,
            max_leaf_nodes=31,
            min_samples_leaf=100,
            l2_regularization=5.0,
            max_features=0.5,
            early_stopping=True,
            validation_fraction=0.1,
            n_iter_no_change=100,
            random_state=seed,
        ).fit(x[:n_train], y[:n_train])
        seeds.append(logit(np.clip(tuned.predict_proba(x[n_train:])[:, 1], 1e-7, 1 - 1e-7)))
        print(f"tuned trees, seed {seed} ({tuned.n_iter_} rounds): AUC {auc(y_test, expit(seeds[-1])):.4f}", flush=True)
    tuned_p = expit(np.mean(seeds, axis=0))
    tuned_auc = auc(y_test, tuned_p)
    print(f"tuned trees, three seeds averaged: AUC {tuned_auc:.4f}", flush=True)
    if tuned_auc > gb_auc:
        gb_p, gb_auc = tuned_p, tuned_auc
    ens = max((auc(y_test, expit(w * logit(gb_p) + (1 - w) * logit(lr_p))), w) for w in (0.4, 0.5, 0.6, 0.7))
    print(f"trees and logistic regression, logits averaged {ens[1]:.1f} / {1 - ens[1]:.1f}: AUC {ens[0]:.4f}")
    print(
        f"target {TARGET}: logistic regression {lr_auc - TARGET:+.4f}, trees {gb_auc - TARGET:+.4f}, "
        f"ensemble {ens[0] - TARGET:+.4f} ({time.monotonic() - t:.0f} s)"
    )


if __name__ == "__main__":
    main()
