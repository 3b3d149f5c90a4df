"""Submit a rendered cluster evaluation and follow it to its metrics.

Order (docs/contracts.md, "Evaluation"): preflight; the worker job is created
(an older one of the same run is deleted first, as for every Volcano job);
wait until Volcano reports it Completed (a failed worker pod is restarted by
Volcano, and only its share is computed again); then the merge job; wait; read
the merge pod's log for the metrics it printed as JSON.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ctr_foundation.errors import ApplyError, ClusterUnavailableError
from elastic_control.kube import adaptor
from elastic_control.kube import constants as k
from elastic_control.kube.eval_job import EvalJobFiles
from elastic_control.kube.logs import TERMINAL_JOB_PHASES
from elastic_control.kube.objects import apply_volcano_job, job_pods, read_volcano_job
from elastic_control.kube.pods import explain_pod, fatal_reason, pod_events
from elastic_control.kube.preflight import preflight
from elastic_control.kube.status import job_progress as published_progress

LOG_TAIL_LINES = 20


@dataclass
class JobProgress:
    """What one poll of a Volcano job saw; ``restarts`` counts Volcano's retries so far."""

    name: str
    phase: str
    total: int
    succeeded: int = 0
    running: int = 0
    failed: int = 0
    restarts: int = 0
    pods: list = field(default_factory=list)
    trainer_progress: dict | None = None  # a training job's: what trainer 0 published (kube/status.job_progress)


def check_deployment(namespace: str, job: str) -> None:
    """The evaluation pods mount the deployment's ConfigMap and shared claim: both must exist (after -a)."""
    for what, read, name in (
        ("ConfigMap", "read_namespaced_config_map", f"{job}-config"),
        ("PersistentVolumeClaim", "read_namespaced_persistent_volume_claim", f"{job}-shared"),
    ):
        with adaptor.reachable(f"reading {what} {namespace}/{name}"):
            try:
                getattr(adaptor.core(), read)(name, namespace)
            except adaptor.ApiException as e:
                if e.status == 404:
                    raise ClusterUnavailableError(
                        f"{what} {namespace}/{name} does not exist: the evaluation reads data.config and the passes "
                        f"from the deployment; run `elastic-control -a` first"
                    ) from e
                if e.status != 403:
                    raise ClusterUnavailableError(
                        f"reading {what} {namespace}/{name} failed: HTTP {e.status} {e.reason}"
                    ) from e


def job_progress(name: str, namespace: str, total: int) -> JobProgress | None:
    job = read_volcano_job(name, namespace)
    if job is None:
        return None
    status = job.get("status") or {}
    pods = [p for p in job_pods(name, namespace) if not p.metadata.deletion_timestamp]
    return JobProgress(
        name=name,
        phase=(status.get("state") or {}).get("phase") or "Pending",
        total=total,
        succeeded=sum(p.status.phase == "Succeeded" for p in pods),
        running=sum(p.status.phase == "Running" for p in pods),
        failed=sum(p.status.phase == "Failed" for p in pods),
        restarts=int(status.get("retryCount") or 0),
        pods=pods,
        trainer_progress=published_progress(job),
    )


def pod_log_tail(namespace: str, pod_name: str, lines: int = LOG_TAIL_LINES) -> list[str]:
    try:
        with adaptor.reachable(f"reading the log of pod {pod_name}"):
            return list(adaptor.stream_pod_log(pod_name, namespace, tail_lines=lines))
    except (adaptor.ApiException, ClusterUnavailableError):
        return []


def wait_for_job(
    name: str,
    namespace: str,
    total: int,
    *,
    timeout: float,
    poll: float = 2.0,
    on_progress: Callable[[JobProgress], None] | None = None,
) -> JobProgress:
    """Poll until the job is Completed; ApplyError with the reason when it fails, vanishes, or times out."""
    deadline = time.monotonic() + timeout
    seen_absent = 0
    while True:
        progress = job_progress(name, namespace, total)
        if progress is None:
            seen_absent += 1
            if seen_absent >= 3:  # not a race with creation: somebody deleted it
                raise ApplyError(
                    "disappeared while being waited for (deleted?)", kind="Job", namespace=namespace, name=name
                )
        else:
            if on_progress:
                on_progress(progress)
            if progress.phase == "Completed":
                return progress
            if progress.phase in TERMINAL_JOB_PHASES:
                raise ApplyError(
                    f"ended {progress.phase} after {progress.restarts} restart(s): {_why_failed(namespace, progress)}",
                    kind="Job",
                    namespace=namespace,
                    name=name,
                )
            stuck = [p for p in progress.pods if fatal_reason(p)]
            if stuck:
                raise ApplyError(
                    explain_pod(stuck[0], pod_events(namespace, stuck[0].metadata.name)),
                    kind="Job",
                    namespace=namespace,
                    name=name,
                )
        if time.monotonic() >= deadline:
            state = f"{progress.phase}, {progress.succeeded}/{total} done" if progress else "absent"
            raise ApplyError(
                f"not finished after {timeout:g}s ({state}); it keeps running: "
                f"`kubectl get vcjob,pods -n {namespace} -l {k.VOLCANO_JOB_NAME_LABEL}={name}`",
                kind="Job",
                namespace=namespace,
                name=name,
            )
        time.sleep(poll)


def _why_failed(namespace: str, progress: JobProgress) -> str:
    failed = sorted((p for p in progress.pods if p.status.phase == "Failed"), key=lambda p: p.metadata.name)
    if not failed:
        return f"see `kubectl describe vcjob -n {namespace} {progress.name}`"
    pod = failed[0].metadata.name
    tail = [line for line in pod_log_tail(namespace, pod) if line.strip()]
    last = tail[-1].strip() if tail else "(no log)"
    return f"pod {pod} failed: {last}; see `kubectl logs -n {namespace} {pod}`"


def merge_metrics(log_lines: list[str]) -> dict | None:
    """The metrics JSON `eval merge --json` printed (its last JSON object line), or None."""
    for line in reversed(log_lines):
        line = line.strip()
        if line.startswith("{"):
            try:
                found = json.loads(line)
            except ValueError:
                continue
            if isinstance(found, dict) and isinstance(found.get("model"), dict) and isinstance(found.get("data"), dict):
                return found
    return None


def submit_eval_job(
    files: EvalJobFiles,
    *,
    namespace: str,
    queue: str,
    deployment: str,
    timeout: float,
    poll: float = 2.0,
    progress: Callable[[str], None] = lambda message: None,
    warning: Callable[[str], None] | None = None,
    on_workers: Callable[[JobProgress], None] | None = None,
) -> dict:
    """Run the worker job to completion, then the merge job; returns the merged metrics."""
    preflight(namespace=namespace, queue=queue)
    check_deployment(namespace, deployment)
    workers = files.workers_job["spec"]["tasks"][0]["replicas"]
    result = apply_volcano_job(files.workers_job)
    progress(
        f"Volcano job {namespace}/{files.workers_job['metadata']['name']} {result}: {workers} worker(s), "
        f"partials in {files.partials}"
    )
    restarts = [0]

    def watch(p: JobProgress) -> None:
        if p.restarts > restarts[0]:
            restarts[0] = p.restarts
            (warning or progress)(
                f"a worker pod failed; Volcano restarted the worker task (restart {p.restarts}); "
                "complete shares are kept and only the lost share runs again"
            )
        if on_workers:
            on_workers(p)

    wait_for_job(
        files.workers_job["metadata"]["name"], namespace, workers, timeout=timeout, poll=poll, on_progress=watch
    )
    progress(f"all {workers} shares scored")
    merge_name = files.merge_job["metadata"]["name"]
    result = apply_volcano_job(files.merge_job)
    progress(f"Volcano job {namespace}/{merge_name} {result}: merging into {files.output}")
    done = wait_for_job(merge_name, namespace, 1, timeout=timeout, poll=poll)
    pod = next((p.metadata.name for p in done.pods if p.status.phase == "Succeeded"), f"{merge_name}-merge-0")
    metrics = merge_metrics(pod_log_tail(namespace, pod, lines=200))
    if metrics is None:
        raise ApplyError(
            f"the merge finished but its log holds no metrics; see `kubectl logs -n {namespace} {pod}`",
            kind="Job",
            namespace=namespace,
            name=merge_name,
        )
    return metrics
