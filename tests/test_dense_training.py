"""Dense slots through training: real Criteo lines as `elastic-control data criteo` writes them (I1-I13 also as
log counts in dense slots 40-52), the slot.conf it writes, a real 2-trainer parameter-server job.

What a user relies on: every trainer standardises the dense slots the same way (trainer 0's first-pass
moments), a resumed job keeps that standardisation, each pass records it, and offline scoring (what serving
and evaluation run) reproduces the training program's golden lines, dense values included.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers_common import CRITEO_FILE, run_cli
from helpers_passes import train
from helpers_train import read_golden, score_pass

from ctr_foundation.dense_features import DenseMoments, DenseNorm
from elastic_control.config.slot_conf import load_slot_conf
from elastic_control.data.criteo import DENSE_SLOTS
from elastic_control.data.line_batch import batch_dense, parse_lines

pytestmark = pytest.mark.skipif(not CRITEO_FILE.exists(), reason=f"real Criteo lines not found at {CRITEO_FILE}")


def _hour_lines(data, hour: str) -> list[str]:
    folder = data / hour
    return [ln for p in sorted(folder.glob("part-*")) for ln in p.read_text().splitlines() if ln]


def _convert(root, lines: int):
    """`elastic-control data criteo` on the first ``lines`` real lines, in 2 hours: (data, its summary)."""
    raw = root / "raw.tsv"
    with open(CRITEO_FILE, encoding="utf-8") as f:
        raw.write_text("".join(next(f) for _ in range(lines)))
    data = root / "data"
    r = run_cli("data", "criteo", "--input", raw, "--output", data, "--hours", 2, "--start", "20200101/00")
    assert r.returncode == 0, r.stderr
    return data, json.loads(r.stdout)


def test_dense_slots_train_resume_and_score_like_the_training_program(tmp_path):
    data, summary = _convert(tmp_path, 4000)
    conf = load_slot_conf(summary["slot_conf"])
    assert conf.dense == DENSE_SLOTS
    slots = [*map(str, conf.slots), *(f"{s} dense" for s in conf.dense)]
    args = ["--log-every", "1000", "--epochs", "1"]
    job = tmp_path / "job"
    *_, first = train(job, data=data, slots=slots, start="20200101/00", end="20200101/00", trainers=2, args=args)
    # The same job later, one more hour: it resumes after the first pass.
    *_, passes = train(job, data=data, slots=slots, start="20200101/00", end="20200101/01", trainers=2, args=args)
    assert passes[0] == first[0] and len(passes) == 2

    metas = [json.loads((p / "meta.json").read_text()) for p in passes]
    norms = [DenseNorm.from_json(m["dense_norm"]) for m in metas]
    assert metas[0]["dense_slots"] == list(DENSE_SLOTS) == metas[0]["model"]["dense_slots"]
    assert norms[0] == norms[1], "a resumed job keeps the first pass's standardisation"
    # Trainer 0 measured it on its share of the first hour (half the lines): close to the whole hour's.
    hour = parse_lines(_hour_lines(data, "20200101/00"))[0]
    whole = DenseMoments(DENSE_SLOTS)
    whole.add(batch_dense(hour, DENSE_SLOTS))
    want = whole.norm()
    assert all(s > 0 for s in norms[0].std)
    assert np.allclose(norms[0].mean, want.mean, atol=0.2 * np.array(want.std))

    # After each pass the logit bias was refitted: the first pass's mean prediction on its hour is the
    # hour's click rate (training/bias_refit.py).
    assert all(isinstance(m["training"]["bias_shift"], float) for m in metas)
    labels = hour.clicks
    first_hour = score_pass(passes[0], _hour_lines(data, "20200101/00"))
    assert abs(first_hour.mean() / labels.mean() - 1) < 0.01, (first_hour.mean(), labels.mean())
    for p in passes:
        lines, probs = read_golden(p)
        assert len(lines) >= 50 and any(":40" in ln or ":52" in ln for ln in lines)
        np.testing.assert_allclose(score_pass(p, lines), probs, atol=1e-5)
    # The dense part uses the numbers: without them (missing = the first pass's means) the scores move.
    lines, probs = read_golden(passes[-1])
    sparse_only = [" ".join(t for t in ln.split() if ":" not in t or int(t.split(":")[1]) < 40) for ln in lines]
    assert np.abs(score_pass(passes[-1], sparse_only) - probs).max() > 1e-3


def test_a_resumed_job_whose_passes_have_no_dense_standardisation_fails_naming_it(tmp_path):
    data, _ = _convert(tmp_path, 1000)
    args = ["--log-every", "1000", "--epochs", "1"]
    job = tmp_path / "job"
    sparse = [str(s) for s in range(1, 40)]
    train(job, data=data, slots=sparse, start="20200101/00", end="20200101/00", args=args)
    with pytest.raises(RuntimeError) as failed:
        train(
            job,
            data=data,
            slots=[*sparse, *(f"{s} dense" for s in DENSE_SLOTS)],
            start="20200101/00",
            end="20200101/01",
            args=args,
            timeout=120,
        )
    assert "has no standardisation of the dense slots" in str(failed.value)
