"""Render a cluster evaluation: W worker pods scoring shares of a window, then one merge.

``templates/eval-job.yaml.j2`` holds both Volcano jobs (see its header for why
there are two). This module builds the command lines every pod runs and
writes the rendered YAML into ``STATE/eval/RUN/`` (never into
``STATE/manifests/``, which ``-a`` applies wholesale). The run name is a hash
of the evaluation's flags unless given, so submitting the same evaluation again
lands in the same partials folder and reuses every complete share.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from ctr_foundation.atomic import atomic_write_text
from ctr_foundation.errors import UsageError
from elastic_control.config.data_config import format_slot, parse_slot
from elastic_control.kube import constants as k
from elastic_control.kube.render import (
    RenderInputs,
    _Dumper,
    _environment,
    _Loader,
    build_context,
    finish_documents,
    pod_model_path,
)
from elastic_control.kube.volcano_rules import volcano_job_problems

TEMPLATE = "eval-job.yaml.j2"
EVAL_DIR = "eval"  # STATE/eval/RUN/ holds the rendered jobs
WORKERS_FILE = "10-eval-workers.yaml"
MERGE_FILE = "20-eval-merge.yaml"
POD_EVAL_ROOT = f"{k.SHARED_MOUNT}/eval"  # RUN/partials and RUN/out live on the shared claim
POD_DATA_CONFIG = f"{k.CONFIG_MOUNT}/data.config"
MAX_WORKERS = 512  # as `eval --workers`; keeps JOB-eval-RUN-worker-I within 63
MAX_RETRY = 3
TTL_SECONDS = 24 * 3600  # finished jobs (and their pod logs) stay a day, then Volcano removes them
_RUN_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_PASS_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class EvalJobRequest:
    """What to evaluate on the cluster; every field becomes a flag of every worker."""

    model: str  # pass name under the pods' MODEL_PATH, or an absolute path in the pods
    workers: int
    baseline: str | None = None
    group_slot: int | None = None
    ndcg_k: int = 10
    start: str | None = None  # YYYYMMDD/HH; default: data.config's window
    end: str | None = None
    run: str | None = None  # default: a hash of the fields above

    def run_name(self) -> str:
        if self.run:
            return self.run
        fields = {key: value for key, value in asdict(self).items() if key != "run"}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:6]


@dataclass(frozen=True)
class EvalJobFiles:
    run: str
    workers_job: dict
    merge_job: dict
    workers_path: Path
    merge_path: Path
    partials: str  # in the pods
    output: str  # in the pods


def validate_request(request: EvalJobRequest) -> None:
    """Flag errors a user can fix, before anything is rendered."""
    if not 1 <= request.workers <= MAX_WORKERS:
        raise UsageError(f"--workers {request.workers} must be between 1 and {MAX_WORKERS}")
    for flag, value in (("--model", request.model), ("--baseline", request.baseline)):
        if value is not None and not (value.startswith("/") or _PASS_NAME.fullmatch(value)):
            raise UsageError(
                f"{flag} {value!r} must be a pass name (e.g. pass-20191221-00, looked up under the "
                "pods' MODEL_PATH) or an absolute path inside the pods"
            )
    if request.ndcg_k < 1:
        raise UsageError(f"--ndcg-k must be at least 1, got {request.ndcg_k}")
    for flag, value in (("--start", request.start), ("--end", request.end)):
        if value is not None:
            parse_slot(value, key=flag)
    if request.start and request.end and parse_slot(request.end) < parse_slot(request.start):
        raise UsageError(f"--end {request.end} is before --start {request.start}")
    if request.run is not None and (not _RUN_NAME.fullmatch(request.run) or len(request.run) > 12):
        raise UsageError(
            f"--run {request.run!r} must be a short name: at most 12 lower-case letters, digits and '-' "
            "(it becomes part of pod names)"
        )


def _normal_slot(text: str) -> str:
    """``YYYYMMDD/HH`` or ``YYYYMMDD/HHMM`` (sub-hour data), validated and written back the same way."""
    return format_slot(parse_slot(text), minutes=len(text.strip()) > len("YYYYMMDD/HH"))


def pod_pass_path(name_or_path: str, model_path: str) -> str:
    """A pass as the pods see it: names are looked up under the pods' MODEL_PATH."""
    return name_or_path if name_or_path.startswith("/") else f"{model_path.rstrip('/')}/{name_or_path}"


def worker_entry(request: EvalJobRequest, *, model_path: str, partials: str) -> str:
    """The worker's shell line: identical for every worker except the share index the shell fills in."""
    args = ["--model", pod_pass_path(request.model, model_path)]
    if request.baseline:
        args += ["--baseline", pod_pass_path(request.baseline, model_path)]
    args += ["-f", POD_DATA_CONFIG]
    if request.group_slot is not None:
        args += ["--group-slot", str(request.group_slot), "--ndcg-k", str(request.ndcg_k)]
    if request.start:
        args += ["--start", _normal_slot(request.start)]
    if request.end:
        args += ["--end", _normal_slot(request.end)]
    quoted = " ".join(shlex.quote(a) for a in args)
    shard = f'"${{VC_TASK_INDEX:?the Volcano env plugin did not set VC_TASK_INDEX}}/{request.workers}"'
    return f"exec elastic-control eval {quoted} --shard {shard} --partial-out {shlex.quote(partials)}"


def merge_entry(*, partials: str, output: str) -> str:
    # --json: the CLI reads the metrics back from this pod's log and shows them.
    return (
        f"exec elastic-control eval merge --partial-out {shlex.quote(partials)} --output {shlex.quote(output)} --json"
    )


def eval_context(plan, inputs: RenderInputs, request: EvalJobRequest) -> dict:
    """The template values: the main manifests' context plus the evaluation's names and commands."""
    validate_request(request)
    context = build_context(plan, inputs)
    run = request.run_name()
    root = f"{POD_EVAL_ROOT}/{run}"
    partials, output = f"{root}/partials", f"{root}/out"
    model_path = pod_model_path(inputs.data_config)
    context.update(
        {
            "run": run,
            "workers": request.workers,
            "max_retry": MAX_RETRY,
            "ttl_seconds": TTL_SECONDS,
            "eval_job_name": f"{plan.job_name}-eval-{run}",
            "merge_job_name": f"{plan.job_name}-merge-{run}",
            "worker_entry": worker_entry(request, model_path=model_path, partials=partials),
            "merge_entry": merge_entry(partials=partials, output=output),
            "eval_partials": partials,
            "eval_output": output,
        }
    )
    return context


def render_eval_job(plan, inputs: RenderInputs, request: EvalJobRequest, state_dir: str | Path) -> EvalJobFiles:
    """Render both jobs, check them against Volcano's webhook rules, write them to STATE/eval/RUN/."""
    import jinja2

    context = eval_context(plan, inputs, request)
    try:
        text = _environment().get_template(TEMPLATE).render(**context)
    except jinja2.TemplateNotFound as e:
        raise UsageError(f"template {e.name} is missing (set ELASTIC_CTR_TEMPLATE_DIR)") from e
    docs = finish_documents([d for d in yaml.load_all(text, Loader=_Loader) if d], inputs.options)
    if len(docs) != 2:
        raise UsageError(f"{TEMPLATE} rendered {len(docs)} documents; expected the worker job and the merge job")
    for doc in docs:
        problems = volcano_job_problems(doc)
        if problems:
            raise UsageError(
                f"Volcano would refuse {doc['metadata']['name']}: "
                + "; ".join(problems)
                + (" or a shorter --run" if any("pod name" in p for p in problems) else "")
            )
    folder = Path(state_dir) / EVAL_DIR / context["run"]
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, doc, note in (
        (WORKERS_FILE, docs[0], "apply first"),
        (MERGE_FILE, docs[1], f"apply after {WORKERS_FILE}'s job is Completed"),
    ):
        header = f"# Rendered by `elastic-control eval submit` from the template {TEMPLATE} ({note}).\n"
        atomic_write_text(
            folder / name,
            header + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=4096),
        )
        paths.append(folder / name)
    return EvalJobFiles(
        context["run"], docs[0], docs[1], paths[0], paths[1], context["eval_partials"], context["eval_output"]
    )
