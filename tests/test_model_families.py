"""Every model family through the product: trained by `elastic-control train`, scored by evaluation and serving.

One short real parameter-server job per family (1 pserver, 1 trainer, a small synthetic hour, a small
MLP so the four jobs stay quick). For each pass: meta.json names the family and its cube row layout,
and the golden lines are reproduced within 1e-5 by offline evaluation (its pass scorer: the sparse
table in memory + the dense inference program) and by serving through cube servers and the file server.
"""

from __future__ import annotations

import json

import pyarrow  # noqa: F401  (before paddle)

import numpy as np
import pytest
import requests
from helpers_serving import cube_servers, fileserver_in_thread, publish_version, serving_in_thread
from helpers_train import START, read_golden, run_training, write_job

from ctr_foundation import pass_format
from elastic_control.training.families import FAMILIES

SLOTS = (1, 2, 3, 4, 5)
TOL = 1e-5


@pytest.fixture(scope="module")
def family_passes(tmp_path_factory):
    """family -> its pass folder, each from its own training job on the same data."""
    from elastic_control.data.synth import generate
    from elastic_control.training.cli import hyperparameter_args
    from elastic_control.training.settings import Hyperparameters

    root = tmp_path_factory.mktemp("families")
    data = root / "data"
    generate(data, slots=SLOTS, hours=1, lines_per_hour=1500, seed=7, start=START, vocab=40)
    passes = {}
    for family in FAMILIES:
        job = write_job(root / family, slots=SLOTS, hours=1, data=data, extra=f'export MODEL="{family}"\n')
        hyper = Hyperparameters(
            hidden=(16, 16),
            batch_size=64,
            epochs=2,
            early_stop=False,  # both epochs always run (the default early stop may end a pass after one)
            log_every=1000,
            golden_lines=64,
            # Rates well above the defaults, the sparse Adam rule and no L2 on the embeddings: ~50
            # steps must move the dnn, which has no wide part, far from a constant (at the defaults its
            # golden probabilities spread by 5e-5 to 2e-4 from run to run; with Adam at 0.05, by 2.5e-3
            # to 4e-3; with the default decay rule at 0.05 one CI run spread them by only 8e-5).
            learning_rate=0.01,
            sparse_optimizer="adam",
            sparse_learning_rate=0.05,
            l2_embedding=0.0,
            l2_wide=1.0,
        )
        result = run_training(job, trainers=1, pservers=1, args=hyperparameter_args(hyper), timeout=400)
        passes[family] = job.models / result.passes[-1]
    return passes


@pytest.mark.e2e
@pytest.mark.parametrize("family", FAMILIES)
def test_meta_names_the_family_and_its_row_layout(family_passes, family):
    meta = json.loads((family_passes[family] / pass_format.META_FILE).read_text())
    assert meta["model_family"] == family and meta["model"]["family"] == family
    layout = meta["row_layout"]
    assert layout["width"] == meta["embedding_dim"] == 9
    assert sum(c["width"] for c in layout["columns"]) == 9
    names = [c["name"] for c in layout["columns"]]
    assert names == (["embedding"] if family == "dnn" else ["wide", "embedding"])
    assert meta["training"]["epochs_run"] == 2


@pytest.mark.e2e
@pytest.mark.parametrize("family", FAMILIES)
def test_evaluation_reproduces_golden_lines(family_passes, family):
    from elastic_control.data.line_batch import parse_lines
    from elastic_control.evaluation.pass_scorer import PassScorer

    lines, probs = read_golden(family_passes[family])
    assert len(lines) == 64 and np.std(probs) > 1e-4, "a constant predictor would prove nothing"
    batch, bad = parse_lines([ln + "\n" for ln in lines])
    assert not bad
    np.testing.assert_allclose(PassScorer(family_passes[family]).score(batch), probs, rtol=0, atol=TOL)


@pytest.mark.e2e
def test_serving_reproduces_golden_lines_of_every_family(family_passes, tmp_path):
    """Serving stays generic: one cube version per family on the same cube servers, one serving app each."""
    from elastic_control.serving.versions import FileServerSource

    for family, pass_dir in family_passes.items():
        fs_root = tmp_path / family / "fs"
        publish_version(fs_root, pass_dir, shards=2)
        lines, probs = read_golden(pass_dir)
        with cube_servers(fs_root / "cube", 2, tmp_path / family) as urls, fileserver_in_thread(fs_root) as fs_url:
            with serving_in_thread(FileServerSource(fs_url, tmp_path / family / "cache", urls)) as srv:
                r = requests.post(srv.url + "/v1/predict", json={"instances": [{"line": ln} for ln in lines]})
                assert r.status_code == 200, r.text
                np.testing.assert_allclose(r.json()["predictions"], probs, rtol=0, atol=TOL, err_msg=family)
