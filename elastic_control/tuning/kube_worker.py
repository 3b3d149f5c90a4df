"""One candidate on Kubernetes: its Volcano training job submitted and followed, then its evaluation jobs.

    python -m elastic_control.tuning.kube_worker DIR/candidates/NNN STATE_DIR

The worker process of a candidate when the plan runs on Kubernetes (the local one trains in processes of
its own: candidates.py). What it submits was rendered by tune before it started (tuning/kube.py):
``DIR/kube/NNN/training-job.yaml`` (the plan's training job under the candidate's name, with its flags and
window) and the evaluation jobs of the candidate's last pass (``STATE/eval/RUN/``), named in the
candidate's ``kube.json``. The training job is created (an older one of the same name, left by a killed
tune, is deleted first: the candidate starts again), followed until Volcano reports it Completed (its
policies restart it after a lost pod), then the evaluation runs as `eval submit` runs it; the metrics the
merge printed become ``result.json``, as a local candidate's. The pass stays on the shared claim.

While the job trains, the complete passes its trainer 0 publishes on the job (training/job_progress.py) go
into the candidate's ``passes.json``, where tune's pruner reads their held-out losses. Stopped by tune
(SIGTERM: pruned, or tune itself ends), the worker deletes the jobs it submitted, so a pruned candidate
frees its place in the queue; a killed worker leaves its job, which the next tune deletes and starts again.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import yaml

from ctr_foundation.atomic import atomic_write_json
from ctr_foundation.errors import ElasticControlError
from elastic_control.kube import adaptor
from elastic_control.kube.deploy import connect
from elastic_control.kube.eval_job import EvalJobFiles
from elastic_control.kube.eval_run import submit_eval_job, wait_for_job
from elastic_control.kube.objects import apply_volcano_job, delete_volcano_job
from elastic_control.plan import load_plan
from elastic_control.tuning.candidates import HEADLINE, PASSES_FILE, RESULT_FILE, CandidateFolder, run_worker

KUBE_FILE = "kube.json"  # {"training", "eval_workers", "eval_merge", "pass"}: what tune rendered for it
TRAIN_TIMEOUT = 24 * 3600.0  # a candidate's job may wait in the queue behind others: tune's --timeout rules
EVAL_TIMEOUT = 6 * 3600.0


def _load(path: str) -> dict:
    (doc,) = [d for d in yaml.safe_load_all(Path(path).read_text()) if d]
    return doc


def run_candidate(folder: CandidateFolder, state_dir: str, log=print, poll: float = 2.0) -> dict:
    """Submit and follow the candidate's jobs; write and return result.json. Stopped (KeyboardInterrupt),
    it deletes the jobs it submitted first."""
    rendered = folder.read(KUBE_FILE)
    plan = load_plan(state_dir)
    connect(plan)
    submitted: list[str] = []
    try:
        return _follow(folder, rendered, plan, submitted, log, poll)
    except KeyboardInterrupt:
        for name in submitted:
            try:
                delete_volcano_job(name, plan.namespace)
                log(f"Volcano job {plan.namespace}/{name} deleted")
            except (ElasticControlError, adaptor.ApiException) as e:  # stopping: say so, delete the others
                log(f"Volcano job {plan.namespace}/{name} not deleted: {e}")
        raise


def _follow(folder: CandidateFolder, rendered: dict, plan, submitted: list[str], log, poll: float) -> dict:
    job = _load(rendered["training"])
    name, tasks = job["metadata"]["name"], job["spec"]["tasks"]
    started = time.monotonic()
    submitted.append(name)
    log(f"Volcano job {plan.namespace}/{name} {apply_volcano_job(job)}")
    restarts = [0]
    published: list = []

    def watch(progress) -> None:
        if progress.restarts > restarts[0]:
            restarts[0] = progress.restarts
            log(f"Volcano restarted {name} (restart {progress.restarts}): a pod was lost")
        passes = (progress.trainer_progress or {}).get("passes")
        if isinstance(passes, list) and passes != published:
            published[:] = passes
            atomic_write_json(folder.path / PASSES_FILE, passes)

    total = sum(int(t.get("replicas", 1)) for t in tasks)
    wait_for_job(name, plan.namespace, total, timeout=TRAIN_TIMEOUT, poll=poll, on_progress=watch)
    train_seconds = time.monotonic() - started
    log(f"{name} Completed in {train_seconds:.0f}s; judging {rendered['pass']}")
    files = EvalJobFiles(
        run=rendered["run"],
        workers_job=_load(rendered["eval_workers"]),
        merge_job=_load(rendered["eval_merge"]),
        workers_path=Path(rendered["eval_workers"]),
        merge_path=Path(rendered["eval_merge"]),
        partials=rendered.get("partials", ""),
        output=rendered.get("output", ""),
    )
    t = time.monotonic()
    submitted += [files.workers_job["metadata"]["name"], files.merge_job["metadata"]["name"]]
    metrics = submit_eval_job(
        files,
        namespace=plan.namespace,
        queue=plan.queue,
        deployment=plan.job_name,
        timeout=EVAL_TIMEOUT,
        poll=poll,
        progress=log,
    )
    model = metrics["model"]
    result = {
        "pass": rendered["pass"],
        "passes": None,  # on the shared claim: the annotation lists only the last MAX_PASSES of them
        "attempts": 1 + restarts[0],
        "validation": {k: model.get(k) for k in HEADLINE},
        "examples_per_sec": None,
        "train_seconds": round(train_seconds, 1),
        "eval_seconds": round(time.monotonic() - t, 1),
        "job": name,
    }
    atomic_write_json(folder.path / RESULT_FILE, result)
    return result


def main(argv: list[str]) -> int:
    # tune stops a worker with SIGTERM: as Ctrl-C, so that the jobs it submitted are deleted first
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    folder = CandidateFolder(Path(argv[0]))
    return run_worker(folder, lambda log: run_candidate(folder, argv[1], log))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
