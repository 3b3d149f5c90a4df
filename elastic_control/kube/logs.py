"""-l: the components' logs (default: trainer 0's, the file server's and cube-transfer's), one prefix per pod.

With ``follow`` each component is streamed in its own thread. When a stream
ends, the follower looks at the pod and either reattaches (the pod still
runs: the API server or kubelet closed the stream; its pod was recreated by
Volcano's RestartJob or a Deployment; its container restarted) or says, in one
line, why it stopped (the pod finished and nothing will replace it). Lines are
requested with timestamps, so a stream reopened on the same pod does not print
a line twice. A pod whose container restarted shows its previous instance's log first
(prefix ``POD previous``), with ``follow`` too (once, before the first stream): what made it restart is there.

The kubelet forgets a pod's log with the pod, and Volcano deletes the training job's pods when it restarts
the job. The training pods keep a copy of their output on the shared claim (ctr_foundation/log_keeper.py),
which the file server serves read-only as ``logs/POD/STAMP-CONTAINER.log`` with the token: for a training
role, -l first shows the kept logs of that pod name's earlier instances (prefix ``POD kept STAMP``; the
newest KEPT_SHOWN), those that started before the live pod's container did, or all of them when no pod is
left (a job removed after its TTL).
"""

from __future__ import annotations

import datetime as dt
import math
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ctr_foundation import names
from ctr_foundation.errors import UsageError
from ctr_foundation.log_keeper import STAMP_FORMAT, parse_kept_log_name
from elastic_control.kube import adaptor, service_probe
from elastic_control.kube import constants as k
from elastic_control.kube.objects import read_volcano_job
from elastic_control.training.log_filter import is_paddle_noise

TERMINAL_JOB_PHASES = {"Completed", "Failed", "Aborted", "Terminated"}


@dataclass(frozen=True)
class LogSource:
    """One component whose log -l shows, found by label selector (and pod name)."""

    component: str
    selector: str
    container: str
    job: str | None = None  # Volcano job name when the pod belongs to the training job
    pod_name: str | None = None  # a Volcano pod's fixed name (JOB-TASK-I)


DEFAULT_COMPONENTS = ("trainer-0", "fileserver", "cube-transfer")
DEFAULT_TAIL = 200  # lines of each log that -l shows unless told


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


def plan_log_sources(plan) -> dict[str, LogSource]:
    """Every component of ``plan`` -l can show, by the names the local backend uses too: mlflow, fileserver,
    cube-server-I and cube-agent-I (the two containers of shard I's pod), cube-transfer, serving (its newest
    pod), pserver-I and trainer-I (the Volcano job's pods JOB-pserver-I, JOB-trainer-I)."""
    job, res = plan.job_name, plan.resources
    sources = {"mlflow": _deployment_source(job, "mlflow"), "fileserver": log_sources(job)["fileserver"]}
    for shard in range(res.cube_shards):
        selector = f"{k.LABEL_INSTANCE}={job},{k.LABEL_COMPONENT}=cube,{k.LABEL_SHARD}={shard}"
        for container in ("cube-server", "cube-agent"):
            sources[f"{container}-{shard}"] = LogSource(f"{container}-{shard}", selector, container)
    sources["cube-transfer"] = log_sources(job)["cube-transfer"]
    sources["serving"] = _deployment_source(job, "serving")
    for role, count in (("pserver", res.pservers), ("trainer", res.trainers)):
        selector = f"{k.VOLCANO_JOB_NAME_LABEL}={job},{k.VOLCANO_TASK_SPEC_LABEL}={role}"
        for i in range(count):
            sources[f"{role}-{i}"] = LogSource(f"{role}-{i}", selector, role, job=job, pod_name=f"{job}-{role}-{i}")
    return sources


def _deployment_source(job: str, component: str) -> LogSource:
    return LogSource(component, f"{k.LABEL_INSTANCE}={job},{k.LABEL_COMPONENT}={component}", component)


def stream_logs(
    plan,
    *,
    components: list[str] | None = None,
    follow: bool = False,
    tail: int | None = DEFAULT_TAIL,
    since: float | None = None,
    raw: bool = False,
    out=None,
) -> None:
    """-l on a cluster: the last ``tail`` lines (None: every line) of the last ``since`` seconds of each
    component's pod, after the kept logs of its earlier pods; with ``follow`` each is streamed in its own
    thread until Ctrl-C."""
    sources = plan_log_sources(plan)
    wanted = list(components or DEFAULT_COMPONENTS)
    unknown = [c for c in wanted if c not in sources]
    if unknown:
        raise UsageError(f"unknown log component(s) {', '.join(unknown)} (known: {', '.join(sources)})")

    printer = LogPrinter(log_writer(out, raw))
    since_seconds = None if since is None else max(1, math.ceil(since))
    kept = KeptLogs(plan.namespace, f"{plan.job_name}-fileserver", plan.token())
    if not follow:
        for name in wanted:
            print_logs(plan.namespace, sources[name], printer, tail_lines=tail, since_seconds=since_seconds, kept=kept)
        return
    for name in wanted:  # what earlier pods left, once, before the streams
        if sources[name].pod_name:
            kept.print_earlier(sources[name], find_pod(plan.namespace, sources[name]), printer, tail)
    follow_all(
        plan.namespace,
        [sources[n] for n in wanted],
        printer,
        first_tail_lines=tail,
        first_since_seconds=since_seconds,
    )


def log_writer(out, raw: bool) -> Callable[[str], None]:
    """LogPrinter's writer: to ``out`` (default stdout), without Paddle's glog lines unless ``raw``."""

    def write(text: str) -> None:
        if not raw and is_paddle_noise(text.split("] ", 1)[-1]):
            return
        stream = out or sys.stdout
        stream.write(text)
        stream.flush()

    return write


def follow_all(namespace: str, sources: list, printer: LogPrinter, **first) -> None:
    """Stream every source in its own thread (``follow_logs``, ``first`` its first_* arguments) until Ctrl-C;
    the first error of any of them is raised here."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def run(source):
        try:
            follow_logs(namespace, source, printer, stop=stop, **first)
        except BaseException as e:  # noqa: BLE001 - surfaced in the main thread below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(src,), daemon=True, name=f"log-{src.component}") for src in sources]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(0.2)
    except KeyboardInterrupt:
        stop.set()
        raise
    if errors:
        raise errors[0]


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


KEPT_SHOWN = 3  # earlier instances of a training pod whose kept logs -l shows (the newest)


@dataclass(frozen=True)
class KeptLogs:
    """The training pods' kept logs, read from the file server through the API server's Service proxy."""

    namespace: str
    service: str  # the file server's Service
    token: str | None

    def print_earlier(self, source: LogSource, pod, printer: LogPrinter, tail_lines: int | None) -> int:
        """Print the kept logs of ``source``'s earlier pods (``pod``: the live one, or None); returns how many."""
        name = source.pod_name
        if name is None:
            return 0
        folder = f"/files/{names.KEPT_LOGS_PREFIX}/{name}/"
        listing = service_probe.ask(self.namespace, self.service, "http", folder, token=self.token)
        if listing.body is None:
            if "HTTP 404" not in listing.reason:  # 404: nothing kept yet (or a file server without kept logs)
                printer.line(f"{name} kept", f"(kept logs unavailable: {listing.reason})")
            return 0
        started = _container_started(pod, source.container)
        parts: dict[dt.datetime, list[str]] = {}
        for entry in listing.body.get("entries") or []:
            kept = None if entry.get("is_dir") else parse_kept_log_name(str(entry.get("name", "")))
            if kept and kept[1] == source.container and (started is None or kept[0] < started):
                parts.setdefault(kept[0], []).append(entry["name"])  # not the live container's own copy
        stamps = sorted(parts)[-KEPT_SHOWN:]
        if len(parts) > len(stamps):
            printer.line(f"{name} kept", f"({len(parts) - len(stamps)} older kept logs not shown: {folder})")
        for when in stamps:
            stamp = when.strftime(STAMP_FORMAT)
            prefix = f"{name} kept {stamp}"
            printer.line(prefix, f"(an earlier {name}, started {stamp}: its log as kept on the shared claim)")
            lines: list[str] = []
            for part in sorted(parts[when], key=lambda n: not n.endswith(".1")):  # the older part first
                answer = service_probe.fetch(self.namespace, self.service, "http", folder + part, token=self.token)
                if answer.data is None:
                    lines.append(f"(part {part} unavailable: {answer.reason})")
                else:
                    lines += answer.data.decode("utf-8", "replace").splitlines()
            for text in lines[-tail_lines:] if tail_lines else lines:
                printer.line(prefix, text)
        return len(stamps)


def _container_started(pod, container: str) -> dt.datetime | None:
    """When ``pod``'s ``container`` started (to the second, the node's clock, as the kept logs' stamps)."""
    for status in (pod.status.container_statuses or []) if pod is not None else []:
        state = status.state
        running = state and (state.running or state.terminated)
        if status.name == container and running and running.started_at:
            return running.started_at.replace(microsecond=0)
    return None


def print_logs(
    namespace: str,
    source: LogSource,
    printer: LogPrinter,
    *,
    tail_lines: int | None = DEFAULT_TAIL,
    since_seconds: int | None = None,
    kept: KeptLogs | None = None,
) -> bool:
    """The current log of ``source``'s pod (its last ``tail_lines`` lines, of the last ``since_seconds``),
    after the kept logs of its earlier pods (``kept``); False when it has no pod yet."""
    pod = find_pod(namespace, source)
    if kept is not None:
        kept.print_earlier(source, pod, printer, tail_lines)
    if pod is None:
        printer.line(source.component, f"(no pod yet for selector {source.selector})")
        return False
    _print_previous(namespace, pod, source, printer, tail_lines, since_seconds)
    _print_one(namespace, pod.metadata.name, source, printer, pod.metadata.name, tail_lines, since_seconds)
    return True


def _print_previous(namespace, pod, source, printer, tail_lines, since_seconds) -> None:
    """A restarted container's previous instance's log (what made it restart: the current one lacks it)."""
    restarts = _restarts(pod, source.container)
    if restarts:
        name = pod.metadata.name
        printer.line(f"{name} previous", f"(container {source.container} restarted {restarts}x: its previous log)")
        _print_one(namespace, name, source, printer, f"{name} previous", tail_lines, since_seconds, previous=True)


def _restarts(pod, container: str) -> int:
    return sum(s.restart_count or 0 for s in pod.status.container_statuses or [] if s.name == container)


def _print_one(namespace, name, source, printer, prefix, tail_lines, since_seconds, *, previous=False) -> None:
    with adaptor.reachable(f"reading the log of {name}"):
        try:
            for text in adaptor.stream_pod_log(
                name,
                namespace,
                container=source.container,
                tail_lines=tail_lines,
                since_seconds=since_seconds,
                previous=previous,
            ):
                printer.line(prefix, text)
        except adaptor.ApiException as e:
            if e.status in (401, 403):
                raise
            printer.line(prefix, f"(log unavailable: HTTP {e.status} {adaptor.api_error_message(e)})")


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
    first_tail_lines: int | None = None,
    first_since_seconds: int | None = None,
) -> int:
    """Stream ``source``'s log, reattaching while its pod (or a replacement) runs; returns the streams opened.

    The first stream starts ``first_tail_lines`` lines back and ``first_since_seconds`` ago (default: the
    pod's whole log); a stream reopened later goes on from the last line printed."""
    stop = stop or threading.Event()
    streams = printed = 0
    opened = False  # a stream has been read (not refused because its container was still being created)
    shown_previous = False  # a restarted container's previous log: once, before the first stream
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
        if not shown_previous:
            shown_previous = True
            _print_previous(namespace, pod, source, printer, first_tail_lines, first_since_seconds)
        seen = identity
        streams += 1
        printed = 0
        since, tail = (None, None) if opened else (first_since_seconds, first_tail_lines)
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
                    tail_lines=tail,
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
        opened = True
        time.sleep(poll / 5)
    return streams
