"""The coordinator re-runs only a failed share, reuses complete partials, and refuses mixed partials."""

from __future__ import annotations

import numpy as np
import pytest

from ctr_foundation.atomic import atomic_write_json, staged_directory
from ctr_foundation.errors import DataError
from elastic_control.evaluation import parallel
from elastic_control.evaluation.shares import SHARE_JSON, EvalSpec, share_dir
from elastic_control.metrics import counts_from_arrays, summarize

SPEC = EvalSpec(model="/m/pass-a", data_config="/d/data.config", start="20200101/00", end="20200101/01", shares=3)


def _data(i):
    rng = np.random.default_rng(i)
    s = rng.random(500).astype(np.float32)
    return (rng.random(500) < s).astype(np.int8), s


def fake_run_share(spec, index, partials, calls, fail_once=()):
    """What run_share leaves behind, from fixed arrays, failing once for the shares in ``fail_once``."""
    calls.append(index)
    if index in fail_once and calls.count(index) == 1:
        raise RuntimeError(f"worker of share {index} died")
    y, s = _data(index)
    with staged_directory(share_dir(partials, index, spec.shares)) as tmp:
        with open(tmp / "model.npz", "wb") as f:
            np.savez(f, **counts_from_arrays(y, s).to_arrays())
        atomic_write_json(
            tmp / SHARE_JSON,
            {
                "spec": spec.to_json(),
                "index": index,
                "shares": spec.shares,
                "buckets": 0,
                "model_pass": "pass-a",
                "baseline_pass": None,
                "examples": len(y),
                "grouped_examples": 0,
                "lines": len(y),
                "bad_lines": 0,
                "bad_examples": [],
                "hours": [],
                "seconds": 0,
            },
        )
    return {"examples": len(y), "seconds": 0}


def test_failed_share_is_retried_alone_and_result_is_exact(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(parallel, "run_share", lambda spec, i, p: fake_run_share(spec, i, p, calls, fail_once={1}))
    result = parallel.evaluate(SPEC, workers=1, partials=tmp_path)
    assert calls == [0, 1, 1, 2]
    ys, ss = zip(*(_data(i) for i in range(3)), strict=True)
    whole = summarize(counts_from_arrays(np.concatenate(ys), np.concatenate(ss)))
    assert result.metrics["model"] == {**whole, "pass": "pass-a"}
    # A second run finds every share complete and runs nothing.
    calls.clear()
    parallel.evaluate(SPEC, workers=1, partials=tmp_path)
    assert calls == []


def test_share_that_keeps_failing_is_reported(tmp_path, monkeypatch):
    def always(spec, i, p):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(parallel, "run_share", always)
    with pytest.raises(DataError, match="share 0 failed 3 times: disk on fire"):
        parallel.evaluate(SPEC, workers=1, partials=tmp_path)


def test_partials_of_another_evaluation_are_not_mixed_in(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(parallel, "run_share", lambda spec, i, p: fake_run_share(spec, i, p, calls))
    parallel.evaluate(SPEC, workers=1, partials=tmp_path)
    other = EvalSpec(**{**SPEC.__dict__, "end": "20200101/05"})
    calls.clear()
    fake_run_share(other, 0, tmp_path, calls)  # share 0 now belongs to a different window
    with pytest.raises(DataError, match=r"shares \[0\] belong to a different evaluation"):
        parallel.merge_partials(tmp_path, SPEC)
    calls.clear()
    parallel.evaluate(SPEC, workers=1, partials=tmp_path)  # the coordinator redoes exactly that share
    assert calls == [0]
