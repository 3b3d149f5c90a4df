"""The ``decay`` sparse rule: per-key rates that fall as a key is seen (training/rate_decay.py).

The pservers run plain SGD on the parts that use it and the trainers scale each key's gradient by
``1 / sqrt(1 + sightings / decay_sightings)`` through model.decayed_rows. Checked here: the factors'
arithmetic, that the training net's forward value does not change while its gradient is scaled (real
Paddle program), the pserver table configuration, and a real parameter-server job with the rule on both
parts whose passes record the rule, save the columns plain SGD keeps and reproduce their golden lines.
"""

from __future__ import annotations

import datetime as dt
import json

import pyarrow  # noqa: F401  (before paddle)

import numpy as np
import pytest
from helpers_train import START, key_counts, labels_of, read_golden, run_training, write_job

from ctr_foundation import pass_format
from elastic_control.metrics import auc
from elastic_control.training.rate_decay import RateDecay

SLOTS = (1, 2, 3, 4, 5)


def test_key_counts_lookup_and_absorb():
    a = key_counts([5, 5, 7, 2**64 - 1])
    assert a.lookup(np.array([5, 7, 9, 2**64 - 1], dtype=np.uint64)).tolist() == [2, 1, 0, 1]
    a.absorb(key_counts([7, 9, 9]))
    assert a.lookup(np.array([5, 7, 9], dtype=np.uint64)).tolist() == [2, 2, 2]
    assert key_counts([]).lookup(np.array([1], dtype=np.uint64)).tolist() == [0]


def test_factors_follow_sightings_of_all_trainers():
    decay = RateDecay(decay_sightings=10, trainers=2)
    keys = np.array([1, 2, 3], dtype=np.uint64)
    first = key_counts([1] * 20 + [2] * 4)
    decay.start_epoch(first, share_lines=100)
    np.testing.assert_allclose(decay.factors(keys), [1, 1, 1])  # nothing fed yet: full rates
    decay.fed(50)  # half the epoch: key 1 seen 10 times here, 20 by both trainers
    np.testing.assert_allclose(decay.factors(keys), 1 / np.sqrt(1 + np.array([20, 4, 0]) / 10), rtol=1e-6)
    decay.end_epoch()  # the whole epoch counts now, and carries into the next epoch and pass
    decay.start_epoch(first, share_lines=100)  # the same pass's second epoch: nothing of it fed yet
    np.testing.assert_allclose(decay.factors(keys), 1 / np.sqrt(1 + np.array([40, 8, 0]) / 10), rtol=1e-6)
    decay.fed(50)
    np.testing.assert_allclose(decay.factors(keys), 1 / np.sqrt(1 + np.array([60, 12, 0]) / 10), rtol=1e-6)
    decay.end_epoch()
    decay.start_epoch(key_counts([3]), share_lines=10)
    np.testing.assert_allclose(decay.factors(keys), 1 / np.sqrt(1 + np.array([80, 16, 0]) / 10), rtol=1e-6)
    with pytest.raises(ValueError, match="decay_sightings"):
        RateDecay(0, 1)


def test_decayed_rows_keep_the_forward_value_and_scale_the_gradient():
    import paddle

    from elastic_control.training.model import decayed_rows

    was_dynamic = paddle.in_dynamic_mode()
    paddle.enable_static()
    try:
        main, startup = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main, startup):
            x = paddle.static.data("x", [-1, 3], "float32")
            x.stop_gradient = False
            f = paddle.static.data("f", [-1, 1], "float32")
            y = decayed_rows(paddle, x, f)
            loss = paddle.sum(y * paddle.to_tensor(np.array([1.0, 2.0, 3.0], np.float32)))
            (gx,) = paddle.static.gradients([loss], [x])
        exe = paddle.static.Executor(paddle.CPUPlace())
        exe.run(startup)
        xv = np.arange(6, dtype=np.float32).reshape(2, 3)
        fv = np.array([[1.0], [0.25]], np.float32)
        yv, gv = exe.run(main, feed={"x": xv, "f": fv}, fetch_list=[y, gx])
    finally:
        if was_dynamic:
            paddle.disable_static()
    np.testing.assert_allclose(yv, xv, rtol=1e-6)
    np.testing.assert_allclose(gv, [[1, 2, 3], [0.25, 0.5, 0.75]], rtol=1e-6)


def test_the_pservers_run_plain_sgd_for_the_decay_rule():
    import paddle.distributed.fleet as fleet

    from elastic_control.training.model import SPARSE_TABLE_NAME, ModelSpec, make_strategy, saved_rule

    spec = ModelSpec(SLOTS, family="wide_deep", sparse_optimizer="decay", wide_optimizer="adam")
    config = make_strategy(fleet, spec, shards=2).sparse_table_configs
    assert spec.uses_decay and saved_rule("decay") == "naive" and saved_rule("adam") == "adam"
    text = str(config)  # fleet's table configuration (a protobuf message once set)
    assert SPARSE_TABLE_NAME in text and "SparseNaiveSGDRule" in text and "SparseAdamSGDRule" in text
    assert not ModelSpec(SLOTS).uses_decay


@pytest.mark.e2e
@pytest.mark.slow  # the rule on embedx_w is the default, which every default-suite job trains with
def test_a_job_with_the_decay_rule_trains_and_its_passes_reproduce_their_golden_lines(tmp_path):
    from elastic_control.data.hourly_writer import hour_dir
    from elastic_control.data.line_batch import parse_lines
    from elastic_control.data.synth import generate, read_truth
    from elastic_control.evaluation.pass_scorer import PassScorer
    from elastic_control.training.cli import hyperparameter_args
    from elastic_control.training.settings import Hyperparameters

    data = tmp_path / "data"
    generate(data, slots=SLOTS, hours=2, lines_per_hour=2000, seed=3, start=START, vocab=40)
    job = write_job(tmp_path / "job", slots=SLOTS, hours=2, data=data)
    hyper = Hyperparameters(
        sparse_optimizer="decay",
        wide_optimizer="decay",
        sparse_learning_rate=0.008,
        wide_learning_rate=0.008,
        decay_sightings=30,
        hidden=(16, 16),
        log_every=1000,
        golden_lines=256,
    )
    result = run_training(job, trainers=2, pservers=1, args=hyperparameter_args(hyper), timeout=400)
    assert len(result.passes) == 2
    last = job.models / result.passes[-1]
    meta = json.loads((last / pass_format.META_FILE).read_text())
    assert meta["model"]["sparse_optimizer"] == meta["model"]["wide_optimizer"] == "decay"
    assert meta["model"]["decay_sightings"] == 30
    # Plain SGD keeps no optimizer state: the saved rows are the accessor's head and the row itself.
    layout = meta["sparse_layout"]
    assert layout["optimizer"] == layout["embed_optimizer"] == "naive"
    assert layout["value_columns"] == pass_format.ACCESSOR_HEAD_COLUMNS + 9
    lines, probs = read_golden(last)
    batch, bad = parse_lines([ln + "\n" for ln in lines])
    assert not bad
    np.testing.assert_allclose(PassScorer(last).score(batch), probs, rtol=0, atol=1e-5)
    # It learned: on the last hour's lines (trained on, so an upper bound of sorts) it ranks nearly as
    # well as the planted model's true probabilities.
    hour_lines, truth = read_truth(hour_dir(data, START + dt.timedelta(hours=1)))
    scored, bad = parse_lines([ln + "\n" for ln in hour_lines])
    labels = labels_of(hour_lines)
    ours, bayes = auc(labels, PassScorer(last).score(scored)), auc(labels, truth)
    assert ours > bayes - 0.05, f"AUC {ours:.4f} against the planted model's {bayes:.4f}"
