"""`elastic-control tune` end to end: real parameter-server candidates on small synthetic data.

One search (module fixture) is killed with SIGKILL while its second candidate trains and run again with
the same --output; the tests then read what it left: the leaderboard, the candidates' folders, their
passes, the winner retrained on the whole window, and the plan after --apply.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers_common import wait_until
from helpers_local import kill_everything_under, processes_under
from helpers_train import read_golden, score_pass

PYTHON = sys.executable
SEARCH = ["--candidates", "2", "--parallel", "1", "--max-epochs-cap", "2", "-t", "1", "-p", "1"]


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("MODEL_PATH", "MLFLOW_TRACKING_URI")}


def _run(root: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, "-m", "elastic_control", *args], cwd=root, capture_output=True, text=True, env=_env(), timeout=timeout
    )


def _tune_args(out: str = "out") -> list[str]:
    return ["tune", "-f", "data.config", "-s", "slot.conf", *SEARCH, "--output", out, "--state-dir", "state"]


@pytest.fixture(scope="module")
def search(tmp_path_factory):
    root = tmp_path_factory.mktemp("tune")
    (root / "slot.conf").write_text("".join(f"{s}\n" for s in range(1, 6)))
    synth = _run(
        root, "data", "synth", "--output", "data", "--hours", "2", "--lines-per-hour", "2500", "-s", "slot.conf"
    )
    assert synth.returncode == 0, synth.stderr
    (root / "data.config").write_text(
        f'export START_DATE_HR=20191221/00\nexport END_DATE_HR=20191221/01\nexport DATASET_PATH="{root / "data"}"\n'
        f'export MODEL_PATH="{root / "production"}"\n'
    )
    out = root / "out"
    first, second = out / "candidates" / "000", out / "candidates" / "001"
    try:
        with open(root / "killed-tune.log", "wb") as log:
            proc = subprocess.Popen(
                [PYTHON, "-m", "elastic_control", *_tune_args()], cwd=root, stdout=log, stderr=log, env=_env()
            )
            wait_until(
                lambda: (first / "result.json").exists() and (second / "candidate.json").exists(),
                timeout=400,
                what="the first candidate to finish and the second to start",
            )
            time.sleep(3)  # the second candidate's job is up and training
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        finished_at = (first / "result.json").stat().st_mtime
        # The killed tune's worker and its roles end by themselves (parent-death signal, then the supervisor).
        wait_until(lambda: not processes_under(root), timeout=90, what="the killed search's processes to end")
        rerun = _run(root, *_tune_args(), "--json")
        assert rerun.returncode == 0, rerun.stderr
        yield {"root": root, "out": out, "board": json.loads(rerun.stdout), "stderr": rerun.stderr, "at": finished_at}
    finally:
        kill_everything_under(root)


def test_leaderboard_names_the_best_candidate(search):
    board = search["board"]
    assert board == json.loads((search["out"] / "leaderboard.json").read_text())
    done = [c for c in board["candidates"] if c["state"] == "done"]
    assert len(done) == 2 and board["budget"] == {"candidates": 2, "finished": 2}
    best = board["best"]
    assert set(best) == {"candidate", "pass", "settings", "validation", "judged_pass", "why", "refit"}
    top = max(done, key=lambda c: c["validation"]["auc"])
    if best["candidate"] == top["candidate"]:
        assert best["why"] == "the best validation AUC"
    else:  # the defaults, within one standard error of the top AUC
        assert best["candidate"] == "000" and "one standard error" in best["why"]
    winner = next(c for c in done if c["candidate"] == best["candidate"])
    assert best["judged_pass"] == winner["pass"] and Path(winner["pass"], "meta.json").exists()
    # No --validation: the candidates trained on 4 lines in 5, so the winner was trained again on every line of
    # the window (-f's data, not the split's copy), and that pass is best.pass.
    refit = best["refit"]
    assert refit["window"] == {"start": "20191221/00", "end": "20191221/01"} and "held out" in refit["why"]
    assert Path(best["pass"], "meta.json").exists() and Path(best["pass"]).parent == search["out"] / "refit" / "models"
    config = (search["out"] / "refit" / "data.config").read_text()
    assert f'DATASET_PATH="{search["root"] / "data"}"' in config
    spec = json.loads((search["out"] / "refit" / "candidate.json").read_text())
    assert spec["settings"] == best["settings"] and spec["validation_config"] is None
    assert "retrained on the whole window" in search["stderr"]
    for row in done:
        v = row["validation"]
        assert 0.5 < v["auc"] < 1 and v["logloss"] > 0 and 0.5 < v["calibration"] < 1.5
        assert v["examples"] == 1000  # every 5th line of 2 x 2,500 judges
        assert row["examples_per_sec"] > 0 and row["seconds"] > 0
        assert set(row["settings"]) >= {"model", "hidden", "embedding_dim", "learning_rate", "pass_hours"}
    lr = board["references"]["logistic_regression"]
    if lr is not None:  # scikit-learn is a development dependency
        assert 0.5 < lr["auc"] < 1


def test_a_killed_search_resumes_without_redoing_finished_candidates(search):
    out, board = search["out"], search["board"]
    states = {c["candidate"]: c["state"] for c in board["candidates"]}
    # 000 finished before the kill and is kept; 001 was interrupted, its settings ran again as 002.
    assert states == {"000": "done", "001": "failed", "002": "done"}
    assert (out / "candidates" / "000" / "result.json").stat().st_mtime == search["at"]
    assert (out / "candidates" / "000" / "worker.log").read_text().count("done: ") == 1
    by_name = {c["candidate"]: c for c in board["candidates"]}
    assert by_name["002"]["settings"] == by_name["001"]["settings"]
    assert "interrupted" in search["stderr"]


def test_every_pass_tune_writes_reproduces_its_golden_lines(search):
    passes = sorted(search["out"].glob("candidates/*/models/pass-*"))
    refit = sorted(search["out"].glob("refit/models/pass-*"))
    assert passes and refit
    passes += refit
    for pass_dir in passes:
        lines, probs = read_golden(pass_dir)
        assert len(lines) > 0
        assert abs(score_pass(pass_dir, lines) - probs).max() < 1e-5, pass_dir


def test_apply_puts_the_winner_into_the_plan(search):
    from elastic_control import api
    from elastic_control.config import Resources
    from elastic_control.config.data_config import load_data_config
    from elastic_control.plan import load_plan

    root = search["root"]
    api.configure_resource(
        resources=Resources(trainers=1, pservers=1, cube_shards=1),
        slot_conf=str(root / "slot.conf"),
        data_config=str(root / "data.config"),
        backend="local",
        state_dir=str(root / "state"),
    )
    res = _run(root, "tune", "--output", "out", "--apply", "--state-dir", "state")
    assert res.returncode == 0, res.stderr
    best = search["board"]["best"]["settings"]
    plan = load_plan(root / "state")
    args = plan.training_args
    assert args[args.index("--model") + 1] == best["model"]
    assert args[args.index("--hidden") + 1] == best["hidden"]
    assert args[args.index("--epochs") + 1] == "auto"
    assert plan.extra["tuned"]["pass"] == search["board"]["best"]["pass"]
    assert load_data_config(root / "state" / "data.config").pass_hours == best["pass_hours"]
    # -a starts every training role with those flags
    from ctr_foundation.names import StateFolder
    from elastic_control.local.components import plan_components

    local = plan_components(plan, StateFolder.of(root / "state"), model_path=str(root / "models"))
    roles = [c for c in local.components if c.kind in ("pserver", "trainer")]
    assert roles and all(c.argv[-len(args) :] == args for c in roles), [c.argv for c in roles]


def test_a_finished_search_run_again_redoes_nothing(search):
    out = search["out"]
    marks = sorted([*out.glob("candidates/*/result.json"), out / "refit" / "result.json"])
    before = {p: p.stat().st_mtime for p in marks}
    res = _run(search["root"], *_tune_args(), "--json")
    assert res.returncode == 0, res.stderr
    assert {p: p.stat().st_mtime for p in marks} == before
    board = json.loads(res.stdout)
    assert board["best"] == search["board"]["best"] and "started" not in res.stderr


def test_the_defaults_win_within_one_standard_error_of_the_best():
    from elastic_control.metrics import auc_standard_error
    from elastic_control.tuning.leaderboard import best_row
    from elastic_control.tuning.space import product_defaults

    assert auc_standard_error(0.75, 100, 100) == pytest.approx(0.0344, abs=1e-4)  # Hanley and McNeil's table
    defaults = json.loads(json.dumps(product_defaults(2)))

    def row(name, auc, settings, examples):
        validation = {"auc": auc, "positives": examples // 4, "examples": examples}
        return {"candidate": name, "trial": int(name), "state": "done", "validation": validation, "settings": settings}

    for examples, winner in ((400, "000"), (40_000, "001")):  # SE 0.026 and 0.0026 at AUC 0.75
        rows = [row("001", 0.75, {**defaults, "model": "dcn"}, examples), row("000", 0.74, defaults, examples)]
        chosen, why = best_row(rows, train_hours=2)
        assert chosen["candidate"] == winner, (examples, why)
    rows = [row("001", 0.75, {**defaults, "model": "dcn"}, 400)]  # no defaults among them: the best AUC
    assert best_row(rows, train_hours=2)[0]["candidate"] == "001"


def test_refit_is_needed_only_where_candidates_trained_on_less_than_the_window(tmp_path):
    from elastic_control.config.data_config import load_data_config
    from elastic_control.tuning.split import prepare_split

    (tmp_path / "data.config").write_text(
        'export START_DATE_HR=20191221/00\nexport END_DATE_HR=20191221/03\nexport DATASET_PATH="/data"\n'
    )
    config = load_data_config(tmp_path / "data.config")
    outside = prepare_split(config=config, output=tmp_path / "a", validation="20191221/04")
    assert outside.refit_reason is None and outside.train_hours == 4
    at_end = prepare_split(config=config, output=tmp_path / "b", validation="20191221/03")
    assert at_end.train_hours == 3 and "trimmed" in at_end.refit_reason
    assert at_end.window_values["DATASET_PATH"] == "/data" and at_end.window_end == config.end


def test_validation_hours_inside_the_window_are_refused(search):
    res = _run(search["root"], *_tune_args("out-bad"), "--validation", "20191221/00..20191221/01")
    assert res.returncode == 2
    assert "no candidate trains on them" in res.stderr


def test_apply_without_a_search_names_the_missing_leaderboard(tmp_path):
    res = _run(tmp_path, "tune", "--output", "nowhere", "--apply")
    assert res.returncode == 2 and "leaderboard.json" in res.stderr


def test_kube_plan_renders_each_candidate_as_volcano_jobs(tmp_path):
    from helpers_kube import EXAMPLE_DATA_CONFIG, render_plan

    from elastic_control.tuning.search import kube_plan, render_for_kube

    plan, _ = render_plan(tmp_path / "state", queue="research")
    plan = kube_plan(str(tmp_path / "state"))
    assert plan is not None
    rendered = render_for_kube(
        plan, data_config=str(EXAMPLE_DATA_CONFIG), output=str(tmp_path / "out"), validation="20191221/01", candidates=3
    )
    assert len(rendered) == 3
    import yaml

    job = yaml.safe_load(rendered[1]["training"].read_text())  # the deepfm seed point
    assert job["kind"] == "Job" and job["spec"]["queue"] == "research"
    assert job["metadata"]["name"] == f"{plan.job_name}-t001"
    trainer = next(t for t in job["spec"]["tasks"] if t["name"] == "trainer")
    entry = trainer["template"]["spec"]["containers"][0]["command"][-1]
    assert "exec elastic-control role --model deepfm" in entry and "--hidden 256,256" in entry
    assert 'END_DATE_HR="20191221/00"' in entry and "ELASTIC_CTR_DATA_CONFIG=" in entry
    env = {e["name"]: e.get("value") for e in trainer["template"]["spec"]["containers"][0]["env"]}
    assert env["MODEL_PATH"].endswith("/001/models")
    workers = yaml.safe_load(rendered[1]["eval_workers"].read_text())
    command = workers["spec"]["tasks"][0]["template"]["spec"]["containers"][0]["command"][-1]
    assert f"{env['MODEL_PATH']}/pass-20191221-00" in command and "--start 20191221/01" in command


def test_kube_plan_needs_validation_hours(tmp_path):
    from helpers_kube import EXAMPLE_DATA_CONFIG, render_plan

    from ctr_foundation.errors import UsageError
    from elastic_control.tuning.search import kube_plan, render_for_kube

    render_plan(tmp_path / "state")
    with pytest.raises(UsageError, match="--validation"):
        render_for_kube(
            kube_plan(str(tmp_path / "state")),
            data_config=str(EXAMPLE_DATA_CONFIG),
            output=str(tmp_path / "out"),
            validation=None,
            candidates=1,
        )


def test_mlflow_gets_a_parent_run_and_a_child_per_candidate(search, tmp_path):
    from mlflow.tracking import MlflowClient

    from elastic_control.tuning import tracking

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    parent = tracking.record(search["board"], output=search["out"], uri=uri)
    assert parent and tracking.record(search["board"], output=search["out"], uri=uri) == parent  # resumed: same
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(tracking.EXPERIMENT).experiment_id
    children = client.search_runs([experiment], filter_string=f"tags.`mlflow.parentRunId` = '{parent}'")
    assert sorted(r.info.run_name for r in children) == ["candidate-000", "candidate-002"]
    best = search["board"]["best"]
    assert client.get_run(parent).data.metrics["best_auc"] == pytest.approx(best["validation"]["auc"])


def test_a_search_folder_keeps_its_inputs(search):
    res = _run(search["root"], *_tune_args(), "--validation", "20191221/01")
    assert res.returncode == 2 and "search of another validation" in res.stderr


def test_each_pass_reports_its_loss_at_the_hours_trained_so_far(tmp_path):
    from ctr_foundation.records import DonefileEntry, append_donefile, utc_now
    from elastic_control.tuning.candidates import CANDIDATE_FILE, CandidateFolder
    from elastic_control.tuning.study import _report_passes

    folder = CandidateFolder.of(tmp_path, 3)
    folder.models.mkdir(parents=True)
    (folder.path / CANDIDATE_FILE).write_text(json.dumps({"train_start": "20191221/00", "settings": {}}))

    class Trial:
        reports: list = []

        def report(self, value, step):
            self.reports.append((step, value))

    trial, reported = Trial(), set()
    assert _report_passes(trial, folder, reported) is None
    for name, start, end, loss in (("pass-20191221-01", "00", "01", 0.5), ("pass-20191221-03", "02", "03", 0.4)):
        window = {"start": f"20191221/{start}", "end": f"20191221/{end}"}
        append_donefile(folder.models, DonefileEntry(name, name, window, utc_now(), {"logloss": loss}))
    assert _report_passes(trial, folder, reported) == 4
    assert trial.reports == [(2, -0.5), (4, -0.4)]  # negated: the study maximises
    assert _report_passes(trial, folder, reported) is None  # each pass once


@pytest.mark.slow
def test_a_killed_trainer_costs_its_candidate_one_attempt(tmp_path):
    """kill -9 of a candidate's trainer: the job runs again, resumes after its last pass, the candidate finishes."""
    import psutil

    (tmp_path / "slot.conf").write_text("".join(f"{s}\n" for s in range(1, 6)))
    assert (
        _run(
            tmp_path, "data", "synth", "--output", "data", "--hours", "3", "--lines-per-hour", "2500", "-s", "slot.conf"
        ).returncode
        == 0
    )
    (tmp_path / "data.config").write_text(
        f'export START_DATE_HR=20191221/00\nexport END_DATE_HR=20191221/02\nexport DATASET_PATH="{tmp_path / "data"}"\n'
    )
    args = ["tune", "-f", "data.config", "-s", "slot.conf", "--candidates", "1", "--max-epochs-cap", "2"]
    candidate = tmp_path / "out" / "candidates" / "000"
    try:
        proc = subprocess.Popen(
            [PYTHON, "-m", "elastic_control", *args, "--output", "out", "--no-references"],
            cwd=tmp_path,
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(lambda: (candidate / "models" / "donefile").exists(), timeout=300, what="the first pass")

        def trainer():
            for p in processes_under(tmp_path):
                try:
                    if p.environ().get("TRAINING_ROLE") == "TRAINER":
                        return p
                except psutil.Error:
                    continue
            return None

        victim = wait_until(trainer, timeout=60, what="a running trainer")
        victim.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=600) == 0
        result = json.loads((candidate / "result.json").read_text())
        assert result["attempts"] == 2 and result["passes"] == 3
    finally:
        kill_everything_under(tmp_path)


def test_a_time_budget_starts_no_candidate_after_it(search):
    # The budget runs out while the first candidate trains: it finishes and is judged, no other starts.
    res = _run(search["root"], *_tune_args("out-budget"), "--candidates", "3", "--timeout", "1", "--json")
    assert res.returncode == 0, res.stderr
    board = json.loads(res.stdout)
    assert board["budget"] == {"candidates": 3, "finished": 1}
    assert [c["state"] for c in board["candidates"]] == ["done"] and board["best"]["candidate"] == "000"
    assert "time budget spent: 1 of 3" in res.stderr
    # The budget also stops the refit: best.pass is the judged candidate's.
    assert board["best"]["refit"] is None and board["best"]["pass"] == board["best"]["judged_pass"]
    assert "not retrained on the whole window" in res.stderr


def test_the_training_window_is_searched_for_hourly_passes_only():
    import optuna

    from elastic_control.tuning.space import hyperparameters, suggest

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = set()
    for _ in range(60):
        trial = study.ask()
        settings = suggest(trial, train_hours=4)
        study.tell(trial, 0.5)
        seen.add((settings["pass_hours"] == 1, settings["window_hours"]))
        assert hyperparameters(settings).window_hours == settings["window_hours"]
    assert {w for hourly, w in seen if not hourly} == {1}  # a pass over several hours has no window
    assert {w for hourly, w in seen if hourly} == {1, 2, 4}
