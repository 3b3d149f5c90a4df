"""The early stop keeps a pass's best epoch (training/best_epoch.py): the bookkeeping, and a real job whose
pass is put back to its best epoch by the pservers loading the copy of the table."""

from __future__ import annotations

import json

import pyarrow  # noqa: F401  (before paddle)

import numpy as np
import pytest
from helpers_train import START, read_golden, run_training, write_job

from ctr_foundation import pass_format
from elastic_control.training import best_epoch
from elastic_control.training.best_epoch import BestEpoch

SLOTS = (1, 2, 3, 4)


class FakeModel:
    """A "table" and dense parameters a BestEpoch copies and restores; records what it was asked."""

    def __init__(self, tmp_path):
        self.table, self.dense = "epoch-0", {"w": np.zeros(2, np.float32)}
        self.saved: dict[str, str] = {}
        self.calls: list[str] = []
        self.keeper = BestEpoch(
            save_table=self.save,
            load_table=self.load,
            get_dense=lambda: self.dense,
            set_dense=self.set_dense,
            log=self.calls.append,
            patience=2,
        )
        self.keeper.start_pass(tmp_path / ".pass-20200101-00-best-epoch.tmp")

    def save(self, path):
        self.calls.append("save")
        self.saved[str(path)] = self.table

    def load(self, path):
        self.calls.append("load")
        self.table = self.saved[str(path)]

    def set_dense(self, values):
        self.dense = {k: v.copy() for k, v in values.items()}

    def epoch(self, n: int, loss: float, *, more: bool = True, seconds: float = 10.0, lines=None) -> bool:
        """Epoch ``n`` trained; its held-out loss (the mean of ``lines``, the per-line losses, when given)."""
        self.table, self.dense = f"epoch-{n}", {"w": np.full(2, n, np.float32)}
        if lines is not None:
            loss = float(np.mean(lines))
        return self.keeper.after_epoch(n, loss, more=more, epoch_seconds=seconds, line_losses=lines)


def test_a_worse_epoch_is_tolerated_once_and_the_best_one_comes_back(tmp_path):
    m = FakeModel(tmp_path)
    assert not m.epoch(1, 0.50)
    assert not m.epoch(2, 0.40)
    assert not m.epoch(3, 0.45)  # worse once: patience 2 tries another
    assert m.calls.count("load") == 0
    assert m.epoch(4, 0.41)  # worse twice in a row: epoch 2 is put back
    assert m.table == "epoch-2" and m.dense["w"].tolist() == [2, 2]
    assert (m.keeper.best_epoch, m.keeper.restored_epoch) == (2, 2)
    assert m.calls.count("save") == 2  # epochs 1 and 2; a worse epoch is never copied


def test_a_better_epoch_after_a_worse_one_becomes_the_best(tmp_path):
    m = FakeModel(tmp_path)
    m.epoch(1, 0.50)
    m.epoch(2, 0.55)
    assert not m.epoch(3, 0.45)
    assert m.epoch(4, 0.47, more=False)  # the last planned epoch, worse: epoch 3 comes back
    assert m.table == "epoch-3" and m.keeper.restored_epoch == 3


def test_the_last_epoch_is_kept_when_it_is_the_best(tmp_path):
    m = FakeModel(tmp_path)
    m.epoch(1, 0.50)
    assert not m.epoch(2, 0.40, more=False)
    assert m.table == "epoch-2" and m.keeper.restored_epoch is None
    assert m.calls.count("save") == 1  # nothing follows epoch 2: no copy of it


def test_without_copies_the_first_worse_epoch_ends_the_pass_as_before(tmp_path):
    m = FakeModel(tmp_path)
    m.keeper.enabled = False
    m.epoch(1, 0.50)
    assert m.epoch(2, 0.55)  # no copy to go back to: patience does not apply
    assert m.table == "epoch-2" and "save" not in m.calls and "load" not in m.calls


def test_one_slow_copy_is_not_enough_to_turn_copies_off(tmp_path, monkeypatch):
    monkeypatch.setattr(best_epoch, "MIN_COPY_SECONDS", 0.0)
    m = FakeModel(tmp_path)
    m.epoch(1, 0.50, seconds=0.0)  # any copy takes longer than 0 s: slow
    assert m.keeper.enabled and any("if the next one is as slow" in c for c in m.calls)
    m.epoch(2, 0.40)  # a copy well under 2x a 10 s epoch: the count starts again
    m.epoch(3, 0.30, seconds=0.0)
    assert m.keeper.enabled and m.calls.count("save") == 3


def test_copies_slower_than_their_epochs_twice_in_a_row_turn_copies_off_for_the_job(tmp_path, monkeypatch):
    monkeypatch.setattr(best_epoch, "MIN_COPY_SECONDS", 0.0)
    m = FakeModel(tmp_path)
    m.epoch(1, 0.50, seconds=0.0)
    assert m.keeper.enabled
    m.epoch(2, 0.45, seconds=0.0)
    assert not m.keeper.enabled and any("no more copies" in c for c in m.calls if c not in ("save", "load"))
    assert not m.epoch(3, 0.55)  # the copy of epoch 2 (taken before copies went off) is still the best
    assert m.epoch(4, 0.56) and m.table == "epoch-2"
    m.keeper.start_pass(tmp_path / ".pass-20200101-01-best-epoch.tmp")
    m.epoch(1, 0.50)
    m.epoch(2, 0.40)
    assert m.epoch(3, 0.45)  # no copies in this pass: the worse epoch stays, the pass ends at once
    assert m.table == "epoch-3"


# A hair worse than the epoch it follows on average (+0.0005), with a spread of 0.01 per line: on 150 lines
# that is within two standard errors (0.0017), i.e. noise.
NOISY = np.resize([0.0105, -0.0095], 150)


def test_epochs_worse_only_within_the_noise_count_half(tmp_path):
    rng = np.random.default_rng(0)
    m = FakeModel(tmp_path)
    base = 0.5 + rng.normal(0.0, 0.3, 150)  # the lines' own losses differ a lot; epochs move them together
    m.epoch(1, 0, lines=base)
    for n in (2, 3, 4):
        assert not m.epoch(n, 0, lines=base + NOISY)
    assert any("within the noise of its 150 lines" in c for c in m.calls)
    assert not m.epoch(5, 0, lines=base - 0.01)  # better after three noisy epochs (patience 2 = four)
    assert m.keeper.best_epoch == 5
    for n in (6, 7, 8):
        assert not m.epoch(n, 0, lines=base - 0.01 + NOISY)
    assert m.epoch(9, 0, lines=base - 0.01 + NOISY)  # the fourth noisy one ends it
    assert m.table == "epoch-5" and m.keeper.restored_epoch == 5


def test_without_a_copy_a_noisy_epoch_goes_on_and_a_clearly_worse_one_ends_the_pass(tmp_path):
    rng = np.random.default_rng(2)
    m = FakeModel(tmp_path)
    m.keeper.enabled = False
    base = 0.5 + rng.normal(0.0, 0.3, 150)
    m.epoch(1, 0, lines=base)
    assert not m.epoch(2, 0, lines=base + NOISY)
    assert m.epoch(3, 0, lines=base + 0.03 + rng.normal(0.0, 0.02, 150))
    assert m.table == "epoch-3" and "save" not in m.calls


def test_an_epoch_worse_beyond_the_noise_counts_toward_the_patience(tmp_path):
    rng = np.random.default_rng(1)
    m = FakeModel(tmp_path)
    base = 0.5 + rng.normal(0.0, 0.3, 150)
    m.epoch(1, 0, lines=base)
    worse = base + 0.02 + rng.normal(0.0, 0.02, 150)  # many standard errors above
    assert not m.epoch(2, 0, lines=worse)  # patience 2: one worse epoch may pass
    assert m.epoch(3, 0, lines=worse + 0.01)
    assert m.table == "epoch-1" and m.keeper.restored_epoch == 1


def test_a_last_epoch_no_better_within_the_noise_still_puts_the_best_back(tmp_path):
    m = FakeModel(tmp_path)
    base = np.linspace(0.1, 0.9, 150)
    m.epoch(1, 0, lines=base)
    assert m.epoch(2, 0, more=False, lines=base + np.resize([0.01, -0.0099], 150))  # mean +0.00005: noise
    assert m.table == "epoch-1" and m.keeper.restored_epoch == 1


def test_end_pass_removes_the_copy_and_a_restart_removes_a_stale_one(tmp_path):
    from elastic_control.training.resume import remove_stale_staging

    m = FakeModel(tmp_path)
    m.keeper.directory.mkdir()
    m.keeper.end_pass()
    assert not m.keeper.directory.exists()
    (tmp_path / ".pass-20200101-05-best-epoch.tmp").mkdir()  # left by a trainer killed mid-pass
    assert remove_stale_staging(str(tmp_path)) == [".pass-20200101-05-best-epoch.tmp"]


def _overfitting_job(tmp_path, *extra):
    """One 4,000-line pass (100 held-out lines: every 20th of trainer 0's half), 10 epochs at a high rate
    without L2: the held-out loss rises after a few."""
    from elastic_control.data.synth import generate
    from elastic_control.training.cli import hyperparameter_args
    from elastic_control.training.settings import Hyperparameters

    data = tmp_path / "data"
    if not data.exists():
        generate(data, slots=SLOTS, hours=1, lines_per_hour=4000, seed=5, start=START, vocab=300)
    job = write_job(tmp_path / f"job{len(extra)}", slots=SLOTS, hours=1, data=data)
    hyper = Hyperparameters(
        epochs=10,
        early_stop=True,
        sparse_optimizer="adam",
        sparse_learning_rate=0.1,
        wide_learning_rate=0.1,
        l2_embedding=0.0,
        l2_wide=0.0,
        hidden=(32, 32),
        log_every=1000,
        # The export must hold the best epoch's model exactly (its held-out loss is checked): no bias refit
        # after the restore (training/bias_refit.py; the refit is covered by tests/test_dense_training.py).
        refit_bias=False,
    )
    result = run_training(job, trainers=2, pservers=1, args=hyperparameter_args(hyper) + list(extra), timeout=400)
    (name,) = result.passes
    return job, job.models / name


@pytest.mark.e2e
def test_a_real_pass_exports_its_best_epoch_not_the_worse_ones_after_it(tmp_path):
    from elastic_control.data.line_batch import parse_lines
    from elastic_control.evaluation.pass_scorer import PassScorer

    job, pass_dir = _overfitting_job(tmp_path)
    meta = json.loads((pass_dir / pass_format.META_FILE).read_text())
    training, losses = meta["training"], meta["training"]["holdout_losses"]
    best = training["best_epoch"]
    assert training["restored_epoch"] == best, training
    assert training["epochs_run"] >= best + 1 and losses[best - 1] == min(losses), training
    # The exported model is epoch `best`'s: its held-out loss, recomputed at export, is that epoch's.
    assert meta["metrics"]["logloss"] == pytest.approx(losses[best - 1], abs=1e-5)
    assert meta["metrics"]["logloss"] < losses[-1] - 1e-4
    # ... and evaluation (the pass's own files) reproduces its golden lines: table and dense both came back.
    lines, probs = read_golden(pass_dir)
    batch, _ = parse_lines([ln + "\n" for ln in lines])
    np.testing.assert_allclose(PassScorer(pass_dir).score(batch), probs, rtol=0, atol=1e-5)
    assert not list(job.models.glob(".pass-*")), "the copy of the best epoch was left behind"


@pytest.mark.e2e
@pytest.mark.slow  # a second training job, for the opt-out; the default suite runs the restore above
def test_without_the_copies_a_real_pass_exports_the_epoch_that_stopped_it(tmp_path):
    _, plain = _overfitting_job(tmp_path, "--no-restore-best-epoch")
    meta = json.loads((plain / pass_format.META_FILE).read_text())
    training, losses = meta["training"], meta["training"]["holdout_losses"]
    assert training["restored_epoch"] is None and training["epochs_run"] == len(losses) < 10, training
    assert meta["metrics"]["logloss"] == pytest.approx(losses[-1], abs=1e-5)
    assert losses[-1] > min(losses)
