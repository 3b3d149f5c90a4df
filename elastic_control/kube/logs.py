"""-l: trainer 0's, the file server's and cube-transfer's logs, one prefix per pod.

With ``follow`` each component is streamed in its own thread. When a stream
ends, the follower looks at the pod and either reattaches (the pod still
runs: the API server or kubelet closed the stream; its pod was recreated by
Volcano's RestartJob or a Deployment; its container restarted) or says, in one
line, why it stopped (the pod finished and nothing will replace it). Lines are
requested with timestamps, so a stream reopened on the same pod does not print
a line twice.
"""

from __future__ import annotations

import datetime as dt
import math
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
    """One component whose log -l shows, found by label selector (and pod name)."""

    component: str
    selector: str
    container: str
    job: str | None = None  # Volcano job name when the pod belongs to the training job
    pod_name: str | None = None  # a Volcano pod's fixed name (JOB-TASK-I)


def log_sources(job: str) -> dict[str, LogSource]:
    # Volcano names trainer 0 JOB-trainer-0 in every release; the task-index label came only with 1.9.
    trainer0 = f"{k.VOLCANO_JOB_NAME_LABEL}={job},{k.VOLCANO_TASK_SPEC_LABEL}=trainer"
    return {
        "trainer-0": LogSource("trainer-0", trainer0, "trainer", job=job, pod_name=f"{job}-trainer-0"),
        "fileserver": LogSource("fileserver", f"{k.LABEL_INSTANCE}={job},{k.LABEL_COMPONENT}=fileserver", "fileserver"),
        "cube-transfer": LogSource(
            "cube-transfer", f"{k.LABEL_INSTANCE}={job},{k.LABEL_COMPONENT}=cube-transfer", "cube-transfer"
        ),
    }


def find_pod(namespace: str, source: LogSource):
    """The newest live pod of ``source`` (None if there is none)."""
    kwargs = {"label_selector": source.selector}
    if source.pod_name:
        kwargs["field_selector"] = f"metadata.name={source.pod_name}"
    with adaptor.reachable(f"finding the {source.component} pod"):
        pods = adaptor.core().list_namespaced_pod(namespace, **kwargs).items
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
    if pod.status.phase == "Failed":
        return job_phase is not None  # RestartJob will recreate it
    return pod.status.phase not in ("Succeeded",)


def _exit_detail(pod, container: str) -> str:
    for status in pod.status.container_statuses or []:
        term = status.state.terminated if status.state else None
        if status.name == container and term is not None:
            reason = f" ({term.reason})" if term.reason else ""
            return f", container {container} exited with {term.exit_code}{reason}"
    return ""


def _why_stopped(pod, job_phase: str | None, container: str, name: str) -> str:
    job = f"; job {job_phase}" if job_phase and job_phase != "Deleted" else ("; job deleted" if job_phase else "")
    if pod is None:
        return f"(stream ended: pod {name} is gone{job})"
    return f"(stream ended: pod {pod.metadata.name} {pod.status.phase}{_exit_detail(pod, container)}{job})"


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
            if e.status in (401, 403):
                raise
            printer.line(pod.metadata.name, f"(log unavailable: HTTP {e.status} {adaptor.api_error_message(e)})")
    return True


def _split_timestamp(line: str) -> tuple[dt.datetime | None, str]:
    stamp, _, text = line.partition(" ")
    try:
        return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")), text
    except ValueError:
        return None, line


def follow_logs(
    namespace: str,
    source: LogSource,
    printer: LogPrinter,
    *,
    reattach_timeout: float = 300.0,
    poll: float = 0.5,
    stop: threading.Event | None = None,
) -> int:
    """Stream ``source``'s log, reattaching while its pod (or a replacement) runs; returns the streams opened."""
    stop = stop or threading.Event()
    streams = printed = 0
    seen: tuple | None = None
    last: dt.datetime | None = None  # time of the last line printed from the pod ``seen``
    while not stop.is_set():
        pod, deadline = find_pod(namespace, source), time.monotonic() + reattach_timeout
        # Wait for a pod to stream: the first one, a replacement, or the same one still running.
        while not stop.is_set():
            if pod is not None and not pod.metadata.deletion_timestamp:
                if _identity(pod) != seen or pod.status.phase in ("Running", "Pending"):
                    break
            phase = _job_phase(namespace, source.job)
            if seen is not None and not _replacement_expected(pod, phase):
                printer.line(source.component, _why_stopped(pod, phase, source.container, source.pod_name or "?"))
                return streams
            if time.monotonic() >= deadline:
                printer.line(source.component, f"(no new pod after {reattach_timeout:g}s; stopped following)")
                return streams
            time.sleep(poll)
            pod = find_pod(namespace, source)
        if stop.is_set():
            break
        identity = _identity(pod)
        if seen is not None and identity[0] != seen[0]:
            printer.line(source.component, f"(pod recreated: reattached to {pod.metadata.name})")
            last = None
        elif seen is not None and identity != seen:
            printer.line(source.component, f"(container restarted: reattached to {pod.metadata.name})")
        elif seen is not None and printed:
            printer.line(source.component, f"(stream closed while {pod.metadata.name} runs: reattached)")
        if seen is not None and identity == seen and not printed:
            time.sleep(poll * 4)  # a stream that keeps closing at once: do not spin
        seen = identity
        streams += 1
        printed = 0
        since = None
        if last is not None:  # reopened on the same pod: from a little before the last line printed
            since = max(1, math.ceil((dt.datetime.now(dt.timezone.utc) - last).total_seconds()) + 1)
        with adaptor.reachable(f"streaming the log of {pod.metadata.name}"):
            try:
                for raw in adaptor.stream_pod_log(
                    pod.metadata.name,
                    namespace,
                    follow=True,
                    container=source.container,
                    timestamps=True,
                    since_seconds=since,
                ):
                    when, text = _split_timestamp(raw)
                    if when is not None and last is not None and when <= last:
                        continue  # already printed before the stream was reopened
                    last = when or last
                    printed += 1
                    printer.line(pod.metadata.name, text)
                    if stop.is_set():
                        break
            except adaptor.ApiException as e:
                if e.status == 400:  # the container is still being created: wait, retry the same pod
                    seen = None
                    time.sleep(poll)
                    continue
                if e.status in (401, 403):
                    raise
                printer.line(pod.metadata.name, f"(log stream failed: HTTP {e.status} {adaptor.api_error_message(e)})")
                return streams
        time.sleep(poll / 5)
    return streams
