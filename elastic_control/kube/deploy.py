"""The Kubernetes side of -a, status and delete for one plan (KubeBackend calls these).

``apply_plan``: target check, preflight, converge every rendered object
(kube/converge.py), prune what is no longer rendered, wait for the pods and
explain what keeps them from starting (kube/pods.py, kube/diagnose.py).
"""

from __future__ import annotations

import sys
import time

from ctr_foundation.env_vars import APPLY_TIMEOUT
from ctr_foundation.errors import ApplyError, UsageError
from ctr_foundation.names import MANIFEST_DIR
from elastic_control.console import console, done, failed, info, warn
from elastic_control.kube import adaptor
from elastic_control.kube import constants as k
from elastic_control.kube.converge import converge_object, prune
from elastic_control.kube.diagnose import missing_pod_findings
from elastic_control.kube.objects import delete_labelled, delete_volcano_job, describe, read_volcano_job
from elastic_control.kube.options import KubeOptions
from elastic_control.kube.pods import count_started, explain_pod, fatal_reason, pod_events
from elastic_control.kube.preflight import preflight
from elastic_control.kube.render import load_manifests
from elastic_control.kube.target import check_target


def plan_options(plan) -> KubeOptions:
    return KubeOptions.from_json(getattr(plan, "kube", None))


def connect(plan) -> KubeOptions:
    """Load the plan's kubeconfig context and refuse if it now points at another cluster than at -r."""
    options = plan_options(plan)
    adaptor.use_context(options.context)
    check_target(options.context, options.cluster_server)
    return options


def expected_pods(plan) -> int:
    """Pods -a waits for: the job's pservers and trainers, MLflow, file server, cube shards, transfer, serving."""
    r = plan.resources
    return r.pservers + r.trainers + 1 + 1 + r.cube_shards + 1 + plan_options(plan).serving_replicas


def apply_plan(plan, *, dry_run: str | None = None) -> bool:
    """Converge the cluster on the plan; True when something was really applied (not a dry run)."""
    if dry_run not in (None, "client", "server"):
        raise UsageError(f"--dry-run {dry_run!r} must be client or server")
    docs = load_manifests(plan.state_path / MANIFEST_DIR)
    options = plan_options(plan)
    if dry_run == "client":
        for doc in docs:
            sys.stdout.write(f"{describe(doc)} (would be created, or updated if its spec changed)\n")
        info(f"dry run: nothing sent to the cluster; the manifests are in {plan.state_path / MANIFEST_DIR}/")
        return False
    connect(plan)
    preflight(namespace=plan.namespace, queue=plan.queue, job_progress=options.job_progress)
    done(f"preflight: namespace {plan.namespace}, Volcano ({k.VOLCANO_JOB_CRD}), queue {plan.queue} Open")
    for warning in options.warnings:  # what -r warned about, once more before it matters
        warn(warning)
    server = dry_run == "server"
    changes = [converge_object(doc, dry_run=server) for doc in docs]
    changes += prune(docs, plan.namespace, plan.job_name, dry_run=server)
    for change in changes:
        done(f"{change.describe()}{' (server dry run)' if server else ''}")
    if server:
        return False
    untouched = sum(c.action == "unchanged" for c in changes)
    if untouched == len(docs) and not any("pruned" in c.action for c in changes):
        done("nothing changed: the cluster already runs this plan")
    return True


def _job_finished(plan) -> str | None:
    job = read_volcano_job(plan.job_name, plan.namespace)
    phase = (((job or {}).get("status") or {}).get("state") or {}).get("phase")
    return phase if phase in ("Completed", "Failed", "Aborted", "Terminated") else None


def wait_for_plan(plan, *, timeout: float | None = None) -> None:
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    expected = expected_pods(plan)
    timeout = APPLY_TIMEOUT.get() if timeout is None else timeout
    selector = f"{k.LABEL_INSTANCE}={plan.job_name}"
    training = plan.resources.pservers + plan.resources.trainers
    deadline = time.monotonic() + timeout
    findings: list = []
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("pods starting", total=expected)
        last_look = 0.0
        while True:
            finished = _job_finished(plan)
            count = count_started(plan.namespace, selector, expected, skip_job=plan.job_name if finished else None)
            started = count.started + (training if finished else 0)
            progress.update(task, completed=min(started, expected))
            if started >= expected and not count.stuck:
                break
            if any(fatal_reason(p) for p in count.stuck):
                break
            now = time.monotonic()
            if started < expected and now - last_look >= 5:  # pods that do not exist: ask their owners why
                last_look = now
                findings = missing_pod_findings(plan.namespace, plan.job_name, plan.job_name)
                if any(f.fatal for f in findings):
                    break
            if now >= deadline:
                break
            time.sleep(1.0)
    if started >= expected and not count.stuck:
        note = f"; the training job is {finished}" if finished else ""
        done(
            f"{started}/{expected} pods running in namespace {plan.namespace}{note}; "
            "follow training with `elastic-control -l --follow`"
        )
        return
    r = plan.resources
    reasons = [
        explain_pod(p, pod_events(plan.namespace, p.metadata.name), cpu=r.cpu, mem=r.mem)
        for p in sorted(count.stuck, key=lambda p: (fatal_reason(p) is None, p.metadata.name))
    ]
    missing = expected - started - len(count.stuck)
    findings = findings or missing_pod_findings(plan.namespace, plan.job_name, plan.job_name)
    reasons += [f.message for f in sorted(findings, key=lambda f: not f.fatal)]
    if missing > 0 and not findings:
        reasons.append(f"{missing} pod(s) not created yet (no event explains why)")
    for reason in reasons[1:]:
        failed(reason)
    if any(fatal_reason(p) for p in count.stuck):
        why = "a pod cannot start"
    elif any(f.fatal for f in findings):
        why = "pods are refused"
    else:
        why = f"not running after {timeout:g}s"
    raise ApplyError(f"{started}/{expected} pods running, {why}: {reasons[0] if reasons else 'unknown'}")


def delete_plan(plan) -> list[str]:
    """Delete the job and every object of the instance but the claims; returns what was deleted."""
    connect(plan)
    deleted = []
    if delete_volcano_job(plan.job_name, plan.namespace, wait=120.0):
        done(f"Volcano job {plan.namespace}/{plan.job_name} deleted")
        deleted.append(f"Volcano job {plan.namespace}/{plan.job_name}")
    for what in delete_labelled(plan.namespace, plan.job_name):
        done(f"{what} deleted")
        deleted.append(what)
    info(
        f"persistent volume claims (models, files, MLflow runs) are kept; remove them with "
        f"`kubectl delete pvc -n {plan.namespace} -l app.kubernetes.io/instance={plan.job_name}`"
    )
    return deleted
