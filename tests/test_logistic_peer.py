"""The logistic-regression peer (evaluation/logistic_peer.py) that the quality tests and benchmark share."""

from __future__ import annotations

import numpy as np

from elastic_control.evaluation.logistic_peer import C_GRID, best_fit, labels_of, logistic_regression


def _lines(rng, n: int) -> list[str]:
    """Slot-format lines whose slot-1 feasign sets the click odds (7: 0.6, 8: 0.1), slot 2 is noise."""
    out = []
    for i in range(n):
        signal = rng.choice([7, 8])
        click = int(rng.random() < (0.6 if signal == 7 else 0.1))
        out.append(f"{i} {click} {signal}:1 {rng.integers(100, 140)}:2")
    return out


def test_the_peer_learns_a_planted_feasign_and_reports_each_c():
    rng = np.random.default_rng(3)
    train, test = _lines(rng, 3000), _lines(rng, 2000)
    fits = logistic_regression(train, test)
    assert sorted(fits) == sorted(C_GRID)
    best = best_fit(fits)
    assert best.auc == max(f.auc for f in fits.values()) > 0.7  # the planted feasign separates 0.6 from 0.1
    assert abs(best.calibration - 1) < 0.1 and 0 < best.log_loss < 0.69
    np.testing.assert_array_equal(labels_of(test[:3]), [int(ln.split()[1]) for ln in test[:3]])


def test_tokens_unseen_in_training_are_dropped():
    train = ["0 1 5:1", "1 0 6:1"] * 20
    fits = logistic_regression(train, ["2 1 5:1 999:3", "3 0 6:1 998:3"], grid=(1.0,))
    assert fits[1.0].auc == 1.0
