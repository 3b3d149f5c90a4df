"""The logit bias refitted after each pass (training/bias_refit.py): the Newton step and its limits."""

from __future__ import annotations

import numpy as np
import pytest

from elastic_control.training.bias_refit import MAX_SHIFT, PredictionSums


def _sums(logits: np.ndarray, clicks: np.ndarray, parts: int = 1) -> PredictionSums:
    """The merged sums of ``parts`` trainers' shares, as trainer 0 gets them on the barrier."""
    shares = []
    for z, y in zip(np.array_split(logits, parts), np.array_split(clicks, parts), strict=True):
        s = PredictionSums()
        s.add(y, 1 / (1 + np.exp(-z)))
        shares.append(s.to_json())
    return PredictionSums.merged(shares)


@pytest.mark.parametrize("offset", [-0.3, -0.05, 0.0, 0.1, 0.4])
def test_one_step_brings_the_mean_prediction_to_the_click_rate(offset):
    rng = np.random.default_rng(5)
    true = rng.normal(-1.1, 0.8, 40_000)
    clicks = (rng.random(len(true)) < 1 / (1 + np.exp(-true))).astype(float)
    model = true + offset  # a model whose every logit is off by the same amount
    sums = _sums(model, clicks, parts=2)
    shift = sums.shift()
    after = (1 / (1 + np.exp(-(model + shift)))).mean()
    assert abs(after / clicks.mean() - 1) < 0.004, (offset, shift)
    assert abs(shift + offset) < 0.05  # it undoes the offset, up to the sample's noise


def test_the_shift_is_clipped_and_zero_without_a_finite_answer():
    mostly = (np.arange(1000) < 900).astype(float)
    assert _sums(np.full(1000, -4.0), mostly).shift() == MAX_SHIFT
    assert _sums(np.full(1000, 4.0), 1 - mostly).shift() == -MAX_SHIFT
    # every line clicked (or none): no finite shift meets the click rate, so none is made
    assert _sums(np.full(1000, -1.0), np.ones(1000)).shift() == 0.0
    assert PredictionSums().shift() == 0.0
    assert PredictionSums.merged([{}, {}]).n == 0  # a trainer with nothing to send
