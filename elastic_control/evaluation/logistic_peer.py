"""The peer that model-quality claims are measured against: logistic regression on the same feasigns.

scikit-learn's liblinear logistic regression on one-hot features, one column per slot-format feasign
token (``feasign:slot``) of the training lines (a dense slot's number, ``2.5:40``, is not a feasign:
it is left out, so the peer stays logistic regression on the keys the sparse table learns), fitted for
each C of a small grid and scored on the held-out lines. The best C is chosen on those held-out lines:
the peer's most favourable figure. Used by ``bench/bench_training.py`` and ``tests/test_model_quality.py``,
so both measure the model against the same peer. scikit-learn is a development dependency
(requirements-dev.txt), imported only here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ctr_foundation.sample import parse_sample_line
from elastic_control.metrics import auc, log_loss

# scikit-learn's C = 1 / (2 L2): the small real logs pick 0.03, the 5-hour Criteo split 0.1.
C_GRID = (0.01, 0.03, 0.1, 0.3, 1.0)


@dataclass(frozen=True)
class PeerFit:
    c: float
    auc: float
    log_loss: float
    calibration: float  # mean predicted CTR / observed CTR on the held-out lines


def labels_of(lines: list[str]) -> np.ndarray:
    """The click column of slot-format lines (``id click feasign:slot ...``)."""
    return np.array([int(ln.split()[1]) for ln in lines])


def logistic_regression(train_lines: list[str], test_lines: list[str], grid=C_GRID) -> dict[float, PeerFit]:
    """One fit per C of ``grid`` on ``train_lines``, scored on ``test_lines`` (tokens unseen in training
    are dropped, as a model that never trained them would)."""
    import scipy.sparse as sp
    from sklearn.linear_model import LogisticRegression

    vocab: dict[tuple[int, int], int] = {}

    def onehot(lines: list[str], grow: bool):
        cols, ptr = [], [0]
        for ln in lines:
            sample = parse_sample_line(ln)  # the grammar's one reader; value tokens (dense slots) left out
            for tok in zip(sample.feasigns, sample.slots, strict=True):
                j = vocab.setdefault(tok, len(vocab)) if grow else vocab.get(tok)
                if j is not None:
                    cols.append(j)
            ptr.append(len(cols))
        return cols, ptr

    train, test = onehot(train_lines, True), onehot(test_lines, False)
    x_train, x_test = (sp.csr_matrix((np.ones(len(c)), c, p), shape=(len(p) - 1, len(vocab))) for c, p in (train, test))
    y_train, y_test = labels_of(train_lines), labels_of(test_lines)
    fits = {}
    for c in grid:
        model = LogisticRegression(C=c, max_iter=2000, solver="liblinear").fit(x_train, y_train)
        p = model.predict_proba(x_test)[:, 1]
        fits[c] = PeerFit(c, auc(y_test, p), log_loss(y_test, p), float(p.mean() / y_test.mean()))
    return fits


def best_fit(fits: dict[float, PeerFit]) -> PeerFit:
    """The fit with the highest held-out AUC."""
    return max(fits.values(), key=lambda f: f.auc)
