"""Evaluation metrics against scikit-learn on the same inputs (ties, single-class groups, merges)."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import log_loss, ndcg_score, roc_auc_score

from ctr_foundation.errors import DataError
from elastic_control.evaluation.grouped import GroupTotals, group_bucket, group_totals
from elastic_control.metrics import (
    CountsBuilder,
    auc_from_counts,
    counts_from_arrays,
    merge_counts,
    summarize,
)


def _data(n=20000, seed=0, levels=None):
    rng = np.random.default_rng(seed)
    scores = rng.beta(1, 3, n).astype(np.float32)
    if levels:  # few distinct scores: many ties
        scores = (np.round(scores * levels) / levels).astype(np.float32)
    labels = (rng.random(n) < scores).astype(np.int64)
    return labels, scores


@pytest.mark.parametrize("levels", [None, 20, 3])
def test_auc_logloss_calibration_equal_sklearn(levels):
    y, s = _data(levels=levels)
    m = summarize(counts_from_arrays(y, s))
    assert m["auc"] == pytest.approx(roc_auc_score(y, s), abs=1e-12)
    # scikit-learn computes float32 inputs in float32 (clipping at float32 eps, as we do);
    # without clipping in play, its float64 result must match to rounding.
    assert m["logloss"] == pytest.approx(log_loss(y, s), rel=1e-6)
    eps = np.finfo(np.float32).eps
    if np.all((s > eps) & (s < 1 - eps)):
        assert m["logloss"] == pytest.approx(log_loss(y, s.astype(np.float64)), rel=1e-12)
    assert m["calibration"] == pytest.approx(float(np.mean(s.astype(np.float64))) / y.mean(), rel=1e-12)
    assert m["auc_exact"] and m["auc_error_bound"] == 0
    assert sum(r["count"] for r in m["reliability"]) == len(y)
    top = m["reliability"][-1]
    mask = s.astype(np.float64) >= 0.9
    assert top["count"] == int(mask.sum())


def test_extreme_scores_and_negative_zero_match_sklearn():
    y = np.array([0, 1, 0, 1, 1, 0])
    s = np.array([0.0, 1.0, -0.0, 0.0, 1.0, 1e-30], np.float32)
    m = summarize(counts_from_arrays(y, s))
    assert m["auc"] == pytest.approx(roc_auc_score(y, s), abs=1e-12)
    assert m["logloss"] == pytest.approx(log_loss(y, s), rel=1e-6)


def test_bad_scores_and_empty_input_are_clear_errors():
    with pytest.raises(DataError, match="probabilities in"):
        counts_from_arrays(np.array([1, 0]), np.array([0.5, np.nan], np.float32))
    with pytest.raises(DataError, match="probabilities in"):
        counts_from_arrays(np.array([1]), np.array([1.5], np.float32))
    with pytest.raises(DataError, match="no examples"):
        summarize(counts_from_arrays(np.zeros(0), np.zeros(0, np.float32)))


def test_single_class_has_no_auc():
    m = summarize(counts_from_arrays(np.ones(5), np.linspace(0, 1, 5).astype(np.float32)))
    assert m["auc"] is None and m["calibration"] is not None


def test_merged_chunks_are_bit_identical_to_one_table():
    y, s = _data(50000, seed=3, levels=1000)
    whole = summarize(counts_from_arrays(y, s))
    parts = [counts_from_arrays(y[i::7], s[i::7]) for i in range(7)]
    merged = summarize(merge_counts(parts[::-1]))
    assert merged == whole  # exact equality, not approximate
    builder = CountsBuilder(buffer_size=3000)
    for i in range(0, len(y), 1234):
        builder.add(y[i : i + 1234], s[i : i + 1234])
    assert summarize(builder.result()) == whole


def test_coarsened_table_states_a_bound_that_holds():
    y, s = _data(100000, seed=5)
    t = counts_from_arrays(y, s, max_distinct=5000)
    assert t.shift > 0 and len(t.keys) <= 5000
    auc, bound = auc_from_counts(t)
    exact = roc_auc_score(y, s)
    assert 0 < bound < 0.01
    assert abs(auc - exact) <= bound
    m = summarize(t)
    assert not m["auc_exact"]
    assert m["logloss"] == pytest.approx(log_loss(y, s.astype(np.float64)), rel=1e-12)


def test_coarsened_while_streaming_and_merged_with_an_exact_table_keeps_its_sums():
    # The running sums start when a table is coarsened: from the exact tables it was made of, then from
    # each example added; a merge adds an exact table's sums from its keys.
    y, s = _data(100000, seed=6)
    builder = CountsBuilder(max_distinct=5000, buffer_size=3000)
    for i in range(0, 60000, 1234):
        builder.add(y[i : min(i + 1234, 60000)], s[i : min(i + 1234, 60000)])
    streamed = builder.result()
    assert streamed.shift > 0
    exact = counts_from_arrays(y[60000:], s[60000:])
    assert exact.exact
    merged = merge_counts([streamed, exact])
    m = summarize(merged)
    assert not m["auc_exact"] and m["examples"] == len(y)
    assert m["logloss"] == pytest.approx(log_loss(y, s.astype(np.float64)), rel=1e-12)
    assert m["mean_predicted_ctr"] == pytest.approx(float(s.astype(np.float64).mean()), rel=1e-12)
    whole = summarize(counts_from_arrays(y, s))
    assert [b["count"] for b in m["reliability"]] == [b["count"] for b in whole["reliability"]]
    for got, want in zip(m["reliability"], whole["reliability"], strict=True):
        assert got["observed_ctr"] == want["observed_ctr"]
        assert got["mean_predicted"] == pytest.approx(want["mean_predicted"], rel=1e-12)


def _sk_group_metrics(g, y, s, k):
    weighted, weight, ndcgs = 0.0, 0, []
    for key in np.unique(g):
        m = g == key
        yy, ss = y[m], s[m]
        if 0 < yy.sum() < len(yy):
            weighted += len(yy) * roc_auc_score(yy, ss)
            weight += len(yy)
        if yy.sum() > 0:
            ndcgs.append(ndcg_score([yy], [ss], k=k) if len(yy) > 1 else 1.0)
    return weighted / weight, float(np.mean(ndcgs))


@pytest.mark.parametrize("k", [1, 3, 10])
def test_grouped_auc_and_ndcg_equal_sklearn_with_ties_and_single_class_groups(k):
    rng = np.random.default_rng(11)
    n = 6000
    g = rng.integers(0, 400, n).astype(np.uint64) * np.uint64(2**61 + 12345)  # large uint64 keys
    s = (np.round(rng.random(n) * 8) / 8).astype(np.float32)  # heavy ties
    y = (rng.random(n) < 0.3).astype(np.int64)
    # Force some single-class groups: all clicks, and all non-clicks, and a singleton.
    y[g == g[0]] = 1
    y[g == g[1]] = 0
    g[-1] = np.uint64(2**64 - 1)
    gauc, ndcg = _sk_group_metrics(g, y, s, k)
    t = group_totals(g, y, s, k)
    summary = t.summary(k)
    assert summary["gauc"] == pytest.approx(gauc, abs=1e-12)
    assert summary[f"ndcg@{k}"] == pytest.approx(ndcg, abs=1e-12)
    assert summary["gauc_single_class_groups"] >= 2 and summary["ndcg_groups_without_click"] >= 1
    # Bucketed computation adds up to the same totals.
    b = group_bucket(g, 5)
    parts = GroupTotals()
    for i in range(5):
        parts = parts.add(group_totals(g[b == i], y[b == i], s[b == i], k))
    assert parts.summary(k) == pytest.approx(summary)


def test_one_call_auc_log_loss_and_the_trainers_window_equal_sklearn():
    """The one AUC of the project, as training, the synthetic generator and the demo call it."""
    from elastic_control import metrics

    labels, scores = _data(5000, seed=5, levels=20)
    scores[:3] = [0.0, 1.0, 1.0]  # clipped the way scikit-learn clips float32 predictions
    assert metrics.auc(labels, scores) == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)
    assert metrics.log_loss(labels, scores) == pytest.approx(log_loss(labels, scores), rel=1e-6)
    assert np.isnan(metrics.auc(np.ones(3), [0.1, 0.2, 0.3]))  # one class
    assert np.isnan(metrics.auc([0, 1], [np.nan, 0.5]))  # a diverged model does not stop training
    window = metrics.RecentWindow(1000)
    for i in range(0, 5000, 100):
        window.add(labels[i : i + 100], scores[i : i + 100])
    assert window.auc() == pytest.approx(roc_auc_score(labels[-1000:], scores[-1000:]), abs=1e-12)
