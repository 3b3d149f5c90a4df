"""One candidate: its folder, its data.config, and the worker process that trains and judges it.

    DIR/candidates/NNN/
      candidate.json   what to run (settings, data.config, job size); written by tune before the worker starts
      data.config      the training window, MODEL_PATH=models, PASS_HOURS of the candidate
      models/          MODEL_PATH: real passes and their donefile
      worker.log       the worker's own output (the roles log to models/logs/)
      result.json      the done marker, written last: the judged pass, its validation metrics, speed, time
      pruned.json      tune stopped it early (successive halving); no result
      passes.json      on Kubernetes: the complete passes its job's trainer 0 published (tuning/kube_worker.py),
                       since models/ is then on the shared claim

The worker (``python -m elastic_control.tuning.candidates DIR/candidates/NNN``) runs the product's local
training job (local/train_job.py), trying again after a lost role (the new job resumes after the last
complete pass, so a killed trainer or pserver costs at most that pass), then the product's evaluation
(evaluation/parallel.py) of the last pass on the validation lines. It dies with tune (parent-death signal);
its job's roles die with it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ctr_foundation.atomic import atomic_write_json, atomic_write_text
from ctr_foundation.errors import ComponentError, ElasticControlError
from ctr_foundation.records import read_donefile
from elastic_control.config.data_config import load_data_config
from elastic_control.evaluation.parallel import evaluate
from elastic_control.evaluation.shares import EvalSpec
from elastic_control.local.components import training_window
from elastic_control.local.process import start_process
from elastic_control.local.train_job import run_training_job
from elastic_control.training.cli import hyperparameter_args
from elastic_control.tuning.space import hyperparameters
from elastic_control.tuning.split import config_text

CANDIDATE_FILE = "candidate.json"
RESULT_FILE = "result.json"
PRUNED_FILE = "pruned.json"
FAILED_FILE = "failed.json"
PASSES_FILE = "passes.json"
WORKER_LOG = "worker.log"
TRAIN_ATTEMPTS = 3  # a job that lost a role runs again, resuming after its last complete pass


@dataclass(frozen=True)
class CandidateFolder:
    path: Path

    @classmethod
    def of(cls, output: Path, number: int) -> CandidateFolder:
        return cls(Path(output) / "candidates" / f"{number:03d}")

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def models(self) -> Path:
        return self.path / "models"

    @property
    def data_config(self) -> Path:
        return self.path / "data.config"

    def read(self, name: str) -> dict | None:
        try:
            return json.loads((self.path / name).read_text())
        except (OSError, ValueError):
            return None

    @property
    def result(self) -> dict | None:
        return self.read(RESULT_FILE)

    @property
    def spec(self) -> dict | None:
        return self.read(CANDIDATE_FILE)

    def passes(self) -> list[dict]:
        """Its complete passes so far, each ``{"pass", "end", "logloss"}``: from its donefile, or on
        Kubernetes from what its job published (PASSES_FILE)."""
        entries = read_donefile(self.models)
        if entries:
            return [e.summary() for e in entries]
        published = self.read(PASSES_FILE)
        return [p for p in published if isinstance(p, dict)] if isinstance(published, list) else []


def write_candidate(
    folder: CandidateFolder,
    *,
    number: int,
    settings: dict,
    train_values: dict,
    train_window: tuple[str, str],
    validation_config: Path | None,
    trainers: int,
    pservers: int,
    max_epochs_cap: int | None,
    refit_of: int | None = None,
) -> None:
    """The candidate's data.config (training window, its MODEL_PATH and PASS_HOURS) and candidate.json.
    ``validation_config`` None: trained, not judged (the winner's refit; ``refit_of``: the winner's trial)."""
    folder.path.mkdir(parents=True, exist_ok=True)
    values = {
        **train_values,
        "START_DATE_HR": train_window[0],
        "END_DATE_HR": train_window[1],
        "ONLINE": "0",
        "MODEL_PATH": str(folder.models.resolve()),
        "PASS_HOURS": str(settings.get("pass_hours", 1)),
    }
    atomic_write_text(folder.data_config, config_text(values))
    atomic_write_json(
        folder.path / CANDIDATE_FILE,
        {
            "number": number,
            "train_start": train_window[0],
            "settings": settings,
            "validation_config": None if validation_config is None else str(Path(validation_config).resolve()),
            "trainers": trainers,
            "pservers": pservers,
            "max_epochs_cap": max_epochs_cap,
            **({} if refit_of is None else {"refit_of": refit_of, "train_end": train_window[1]}),
        },
    )


def start_worker(folder: CandidateFolder, slot_conf: Path):
    """The worker process of a candidate (its own session, ended by the kernel if tune dies)."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}  # tune records candidates itself
    argv = [sys.executable, "-m", "elastic_control.tuning.candidates", str(folder.path), str(Path(slot_conf).resolve())]
    return start_process(argv, env=env, log_path=folder.path / WORKER_LOG)


def train_and_judge(folder: CandidateFolder, slot_conf: str, log=print) -> dict:
    """Train the candidate (resuming what an earlier attempt left), judge its last pass (unless it has no
    validation lines: the winner's refit), write result.json."""
    spec = folder.spec
    hyper = hyperparameters(spec["settings"], max_epochs_cap=spec.get("max_epochs_cap"))
    config = load_data_config(folder.data_config)
    started = time.monotonic()
    for attempt in range(1, TRAIN_ATTEMPTS + 1):
        try:
            run_training_job(
                trainers=spec["trainers"],
                pservers=spec["pservers"],
                data_config=str(folder.data_config),
                slot_conf=slot_conf,
                model_path=str(folder.models),
                role_args=hyperparameter_args(hyper),
                on_line=lambda name, line: log(line),
                window=training_window(config),
            )
            break
        except ComponentError as e:
            log(f"training attempt {attempt} failed: {e}")
            if attempt == TRAIN_ATTEMPTS:
                raise
    train_seconds = time.monotonic() - started
    entries = read_donefile(folder.models)
    last = entries[-1].path
    t = time.monotonic()
    validation = None
    if spec["validation_config"] is not None:
        validation = judge_pass(last, spec["validation_config"], partials=folder.path / "eval-partials")
    result = {
        "pass": last,
        "passes": len(entries),
        "attempts": attempt,
        "validation": validation,
        "examples_per_sec": examples_per_second(entries),
        "train_seconds": round(train_seconds, 1),
        "eval_seconds": round(time.monotonic() - t, 1),
    }
    atomic_write_json(folder.path / RESULT_FILE, result)
    return result


def examples_per_second(entries) -> float | None:
    """Training speed over every pass: all examples over all pass times (each pass's donefile metrics)."""
    examples = seconds = 0.0
    for e in entries:
        n, rate = e.metrics.get("examples"), e.metrics.get("examples_per_sec")
        if n and rate:
            examples, seconds = examples + n, seconds + n / rate
    return round(examples / seconds, 1) if seconds else None


HEADLINE = ("auc", "logloss", "calibration", "examples", "positives", "mean_predicted_ctr", "observed_ctr")


def judge_pass(pass_dir: str, validation_config: str, *, partials: Path | None = None, workers: int = 1) -> dict:
    """The product's evaluation of a pass on the validation lines: AUC, log loss, calibration, counts."""
    spec = EvalSpec.create(model=pass_dir, data_config=validation_config, shares=workers)
    result = evaluate(spec, workers=workers, partials=partials)
    try:
        model = result.metrics["model"]
        return {k: model.get(k) for k in HEADLINE}
    finally:
        result.cleanup()


def run_worker(folder: CandidateFolder, work) -> int:
    """A candidate worker's process: ``work(log)`` (which writes result.json), its end said in one line and
    as an exit code; a failure's reason in failed.json for tune's log and leaderboard."""

    def log(line: str) -> None:
        print(line, flush=True)

    try:
        result = work(log)
    except KeyboardInterrupt:  # tune stopped it (pruned, or tune itself ended): no result
        log("stopped")
        return 130
    except ElasticControlError as e:
        atomic_write_json(folder.path / FAILED_FILE, {"reason": str(e)})
        log(f"failed: {e}")
        return 1
    log(f"done: {json.dumps(result, sort_keys=True)}")
    return 0


def main(argv: list[str]) -> int:
    import pyarrow  # noqa: F401  (before paddle, which the evaluation loads)

    folder = CandidateFolder(Path(argv[0]))
    return run_worker(folder, lambda log: train_and_judge(folder, argv[1], log))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
