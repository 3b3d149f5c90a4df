"""Offline evaluation and the promotion gate on passes the product trainer wrote."""

from __future__ import annotations

import gzip
import json
import os
import shutil

import numpy as np
import pytest
from helpers_common import PYTHON, free_port, process, run_cli
from helpers_passes import GROUP_SLOT, SYNTH_START, hour_text, write_data_config

from ctr_foundation.records import GOLDEN_FILE, read_golden

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def world(tmp_path_factory, synth_world, shuffled_world):
    """The newest synthetic pass (good), a pass trained on shuffled clicks (bad), and a copy of the synthetic
    hours after the first one, each cut to a quarter of its lines (scoring the product's 400-400-400 model is what
    these tests spend their time on); of the two hold-out hours the first is gzipped, the last gets a malformed
    line."""
    import datetime as dt

    from elastic_control.data.hourly_writer import hour_dir

    root = tmp_path_factory.mktemp("evalworld")
    data = root / "data"
    shutil.copytree(synth_world.data, data)
    first, last = synth_world.holdout
    examples = 0
    after_bad = hour_text(SYNTH_START + dt.timedelta(hours=1))  # the gate's hold-out hour for the bad pass
    for hour in (after_bad, first, last):
        for part in sorted(hour_dir(data, dt.datetime.strptime(hour, "%Y%m%d/%H")).glob("part-*")):
            text = "".join(ln + "\n" for ln in part.read_text().splitlines()[::4] if ln.strip())
            part.write_text(text)
            examples += text.count("\n") if hour != after_bad else 0
            if hour == first:  # gzipped parts are read like plain ones
                part.with_name(part.name + ".gz").write_bytes(gzip.compress(text.encode()))
                part.unlink()
    # A malformed line is counted and skipped, never fatal below the limit.
    with open(hour_dir(data, dt.datetime.strptime(last, "%Y%m%d/%H")) / "part-00000", "a") as f:
        f.write("1 x not-a-line\n")
    config = write_data_config(root / "data.config", data, first, last)
    (root / "data.config.loose").write_text(config.read_text() + 'export MAX_BAD_LINE_FRACTION="0.5"\n')
    good, bad = synth_world.latest, shuffled_world.latest
    assert good.name != bad.name
    return {
        "root": root,
        "good": good,
        "bad": bad,
        "config": root / "data.config.loose",
        "examples": examples,
        "holdout": (first, last),
    }


@pytest.fixture(autouse=True)
def _mlflow_store(world, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{world['root'] / 'mlflow.db'}")


def _golden(pass_dir):
    lines, probs = read_golden(pass_dir / GOLDEN_FILE)
    return lines, np.array(probs)


@pytest.mark.parametrize("which", ["good", "bad"])
def test_golden_lines_score_to_training_probabilities(world, which):
    from elastic_control.data.line_batch import parse_lines
    from elastic_control.evaluation.pass_scorer import PassScorer
    from elastic_control.inference.scoring import score_lines

    lines, probs = _golden(world[which])
    scorer = PassScorer(world[which])
    batch, bad = parse_lines(lines)
    assert not bad and len(batch) == len(lines) == len(probs) >= 100
    got = scorer.score(batch)
    assert np.abs(got - probs).max() < 1e-5
    # The shared scoring path serving uses gives the same numbers.
    shared = score_lines(lines, scorer.info, scorer.table.lookup, scorer.model)
    assert np.abs(shared - probs).max() < 1e-5
    assert probs.std() > 0.01  # a real model, not a constant


def test_a_lines_score_does_not_depend_on_the_batch_it_is_scored_in(world):
    """What bit-identical parallel metrics rest on: the dense model's CPU kernels change with the row count
    (3-7, 13-15, 33-39, ... rows give other last bits than 128), so the scorer runs fixed-size chunks."""
    from elastic_control.data.line_batch import parse_lines, take_rows
    from elastic_control.evaluation.pass_scorer import PassScorer

    scorer = PassScorer(world["good"])
    batch, _ = parse_lines(_golden(world["good"])[0][:40])
    whole = scorer.score(batch)
    parts = [scorer.score(take_rows(batch, np.arange(0, 3))), scorer.score(take_rows(batch, np.arange(3, 40)))]
    np.testing.assert_array_equal(np.concatenate(parts), whole)  # 3 + 37 rows scored as 40


def test_the_chunk_size_keeps_the_bits_of_256_row_chunks(world):
    """Evaluation's dense chunks grew from 256 rows to DENSE_CHUNK_ROWS for their cost per row: every row's
    score must keep its bits (scores and metrics unchanged from the smaller chunks)."""
    from elastic_control.data.line_batch import parse_lines
    from elastic_control.evaluation.pass_scorer import DENSE_CHUNK_ROWS, PassScorer, predict_in_fixed_chunks

    scorer = PassScorer(world["good"])
    batch, _ = parse_lines(_golden(world["good"])[0])
    x = scorer.model_input(batch)
    x = np.concatenate([x] * (DENSE_CHUNK_ROWS // len(x) + 2))  # more than one full chunk
    small = predict_in_fixed_chunks(scorer.model, x, 256)
    np.testing.assert_array_equal(
        predict_in_fixed_chunks(scorer.model, x, DENSE_CHUNK_ROWS).view(np.uint32), small.view(np.uint32)
    )


def _spec(world, shares, **kw):
    from elastic_control.evaluation.shares import EvalSpec

    return EvalSpec.create(
        model=world["good"],
        baseline=world["bad"],
        data_config=world["config"],
        shares=shares,
        group_slot=GROUP_SLOT,
        **kw,
    )


def test_parallel_equals_single_process_and_sklearn(world, tmp_path):
    from sklearn.metrics import roc_auc_score

    from elastic_control.evaluation.parallel import evaluate

    single = evaluate(_spec(world, 1, keep_scored=True), workers=1, partials=tmp_path / "one")
    par = evaluate(_spec(world, 3), workers=2, partials=tmp_path / "three")
    for key in ("model", "baseline", "comparison"):
        assert par.metrics[key] == single.metrics[key]  # exact, not approximate
    assert single.metrics["model"]["examples"] == world["examples"]
    assert single.metrics["data"]["bad_lines"] == 1
    shares = par.metrics["data"]["share_examples"]
    assert sum(shares) == world["examples"] and min(shares) > 0
    import pyarrow as pa
    import pyarrow.parquet as pq

    t = pa.concat_tables([pq.read_table(f) for f in single.scored_files])
    y, s = t.column("label").to_numpy(), t.column("score").to_numpy()
    assert single.metrics["model"]["auc"] == pytest.approx(roc_auc_score(y, s), abs=1e-12)
    # The trained pass clearly beats the one that learned nothing (AUC near 0.5).
    assert single.metrics["model"]["auc"] > 0.65 > 0.55 > single.metrics["baseline"]["auc"]


def test_lost_share_is_redone_alone(world, tmp_path):
    from ctr_foundation.errors import DataError
    from elastic_control.evaluation.parallel import evaluate, merge_partials
    from elastic_control.evaluation.shares import SHARE_JSON, run_share, share_dir

    spec = _spec(world, 3)
    partials = tmp_path / "p"
    run_share(spec, 0, partials)
    run_share(spec, 2, partials)
    with pytest.raises(DataError, match=r"shares 1/3 have no complete partial"):
        merge_partials(partials)
    before = {i: (share_dir(partials, i, 3) / SHARE_JSON).stat().st_mtime_ns for i in (0, 2)}
    result = evaluate(spec, workers=1, partials=partials)
    after = {i: (share_dir(partials, i, 3) / SHARE_JSON).stat().st_mtime_ns for i in (0, 2)}
    assert before == after  # the complete shares were reused, not recomputed
    fresh = evaluate(spec, workers=1, partials=tmp_path / "fresh")
    assert result.metrics["model"] == fresh.metrics["model"]


def _cli(*args, env=None):
    return run_cli(*args, env_extra=env)


def test_cli_writes_metrics_parquet_plots_and_mlflow(world, tmp_path):
    out = tmp_path / "out"
    # One worker here (parallel runs are covered above); the module's MLflow store (already migrated).
    r = _cli(
        "eval",
        "--model",
        world["good"],
        "--baseline",
        world["bad"],
        "-f",
        world["config"],
        "--output",
        out,
        "--group-slot",
        GROUP_SLOT,
        "--workers",
        1,
        "--ndcg-k",
        5,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ndcg@5" in r.stderr and "auc" in r.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["model"]["gauc"] > metrics["baseline"]["gauc"]
    import pyarrow.parquet as pq

    t = pq.read_table(out / "scored.parquet")
    assert t.num_rows == metrics["model"]["examples"] == world["examples"]
    assert set(t.column_names) == {"label", "score", "baseline_score", "group"}
    assert (out / "roc.png").read_bytes()[:4] == b"\x89PNG" and (out / "calibration.png").stat().st_size > 1000
    from mlflow.tracking import MlflowClient

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    runs = client.search_runs(
        [client.get_experiment_by_name("elastic-ctr").experiment_id], filter_string="params.ndcg_k = '5'"
    )
    run = [x for x in runs if x.info.run_name.startswith("eval-")][0]
    assert run.data.metrics["auc"] == pytest.approx(metrics["model"]["auc"])
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"roc.png", "calibration.png", "metrics.json"} <= names


def test_cli_shard_and_merge(world, tmp_path):
    partials = tmp_path / "parts"
    base = ["eval", "--model", world["good"], "-f", world["config"], "--partial-out", partials]
    for i in range(2):
        r = _cli(*base, "--shard", f"{i}/2")
        assert r.returncode == 0, r.stderr[-2000:]
    r = _cli("eval", "merge", "--partial-out", partials, "--json", "--no-mlflow")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["model"]["examples"] == world["examples"]


def test_cli_errors_are_one_line(world, tmp_path):
    r = _cli("eval", "-f", world["config"])
    assert r.returncode == 2 and "--model" in r.stderr and "Traceback" not in r.stderr
    r = _cli("eval", "--model", tmp_path, "-f", world["config"])
    assert r.returncode == 1 and "not a pass folder" in r.stderr and "Traceback" not in r.stderr
    r = _cli("eval", "--model", world["good"], "-f", world["config"], "--shard", "3/2", "--partial-out", tmp_path)
    assert r.returncode == 2 and "I/W" in r.stderr
    r = _cli("eval", "--model", world["good"], "-f", world["config"], "--start", "2020-01-01")
    assert r.returncode == 2 and "YYYYMMDD/HH" in r.stderr
    r = _cli("eval", "merge", "--partial-out", tmp_path / "nothing")
    assert r.returncode == 1 and "no share partials" in r.stderr


def test_gate_rejects_worse_pass_and_promotes_better(world):
    from elastic_control.evaluation.gate import evaluate_candidate

    rule = "auc_drop<=0.002,calibration=0.5..2"
    worse = evaluate_candidate(world["bad"], world["good"], rule, data_config=world["config"])
    assert not worse.passed and "auc drop" in worse.reason and "rejected" in worse.reason
    better = evaluate_candidate(world["good"], world["bad"], rule, data_config=world["config"])
    assert better.passed, better.reason
    first = world["holdout"][0]  # the hour right after the good pass's window
    assert better.metrics["holdout"] == {"start": first, "end": first, "after_training": True}
    first = evaluate_candidate(world["good"], None, "calibration=0.5..2,auc>=0.65", data_config=world["config"])
    assert first.passed and "no active pass" in first.reason
    from mlflow.tracking import MlflowClient

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    runs = client.search_runs(
        [client.get_experiment_by_name("elastic-ctr").experiment_id], filter_string="tags.`gate.decision` = 'rejected'"
    )
    assert any(r.data.tags["gate.pass"] == world["bad"].name for r in runs)


def test_gate_without_holdout_data_fails_closed(world, tmp_path):
    from elastic_control.evaluation.gate import evaluate_candidate

    empty = write_data_config(tmp_path / "empty.config", tmp_path / "nodata", "20200101/00", "20200101/00")
    d = evaluate_candidate(world["good"], None, "calibration=0.5..2", data_config=empty, record=False)
    assert not d.passed and "cannot evaluate" in d.reason


def test_shadow_scoring_beside_live_serving(world, tmp_path):
    """Real serving (active = good pass) with the candidate (bad pass) shadow-scored on the same requests."""
    import requests
    from helpers_serving import serving_in_thread

    from elastic_control.evaluation.pass_scorer import PassScorer
    from elastic_control.evaluation.shadow import ShadowScorer, shadow_report
    from elastic_control.serving.versions import ModelDirSource

    models = world["good"].parent  # the good pass is the newest one there
    lines, _ = _golden(world["good"])
    log = tmp_path / "shadow.jsonl"
    shadow = ShadowScorer(world["bad"], log)
    with serving_in_thread(ModelDirSource(models), workers=1) as srv:
        srv.app.add_after_response_hook(shadow)
        served = []
        for i in range(0, 200, 50):
            r = requests.post(
                f"{srv.url}/v1/predict", json={"instances": [{"line": ln} for ln in lines[i : i + 50]]}, timeout=30
            )
            assert r.status_code == 200, r.text
            served += r.json()["predictions"]
        shadow.flush()
    shadow.close()
    records = [json.loads(ln) for ln in log.read_text().splitlines()]
    active = np.concatenate([r["active"] for r in records])
    candidate = np.concatenate([r["candidate"] for r in records])
    assert shadow.counters["instances"] == 200 and shadow.counters["errors"] == 0
    assert np.allclose(np.sort(active), np.sort(served), atol=1e-6)
    # The candidate's logged scores are the bad pass's own offline scores.
    from elastic_control.data.line_batch import parse_lines

    offline = PassScorer(world["bad"]).score(parse_lines(lines[:200])[0])
    assert np.allclose(np.sort(candidate), np.sort(offline), atol=1e-5)
    report = shadow_report(log)
    assert report["instances"] == 200 and report["labelled"] == 200
    assert report["auc_active"] > report["auc_candidate"]
    assert report["versions"] == [f"{world['good'].name} vs {world['bad'].name}"]
    r = _cli("eval", "shadow-report", log, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["instances"] == 200


def test_serve_shadow_flag_logs_candidate_scores(world, tmp_path):
    """`elastic-control serve --shadow PASS` wires the shadow scorer into the real serving process."""
    import time

    import requests
    from helpers_cube import add_done

    models = tmp_path / "models"
    models.mkdir()
    add_done(models, world["good"].name)
    (models / world["good"].name).symlink_to(world["good"])
    log = tmp_path / "shadow.jsonl"
    port = free_port()
    argv = ["serve", "--host", "127.0.0.1", "--port", port, "--model-dir", models, "--workers", 1]
    argv += ["--shadow", world["bad"], "--shadow-log", log]
    with process([PYTHON, "-m", "elastic_control", *argv], log_path=tmp_path / "serve.log") as proc:
        lines, _ = _golden(world["good"])
        deadline = time.monotonic() + 120
        while True:
            try:
                r = requests.post(
                    f"http://127.0.0.1:{port}/v1/predict",
                    json={"instances": [{"line": ln} for ln in lines[:20]]},
                    timeout=10,
                )
                if r.status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "serving did not come up"
            time.sleep(0.2)
        while not (log.exists() and log.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.1)
        rec = json.loads(log.read_text().splitlines()[0])
        assert rec["candidate_version"] == world["bad"].name and len(rec["candidate"]) == 20
        assert np.allclose(rec["active"], r.json()["predictions"], atol=1e-6)


def test_rejected_pass_never_reaches_cube(world, tmp_path, monkeypatch):
    """Real cube-transfer with a gate: the good pass rolls out, the shuffled-label one is rejected before
    any cube build, publish or prepare, and the shards keep serving the good one."""
    import contextlib

    import requests
    from helpers_cube import TOKEN, add_done, agent_args, cube_processes, fileserver, server_args

    from cube.promotion_gate import CommandGate
    from cube.rollout import RetryPolicy
    from cube.transfer import Transfer, TransferConfig

    monkeypatch.setenv("ELASTIC_CTR_DATA_CONFIG", str(world["config"]))
    models = tmp_path / "models"
    models.mkdir()
    good, bad = "pass-20200101-00", "pass-20200101-01"
    (models / good).symlink_to(world["good"])
    (models / bad).symlink_to(world["bad"])
    with contextlib.ExitStack() as stack:
        fs_url = stack.enter_context(fileserver(tmp_path / "fileserver"))
        port = free_port()
        data = tmp_path / "shard-0"
        data.mkdir()
        started = stack.enter_context(
            cube_processes(
                [
                    ("server", server_args(data, 0, port=port), "server-0"),
                    ("agent", agent_args(data, 0, f"http://127.0.0.1:{port}", fs_url), "agent-0"),
                ],
                tmp_path,
            )
        )
        server_url, agent_url = started[0][0], started[1][0]
        cfg = TransferConfig(
            model_path=models,
            cube_root=tmp_path / "built",
            fileserver_url=fs_url,
            agents=[agent_url],
            token=TOKEN,
            gate=CommandGate("auc_drop<=0.002,calibration=0.5..2"),
            retry=RetryPolicy(attempts=2, backoff=0.1, timeout=30),
        )
        t = Transfer(cfg)
        add_done(models, good)
        assert t.poll_once() == good
        assert requests.get(f"{server_url}/v1/status", timeout=5).json()["active"] == good
        add_done(models, bad)
        t.poll_once()
        snap = t.status()[1]
        assert snap["passes"][bad]["status"] == "rejected", snap["passes"][bad]
        assert "auc drop" in snap["passes"][bad]["gate"]["reason"]
        assert requests.get(f"{server_url}/v1/status", timeout=5).json()["active"] == good
        assert not (tmp_path / "built" / bad).exists()  # never built
        r = requests.get(f"{fs_url}/files/cube/{bad}/", timeout=5)
        assert r.status_code == 404  # never published
        assert requests.get(f"{fs_url}/files/cube/current.json", timeout=5).json()["version"] == good
