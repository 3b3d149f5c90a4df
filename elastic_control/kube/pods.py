"""Waiting for pods to start, and explaining from their events why they do not."""

from __future__ import annotations

import time
from dataclasses import dataclass

from elastic_control.kube import adaptor
from elastic_control.kube import constants as k

# Waiting reasons that will not resolve by themselves.
FATAL_WAITING = {
    "InvalidImageName",
    "ImagePullBackOff",
    "CrashLoopBackOff",
    "CreateContainerConfigError",
    "CreateContainerError",
}
STARTED_PHASES = {"Running", "Succeeded"}


@dataclass(frozen=True)
class PodCount:
    started: int
    total: int
    stuck: list  # pods (models) that are not started


def list_pods(namespace: str, selector: str) -> list:
    with adaptor.reachable("listing pods"):
        return adaptor.core().list_namespaced_pod(namespace, label_selector=selector).items


def pod_events(namespace: str, pod_name: str) -> list:
    with adaptor.reachable(f"reading the events of pod {pod_name}"):
        events = adaptor.core().list_namespaced_event(namespace, field_selector=f"involvedObject.name={pod_name}").items
    return sorted(events, key=lambda e: str(e.last_timestamp or e.event_time or ""))


def waiting_reasons(pod) -> list[tuple[str, str]]:
    """(container, reason) for every container that is waiting or crashed."""
    out = []
    for status in (pod.status.init_container_statuses or []) + (pod.status.container_statuses or []):
        waiting = status.state.waiting if status.state else None
        if waiting and waiting.reason:
            out.append((status.name, waiting.reason))
    return out


def fatal_reason(pod) -> str | None:
    for container, reason in waiting_reasons(pod):
        if reason in FATAL_WAITING:
            return f"{container}: {reason}"
    return None


def explain_pod(pod, events: list, *, cpu: int | None = None, mem: int | None = None) -> str:
    """One sentence on why ``pod`` is not running, with how to fix it."""
    name = pod.metadata.name
    for container, reason in waiting_reasons(pod):
        if reason in ("ErrImagePull", "ImagePullBackOff", "InvalidImageName"):
            image = next(
                (c.image for c in pod.spec.containers + (pod.spec.init_containers or []) if c.name == container), "?"
            )
            detail = next((e.message for e in reversed(events) if e.reason in ("Failed", "ErrImagePull")), "")
            return (
                f"pod {name}: cannot pull image {image!r} ({reason}{': ' + detail if detail else ''}); "
                "build and push it (see Dockerfile) and pass --image to -r"
            )
        if reason == "CrashLoopBackOff":
            return (
                f"pod {name}: container {container} keeps crashing (CrashLoopBackOff); "
                f"see `kubectl logs -n {pod.metadata.namespace} {name} -c {container} --previous`"
            )
        if reason in ("CreateContainerConfigError", "CreateContainerError"):
            detail = next((e.message for e in reversed(events) if e.type == "Warning"), "")
            return f"pod {name}: container {container} cannot be created ({reason}{': ' + detail if detail else ''})"
    unscheduled = [e for e in events if e.reason in ("FailedScheduling", "Unschedulable")]
    if unscheduled:
        message = unscheduled[-1].message or ""
        hints = []
        if "insufficient cpu" in message.lower():
            hints.append(f"lower -u (now {cpu})" if cpu else "request fewer CPUs")
        if "insufficient memory" in message.lower():
            hints.append(f"lower -m (now {mem} GiB)" if mem else "request less memory")
        hint = " or ".join(hints) + ", or add nodes" if hints else "check node capacity, taints and the queue"
        return f"pod {name} cannot be scheduled: {message.strip().rstrip('.')}; {hint}"
    for condition in pod.status.conditions or []:
        if condition.type == "PodScheduled" and condition.status == "False":
            return f"pod {name} is not scheduled: {condition.reason or ''} {condition.message or ''}".strip()
    warnings = [e for e in events if e.type == "Warning"]
    if warnings:
        return f"pod {name} is {pod.status.phase}: {warnings[-1].reason}: {warnings[-1].message}"
    return f"pod {name} is still {pod.status.phase} (no events explain why yet)"


NOT_COUNTED_COMPONENTS = {"eval", "eval-merge"}  # `eval submit` jobs are not part of what -a starts


def count_started(namespace: str, selector: str, expected: int, *, skip_job: str | None = None) -> PodCount:
    """Started and stuck pods of the plan (``skip_job``: a finished Volcano job whose pods are not waited for)."""
    pods = [
        p
        for p in list_pods(namespace, selector)
        if not p.metadata.deletion_timestamp
        and (p.metadata.labels or {}).get(k.LABEL_COMPONENT) not in NOT_COUNTED_COMPONENTS
        and (skip_job is None or (p.metadata.labels or {}).get(k.VOLCANO_JOB_NAME_LABEL) != skip_job)
    ]
    started = [p for p in pods if p.status.phase in STARTED_PHASES]
    stuck = [p for p in pods if p.status.phase not in STARTED_PHASES]
    return PodCount(started=len(started), total=max(expected, len(pods)), stuck=stuck)


def wait_for_pods(
    namespace: str, selector: str, expected: int, *, timeout: float, poll: float = 1.0, on_progress=None
) -> tuple[bool, PodCount]:
    """Poll until ``expected`` pods are running, a pod fails for good, or ``timeout``; (ok, last count)."""
    deadline = time.monotonic() + timeout
    while True:
        count = count_started(namespace, selector, expected)
        if on_progress:
            on_progress(count)
        if count.started >= expected and not count.stuck:
            return True, count
        if any(fatal_reason(p) for p in count.stuck):
            return False, count
        if time.monotonic() >= deadline:
            return False, count
        time.sleep(poll)
