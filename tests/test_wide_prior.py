"""The wide prior (training/wide_prior.py): later passes pull a key's wide weight toward its weight at the
pass start, with l2_wide plus the prior's strength per earlier occurrence; new keys keep l2_wide toward 0.

Checked here: the bookkeeping (what each key is fed, pass after pass), the anchored L2 term of the real
training net against numpy, the default (on for the wide families with an L2 on the wide weight), and a
real parameter-server job with the defaults whose second pass reads its keys' weights from the servers,
records the setting and reproduces its golden lines.
"""

from __future__ import annotations

import datetime as dt
import json

import pyarrow  # noqa: F401  (before paddle)

import numpy as np
import pytest
from helpers_train import START, key_counts, labels_of, read_golden, run_training, write_job

from ctr_foundation import pass_format
from elastic_control.training.wide_prior import WidePrior

SLOTS = (1, 2, 3, 4, 5)


def test_keys_seen_before_are_pulled_toward_their_pass_start_weight():
    prior = WidePrior(strength=0.1, l2_wide=5.0)
    keys = np.array([1, 2, 3], dtype=np.uint64)
    asked = []

    def weights(k):
        asked.append(k.tolist())
        return np.array([0.5 * float(x) for x in k], np.float32)

    # First pass: nothing seen before, so every key is pulled toward 0 with l2_wide and no weight is read.
    first = key_counts([1, 1, 2])
    assert prior.start_pass(first, weights) == 0 and asked == []
    np.testing.assert_allclose(prior.anchors(keys), [0, 0, 0])
    np.testing.assert_allclose(prior.weights(keys), [5, 5, 5])
    prior.end_pass(first)
    # Second pass over keys 2 and 3: key 2 (seen once) is anchored at its weight now; key 3 is new.
    second = key_counts([2, 3, 3])
    assert prior.start_pass(second, weights) == 1 and asked == [[2]]
    np.testing.assert_allclose(prior.anchors(keys), [0, 1.0, 0])
    np.testing.assert_allclose(prior.weights(keys), [5, 5.1, 5], rtol=1e-6)
    prior.end_pass(second)
    # Third pass: key 1's two earlier occurrences count once each whatever the epochs; key 3's two too.
    third = key_counts([1, 3])
    assert prior.start_pass(third, weights) == 2 and asked[-1] == [1, 3]
    np.testing.assert_allclose(prior.weights(keys), [5.2, 5, 5.2], rtol=1e-6)
    np.testing.assert_allclose(prior.anchors(keys), [0.5, 0, 1.5])
    with pytest.raises(ValueError, match="positive"):
        WidePrior(0.1, 0.0)


def test_the_anchored_term_of_the_training_net():
    """The loss of a real (local, non-PS) training net: mean log loss + sum(weight * (w - anchor)^2 * scale) / batch."""
    import paddle

    from elastic_control.training.model import ModelSpec, _l2_of_rows

    spec = ModelSpec(SLOTS, family="wide_deep", l2_wide=5.0, l2_embedding=2.0, wide_prior=0.1)
    assert spec.uses_wide_prior and spec.to_json()["wide_prior"] == 0.1
    assert not ModelSpec(SLOTS, family="dnn", l2_wide=5.0, wide_prior=0.1).uses_wide_prior  # no wide weight
    was_dynamic = paddle.in_dynamic_mode()
    paddle.enable_static()
    try:
        main, startup = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main, startup):
            rows = paddle.static.data("rows", [-1, 3], "float32")
            scale = paddle.static.data("scale", [-1, 1], "float32")
            anchor = paddle.static.data("anchor", [-1, 1], "float32")
            weight = paddle.static.data("weight", [-1, 1], "float32")
            terms = _l2_of_rows(paddle, rows, scale, spec, (anchor, weight))
        exe = paddle.static.Executor(paddle.CPUPlace())
        exe.run(startup)
        r = np.array([[0.3, 0.1, -0.2], [-0.4, 0.5, 0.0]], np.float32)
        s = np.array([[0.5], [1.0]], np.float32)
        a = np.array([[0.1], [0.0]], np.float32)
        w = np.array([[5.3], [5.0]], np.float32)
        wide, emb = exe.run(main, feed={"rows": r, "scale": s, "anchor": a, "weight": w}, fetch_list=terms)
    finally:
        if was_dynamic:
            paddle.disable_static()
    np.testing.assert_allclose(wide, 5.3 * 0.2**2 * 0.5 + 5.0 * 0.4**2 * 1.0, rtol=1e-5)
    np.testing.assert_allclose(emb, 2.0 * ((0.01 + 0.04) * 0.5 + 0.25 * 1.0), rtol=1e-5)


def test_the_default_is_on_for_a_wide_weight_with_an_l2_and_off_elsewhere():
    from elastic_control.training.settings import DEFAULT_WIDE_PRIOR, Hyperparameters, resolve_wide_prior

    assert resolve_wide_prior(Hyperparameters(), "wide_deep") == DEFAULT_WIDE_PRIOR == 0.095
    assert resolve_wide_prior(Hyperparameters(), "deepfm") == resolve_wide_prior(Hyperparameters(), "dcn") == 0.095
    # No wide weight, or no L2 on it to strengthen: the default stays off (an explicit flag is refused there).
    assert resolve_wide_prior(Hyperparameters(), "dnn") == 0.0
    assert resolve_wide_prior(Hyperparameters(l2_wide=0.0), "wide_deep") == 0.0
    assert resolve_wide_prior(Hyperparameters(wide_prior=0.0), "wide_deep") == 0.0  # --wide-prior 0: off
    assert resolve_wide_prior(Hyperparameters(wide_prior=0.2), "wide_deep") == 0.2


@pytest.mark.e2e
@pytest.mark.slow  # the default suite's multi-pass jobs run the prior too (delta passes, admission, eviction)
def test_a_job_with_the_wide_prior_reads_its_weights_and_reproduces_its_golden_lines(tmp_path):
    from elastic_control.data.line_batch import parse_lines
    from elastic_control.data.synth import generate
    from elastic_control.evaluation.pass_scorer import PassScorer
    from elastic_control.training.cli import hyperparameter_args
    from elastic_control.training.settings import Hyperparameters

    data = tmp_path / "data"
    generate(data, slots=SLOTS, hours=2, lines_per_hour=2000, seed=5, start=START, vocab=40)
    job = write_job(tmp_path / "job", slots=SLOTS, hours=2, data=data)
    hyper = Hyperparameters(hidden=(16, 16), log_every=1000, golden_lines=256)  # the prior by default
    result = run_training(job, trainers=2, pservers=1, args=hyperparameter_args(hyper), timeout=400)
    assert len(result.passes) == 2
    logs = "\n".join(p.read_text() for p in (job.models / "logs").glob("train-trainer-*.log"))
    # The first pass has nothing to anchor; the second reads the weights of keys the first one trained.
    first_hour, second_hour = (f"{h:%Y%m%d/%H}" for h in (START, START + dt.timedelta(hours=1)))
    assert logs.count(f"pass {first_hour}: wide prior on 0 keys seen before") == 2
    second = [ln for ln in logs.splitlines() if f"pass {second_hour}: wide prior on" in ln]
    assert len(second) == 2 and all(int(ln.split("prior on ")[1].split()[0]) > 0 for ln in second), second
    for name in result.passes:
        p = job.models / name
        meta = json.loads((p / pass_format.META_FILE).read_text())
        assert meta["model"]["wide_prior"] == 0.095
        lines, probs = read_golden(p)
        batch, bad = parse_lines([ln + "\n" for ln in lines])
        assert not bad and len(set(labels_of(lines))) == 2
        np.testing.assert_allclose(PassScorer(p).score(batch), probs, rtol=0, atol=1e-5)
