"""-l: trainer 0's, the file server's and cube-transfer's logs, one prefix per pod.

With ``follow`` each component is streamed in its own thread; when a stream
ends because its pod was deleted and recreated (Volcano's RestartJob, a
Deployment replacing a pod, a container restart) the stream reattaches to
the new pod instead of stopping.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from elastic_control.kube import adaptor
from elastic_control.kube import constants as k

TERMINAL_JOB_PHASES = {"Completed", "Failed", "Aborted", "Terminated"}


@dataclass(frozen=True)
class LogSource:
    """One component whose log -l shows, found by label selector."""

    component: str
    selector: str
    container: str
    job: str | None = None  # Volcano job name when the pod belongs to the training job


def log_sources(job: str) -> dict[str, LogSource]:
    trainer0 = f"{k.VOLCANO_JOB_NAME_LABEL}={job},{k.VOLCANO_TASK_SPEC_LABEL}=trainer,{k.VOLCANO_TASK_INDEX_LABEL}=0"
    return {
        "trainer-0": LogSource("trainer-0", trainer0, "trainer", job=job),
        "fileserver": LogSource("fileserver", f"{k.LABEL_INSTANCE}={job},{k.LABEL_COMPONENT}=fileserver", "fileserver"),
        "cube-transfer": LogSource(
            "cube-transfer", f"{k.LABEL_INSTANCE}={job},{k.LABEL_COMPONENT}=cube-transfer", "cube-transfer"
        ),
    }


def find_pod(namespace: str, source: LogSource):
    """The newest live pod of ``source`` (None if there is none)."""
    with adaptor.reachable(f"finding the {source.component} pod"):
        pods = adaptor.core().list_namespaced_pod(namespace, label_selector=source.selector).items
    live = [p for p in pods if not p.metadata.deletion_timestamp] or pods
    return max(live, key=lambda p: str(p.metadata.creation_timestamp or ""), default=None)


def _identity(pod) -> tuple:
    restarts = sum(s.restart_count or 0 for s in pod.status.container_statuses or [])
    return pod.metadata.uid, restarts


def _job_phase(namespace: str, job: str | None) -> str | None:
    if job is None:
        return None
    from elastic_control.kube.objects import read_volcano_job

    obj = read_volcano_job(job, namespace)
    return ((obj or {}).get("status") or {}).get("state", {}).get("phase") if obj else "Deleted"


def _replacement_expected(pod, job_phase: str | None) -> bool:
    """After a stream ended: is a new pod (or container) on its way?"""
    if job_phase in TERMINAL_JOB_PHASES or job_phase == "Deleted":
        return False
    if pod is None or pod.metadata.deletion_timestamp:
        return True
    return pod.status.phase == "Failed" and job_phase is not None  # RestartJob will recreate it


class LogPrinter:
    """Writes prefixed lines from several threads without interleaving them."""

    def __init__(self, write: Callable[[str], None] | None = None):
        self._lock = threading.Lock()
        self._write = write or (lambda text: (sys.stdout.write(text), sys.stdout.flush()))

    def line(self, prefix: str, text: str) -> None:
        with self._lock:
            self._write(f"[{prefix}] {text}\n")


def print_logs(namespace: str, source: LogSource, printer: LogPrinter, *, tail_lines: int = 200) -> bool:
    """The current log of ``source``'s pod; False when it has no pod yet."""
    pod = find_pod(namespace, source)
    if pod is None:
        printer.line(source.component, f"(no pod yet for selector {source.selector})")
        return False
    with adaptor.reachable(f"reading the log of {pod.metadata.name}"):
        try:
            for text in adaptor.stream_pod_log(
                pod.metadata.name, namespace, container=source.container, tail_lines=tail_lines
            ):
                printer.line(pod.metadata.name, text)
        except adaptor.ApiException as e:
            printer.line(pod.metadata.name, f"(log unavailable: HTTP {e.status} {e.reason})")
    return True


def follow_logs(
    namespace: str,
    source: LogSource,
    printer: LogPrinter,
    *,
    reattach_timeout: float = 300.0,
    poll: float = 0.5,
    stop: threading.Event | None = None,
) -> int:
    """Stream ``source``'s log, reattaching to recreated pods; returns how many pods were streamed."""
    stop = stop or threading.Event()
    streamed = 0
    seen: tuple | None = None
    while not stop.is_set():
        pod, deadline = find_pod(namespace, source), time.monotonic() + reattach_timeout
        # Wait for a pod we have not streamed yet (the first one, or its replacement).
        while (pod is None or _identity(pod) == seen or pod.metadata.deletion_timestamp) and not stop.is_set():
            if not _replacement_expected(pod, _job_phase(namespace, source.job)) and seen is not None:
                return streamed
            if time.monotonic() >= deadline:
                printer.line(source.component, f"(no new pod after {reattach_timeout:g}s; stopped following)")
                return streamed
            time.sleep(poll)
            pod = find_pod(namespace, source)
        if stop.is_set():
            break
        if seen is not None:
            printer.line(source.component, f"(pod recreated: reattached to {pod.metadata.name})")
        seen = _identity(pod)
        streamed += 1
        try:
            with adaptor.reachable(f"streaming the log of {pod.metadata.name}"):
                for text in adaptor.stream_pod_log(
                    pod.metadata.name, namespace, follow=True, container=source.container
                ):
                    printer.line(pod.metadata.name, text)
                    if stop.is_set():
                        break
        except adaptor.ApiException as e:
            # 400 while the container is still being created: wait and retry the same pod.
            if e.status == 400:
                seen = None
                time.sleep(poll)
                continue
            printer.line(pod.metadata.name, f"(log stream failed: HTTP {e.status} {e.reason})")
            return streamed
    return streamed
