"""Candidates on Kubernetes: each one the plan's Volcano training job under its own name, each evaluation
the plan's Volcano evaluation job, rendered from the existing templates into DIR/kube/NNN/.

A candidate's job is the plan's training job (same template, queue, image, resources, claim) with:
its own name (``JOB-tNNN``, so its pods and endpoints are its own), MODEL_PATH on the shared claim under
``tune/SEARCH/NNN/models``, and a data.config of its own (the training window, its PASS_HOURS) that the
entry line writes onto the claim before ``elastic-control role`` starts with the candidate's flags. Its
evaluation is `eval submit`'s job for the candidate's last pass on the validation hours.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import sys
from pathlib import Path

import yaml

from ctr_foundation.atomic import atomic_write_text
from ctr_foundation.errors import UsageError
from ctr_foundation.pass_format import pass_name
from elastic_control.kube import constants as k
from elastic_control.kube.eval_job import EvalJobRequest, render_eval_job
from elastic_control.kube.options import KubeOptions
from elastic_control.kube.render import (
    RenderInputs,
    _Dumper,
    _environment,
    _Loader,
    build_context,
    finish_documents,
    pod_data_config,
    validate_job_name,
)
from elastic_control.kube.volcano_rules import volcano_job_problems
from elastic_control.local.process import start_process
from elastic_control.plan import TRAINING_ARGS_KEY
from elastic_control.tuning.apply import training_args
from elastic_control.tuning.candidates import WORKER_LOG
from elastic_control.tuning.kube_worker import KUBE_FILE
from elastic_control.tuning.space import seed_points, suggest

KUBE_DIR = "kube"
TRAINING_TEMPLATE = "training_job.yaml.j2"


def _inputs(plan):
    return RenderInputs(
        token=plan.token(),
        data_config=plan.data_config(),
        service_type=plan.service_type,
        options=KubeOptions.from_json(plan.kube),
    )


def search_name(output: Path) -> str:
    """A short stable name of a search folder (pod paths and evaluation run names)."""
    return "t" + hashlib.sha256(str(Path(output).resolve()).encode()).hexdigest()[:4]


def pod_candidate_root(search: str, number: int) -> str:
    return f"{k.SHARED_MOUNT}/tune/{search}/{number:03d}"


def _entry(command: list[str], *, root: str, data_config_text: str) -> list[str]:
    """A role's command, first writing the candidate's data.config onto the claim (atomically: the pservers
    and trainers all write the same text)."""
    config = f"{root}/data.config"
    path, staged = shlex.quote(config), shlex.quote(config + ".") + "$$"
    prelude = (
        f"mkdir -p {shlex.quote(root)} && printf '%s' {shlex.quote(data_config_text)} > {staged} "
        f"&& mv {staged} {path} && export ELASTIC_CTR_DATA_CONFIG={path}; "
    )
    if command[:2] != ["/bin/sh", "-c"]:  # the prelude needs the entry shell: fail loudly instead
        raise UsageError(f"the training job's roles no longer run through an entry shell: {command!r}")
    return [*command[:2], prelude + command[2]]


def candidate_job(plan, *, output: Path, number: int, settings: dict, split, inputs=None) -> dict:
    """The Volcano training job of one candidate, rendered, finished and checked like the plan's own."""
    import dataclasses

    inputs = inputs or _inputs(plan)
    job = f"{plan.job_name}-t{number:03d}"
    validate_job_name(job)
    root = pod_candidate_root(search_name(output), number)
    model_path = f"{root}/models"
    config = dataclasses.replace(
        inputs.data_config, start=split.train_start, end=split.train_end, pass_hours=int(settings.get("pass_hours", 1))
    )
    values = {
        **config.values,
        "START_DATE_HR": split.train_start.strftime("%Y%m%d/%H"),
        "END_DATE_HR": split.train_end.strftime("%Y%m%d/%H"),
        "PASS_HOURS": str(config.pass_hours),
        "ONLINE": "0",
    }
    text = pod_data_config(dataclasses.replace(config, values=values), plan.hdfs_address, model_path)
    # The plan's job under the candidate's name, its roles with the candidate's flags.
    candidate = dataclasses.replace(
        plan, job_name=job, extra={**plan.extra, TRAINING_ARGS_KEY: training_args(settings)}
    )
    context = build_context(candidate, inputs, model_path=model_path)
    for role in ("pserver", "trainer"):
        container = context["containers"][role]
        container["command"] = _entry(container["command"], root=root, data_config_text=text)
    rendered = _environment().get_template(TRAINING_TEMPLATE).render(**context)
    docs = [d for d in yaml.load_all(rendered, Loader=_Loader) if d and d.get("kind") == k.VOLCANO_JOB_KIND]
    if len(docs) != 1:
        raise UsageError(f"{TRAINING_TEMPLATE} rendered {len(docs)} Volcano jobs; expected one")
    (doc,) = finish_documents(docs, inputs.options)
    problems = volcano_job_problems(doc)
    if problems:
        raise UsageError(f"Volcano would refuse candidate {number:03d}'s job: " + "; ".join(problems))
    return doc


def render_candidate(plan, *, output: Path, number: int, settings: dict, split) -> dict[str, Path]:
    """DIR/kube/NNN/training-job.yaml and the evaluation jobs of the candidate's last pass (STATE/eval/RUN/):
    their paths, and where the evaluation keeps its partials and output in the pods."""
    if split.how.startswith("every "):
        raise UsageError(
            "on Kubernetes the candidates' pods read the plan's dataset, not lines held out on this machine: "
            "pass --validation START..END (hours that judge)"
        )
    inputs = _inputs(plan)
    folder = Path(output) / KUBE_DIR / f"{number:03d}"
    folder.mkdir(parents=True, exist_ok=True)
    doc = candidate_job(plan, output=output, number=number, settings=settings, split=split, inputs=inputs)
    job_path = folder / "training-job.yaml"
    atomic_write_text(
        job_path,
        f"# Rendered by `elastic-control tune` from {TRAINING_TEMPLATE}: candidate {number:03d}.\n"
        + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=4096),
    )
    validation = split.validation
    request = EvalJobRequest(
        model=f"{pod_candidate_root(search_name(output), number)}/models/{pass_name(split.train_end)}",
        workers=plan.resources.trainers,
        start=validation.start.strftime("%Y%m%d/%H"),
        end=validation.end.strftime("%Y%m%d/%H"),
        run=f"{search_name(output)}-{number:03d}",
    )
    files = render_eval_job(plan, inputs, request, plan.state_path)
    return {
        "training": job_path,
        "eval_workers": files.workers_path,
        "eval_merge": files.merge_path,
        "partials": files.partials,  # in the pods
        "output": files.output,
    }


def start_candidate(plan, folder, settings: dict, *, output: Path, split):
    """Render candidate ``folder``'s jobs and start its worker (tuning/kube_worker.py), which submits them."""
    number = int(folder.name)
    files = render_candidate(plan, output=output, number=number, settings=settings, split=split)
    atomic_write_text(Path(output) / KUBE_DIR / f"{number:03d}" / "settings.yaml", yaml.safe_dump(settings))
    record = {
        **{key: str(path) for key, path in files.items()},
        "run": f"{search_name(output)}-{number:03d}",
        "pass": f"{pod_candidate_root(search_name(output), number)}/models/{pass_name(split.train_end)}",
    }
    atomic_write_text(folder.path / KUBE_FILE, json.dumps(record, indent=1, sort_keys=True))
    argv = [sys.executable, "-m", "elastic_control.tuning.kube_worker", str(folder.path), str(plan.state_path)]
    return start_process(argv, env=dict(os.environ), log_path=folder.path / WORKER_LOG)


def render_search(plan, *, output: Path, split, candidates: int, seed: int = 0) -> list[dict[str, Path]]:
    """Every candidate's jobs: the seed points first, then points drawn from the space (with no results yet
    to learn from, the sampler draws them from the space's priors)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=seed))
    for point in seed_points(split.train_hours):
        study.enqueue_trial(point)
    rendered = []
    for number in range(candidates):
        settings = suggest(study.ask(), train_hours=split.train_hours)
        files = render_candidate(plan, output=output, number=number, settings=settings, split=split)
        atomic_write_text(Path(output) / KUBE_DIR / f"{number:03d}" / "settings.yaml", yaml.safe_dump(settings))
        rendered.append(files)
    return rendered
