"""The planted pairwise interactions of `data synth --interactions`: present in the truth, out of logistic
regression's reach, and absent (the original lines, byte for byte) with ``--interactions 0``."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from click.testing import CliRunner

from elastic_control.data import synth
from elastic_control.data.synth import build_planted_model, sample_lines

SLOTS = tuple(range(1, 9))


def _digest(lines, prob) -> str:
    return hashlib.sha256(("\n".join(lines) + "".join(f"{p:.9f}" for p in prob)).encode()).hexdigest()


def test_interactions_0_draws_the_original_lines():
    # The digest of these lines and truths as the generator wrote them before interactions were planted.
    model = build_planted_model((3, 7, 11, 12), 4)
    lines, prob, _ = sample_lines(model, 2000, np.random.default_rng([4, 2, 0]))
    assert _digest(lines, prob) == "0609b68c27ba7e7e6b313cbcb2ba7a782505137f327d041d869e3e51cdee2e3b"
    assert model.embeddings == () and model.fm_scale == 0.0 and len(model.weights[0]) == synth.DEFAULT_VOCAB


def test_the_truth_holds_the_factorisation_machine_term_over_the_interacting_slots():
    model = build_planted_model(SLOTS, 3, interactions=0.7)
    interacting = [j for j, e in enumerate(model.embeddings) if np.any(e != 0)]
    assert len(interacting) == synth.FM_SLOTS and model.fm_scale > 0 and model.interactions == ()
    assert all(len(w) == synth.INTERACTION_VOCAB for w in model.weights)
    lines, prob, _ = sample_lines(model, 3000, np.random.default_rng(0))
    # Recompute each line's logit from its feasigns alone: bias + weights + sum over slot pairs <v_a, v_b>.
    index = {(int(f), s): (j, i) for j, s in enumerate(model.slots) for i, f in enumerate(model.feasigns[j])}
    first, pairwise = np.full(len(lines), model.bias), np.zeros(len(lines))
    for n, line in enumerate(lines):
        per_slot = np.zeros((len(model.slots), synth.FM_RANK))
        for tok in line.split()[2:]:
            f, s = tok.split(":")
            j, i = index[(int(f), int(s))]
            first[n] += model.weights[j][i]
            per_slot[j] += model.embeddings[j][i]
        pairwise[n] = sum(per_slot[a] @ per_slot[b] for a in range(len(per_slot)) for b in range(a))
    np.testing.assert_allclose(prob, 1 / (1 + np.exp(-(first + model.fm_scale * pairwise))), rtol=1e-9)
    # The term is as strong as asked (its logit standard deviation) and the CTR stays at the base rate.
    assert np.std(model.fm_scale * pairwise) == pytest.approx(0.7, rel=0.15)
    assert np.mean(prob) == pytest.approx(0.2, abs=0.02)


def test_logistic_regression_stays_below_the_bayes_optimal_auc():
    from elastic_control.evaluation.logistic_peer import best_fit, logistic_regression
    from elastic_control.metrics import auc

    model = build_planted_model(SLOTS, 7, interactions=synth.DEFAULT_INTERACTIONS)
    train = [ln for h in range(3) for ln in sample_lines(model, 6000, np.random.default_rng([7, 2, h]))[0]]
    test, prob, clicks = sample_lines(model, 6000, np.random.default_rng([7, 2, 3]))
    lr = best_fit(logistic_regression(train, test, grid=(0.1, 0.3, 1.0))).auc
    bayes = auc(clicks, prob)
    assert 0.78 < bayes < 0.87 and bayes - lr >= 0.03, (bayes, lr)


def test_the_help_texts_state_the_generators_constants():
    from elastic_control.data.cli import data_group
    from elastic_control.demo.cli import demo_command

    text = " ".join(CliRunner().invoke(data_group, ["synth", "--help"], terminal_width=400).output.split())
    assert f"{synth.DEFAULT_INTERACTIONS:g} is what the demo uses" in text
    assert f"standard deviation {synth.MAIN_STD:g} plus" in text and f"pair of {synth.FM_SLOTS} of the slots" in text
    assert f"{synth.INTERACTION_VOCAB} feasigns per slot unless --vocab" in text
    demo = " ".join(CliRunner().invoke(demo_command, ["--help"], terminal_width=400).output.split())
    assert f"[default: ({synth.DEFAULT_INTERACTIONS:g});" in demo


def test_data_synth_writes_interaction_data_and_keeps_the_original_by_default(tmp_path):
    from elastic_control.data.cli import data_group

    def run(out, *extra):
        argv = ["synth", "--output", str(tmp_path / out), "--hours", "1", "--lines-per-hour", "500", *extra]
        res = CliRunner().invoke(data_group, [*argv, "--seed", "2"])
        assert res.exit_code == 0, res.output
        return json.loads(res.output.strip().splitlines()[-1]), tmp_path / out / "20191221" / "00"

    default, folder = run("default")
    zero, zero_folder = run("zero", "--interactions", "0")
    assert default["interactions"] == zero["interactions"] == 0.0
    assert (folder / "part-00000").read_bytes() == (zero_folder / "part-00000").read_bytes()
    planted, _ = run("planted", "--interactions", "0.7")
    assert planted["interactions"] == 0.7 and planted["bayes_auc"] != default["bayes_auc"]
