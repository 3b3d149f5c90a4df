"""`status`: one row per component (Deployments, the Volcano job) with its pods."""

from __future__ import annotations

import json
from dataclasses import dataclass

from elastic_control.kube import adaptor
from elastic_control.kube import constants as k
from elastic_control.kube.objects import read_training_record, read_volcano_job


@dataclass(frozen=True)
class ComponentRow:
    component: str
    kind: str
    name: str
    ready: str  # "ready/desired"
    state: str
    progress: dict | None = None  # the job's: trainer 0's pass progress (kube.constants.PROGRESS_ANNOTATION)


def job_progress(vcjob: dict) -> dict | None:
    """The progress document trainer 0 patched onto the job (training/job_progress.py); None if none or bad."""
    text = ((vcjob.get("metadata") or {}).get("annotations") or {}).get(k.PROGRESS_ANNOTATION)
    try:
        doc = json.loads(text) if text else None
    except ValueError:
        return None  # someone else's edit: status shows no progress rather than failing
    return doc if isinstance(doc, dict) else None


def component_rows(namespace: str, job: str) -> list[ComponentRow]:
    rows: list[ComponentRow] = []

    vcjob = read_volcano_job(job, namespace)
    record = read_training_record(job, namespace) if vcjob is None else None
    if vcjob is None and record is not None and record.get("ttl-seconds-after-finished"):
        # -a created it and it is gone: removed by its TTL once it finished (converge.py does not rerun it)
        created = record.get("created", "?")
        rows.append(ComponentRow("training", "Job", job, "-", f"Removed (finished, TTL elapsed; created {created})"))
    elif vcjob is None:
        rows.append(ComponentRow("training", "Job", job, "-", "absent"))
    else:
        status = vcjob.get("status") or {}
        desired = sum(t.get("replicas", 0) for t in vcjob["spec"].get("tasks", []))
        phase = (status.get("state") or {}).get("phase", "Pending")
        detail = ", ".join(
            f"{n} {status[key]}"
            for key, n in (
                ("running", "running"),
                ("succeeded", "succeeded"),
                ("failed", "failed"),
                ("pending", "pending"),
            )
            if status.get(key)
        )
        rows.append(
            ComponentRow(
                "training",
                "Job",
                job,
                f"{status.get('running', 0)}/{desired}",
                phase + (f" ({detail})" if detail else ""),
                progress=job_progress(vcjob),
            )
        )
    with adaptor.reachable("listing deployments"):
        deployments = (
            adaptor.apps().list_namespaced_deployment(namespace, label_selector=f"{k.LABEL_INSTANCE}={job}").items
        )
    for dep in sorted(deployments, key=lambda d: d.metadata.name):
        desired = dep.spec.replicas if dep.spec.replicas is not None else 1
        ready = (dep.status.ready_replicas or 0) if dep.status else 0
        state = "Ready" if ready >= desired else "Starting"
        rows.append(
            ComponentRow(
                dep.metadata.labels.get(k.LABEL_COMPONENT, "?"),
                "Deployment",
                dep.metadata.name,
                f"{ready}/{desired}",
                state,
            )
        )
    return rows
