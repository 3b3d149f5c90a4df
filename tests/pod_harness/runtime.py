"""Pods and containers as the kubelet runs them: init containers first, restarts with back-off,
probes (from the node agent), preStop hooks, SIGTERM, the grace period, SIGKILL.

Two container runtimes, one pod model (this file's Pod, Container and Kubelet.sync):

- ``Kubelet`` (the default: fast, no image): each container is a process tree
  ``ip netns exec POD unshare -m -u -p -f --mount-proc --kill-child python container_entry.py SPEC``
  running this checkout's .venv on the host's root file system (image.py emulates the Dockerfile).
  The container's command is PID 1 of its own PID namespace (so, as in a real container, SIGTERM
  reaches it only if it handles SIGTERM, and SIGKILL ends everything in it), in its own mount
  namespace (hosts file, volumes), in the pod's network namespace (shared by the pod's containers,
  like localhost in a pod).
- ``PodmanRuntime`` (podman.py, ``Cluster(..., image=TAG)``): each container is ``podman run`` of the
  built image with runc, in the pod's network namespace, with the securityContext, memory and CPU
  limits, env, command and volumes as rendered; signals by ``podman kill``, preStop by ``podman exec``.

Exec probes run inside the container through the runtime (``exec_prefix``: nsenter + the container's
user, or ``podman exec``), started by the node agent. What neither emulates: startup probes' effect on
liveness, image pulls and pull policies (the image is in the local
store or the container cannot be created), ephemeral-storage limits and requests (no scheduler),
terminationMessagePolicy (the log file stays instead), service-account tokens (no API server
answers the pods), and the host-venv runtime enforces no memory/CPU limits and no seccomp.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ENTRY = str(Path(__file__).resolve().parent / "container_entry.py")
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """preexec_fn: SIGKILL this process when the harness thread that started it dies (then unshare's
    --kill-child takes the container), so a harness killed hard leaves no pod running."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


BACKOFF_START, BACKOFF_MAX = 1.0, 10.0  # the kubelet's is 10 s doubling to 5 min: shorter, for tests


@dataclass
class Container:
    spec: dict
    init: bool = False
    proc: subprocess.Popen | None = None
    generation: int = 0
    restarts: int = 0
    state: str = "waiting"  # waiting | running | terminated
    reason: str = "ContainerCreating"
    exit_code: int | None = None
    next_start: float = 0.0
    backoff: float = BACKOFF_START
    log: Path | None = None
    started_at: float = 0.0
    killed_for: str | None = None  # "liveness" when the kubelet killed it
    sigterm_at: float | None = None
    exit_after_sigterm: float | None = None  # seconds from SIGTERM to exit, when it exited by itself
    runtime_name: str | None = None  # the container's name in podman (PodmanRuntime)
    pid_of: Callable[[Container], int | None] | None = None  # how a runtime other than unshare finds PID 1

    @property
    def name(self) -> str:
        return self.spec["name"]

    def init_pid(self) -> int | None:
        """Host PID of the container's PID 1 (the child unshare forked)."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        if self.pid_of is not None:
            return self.pid_of(self)
        try:
            with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
                children = f.read().split()
        except OSError:
            return None
        return int(children[0]) if children else None

    def poll(self) -> int | None:
        """The exit code as Kubernetes reports it (128+N for signal N), once the process ended."""
        if self.proc is None:
            return None
        code = self.proc.poll()
        if code is None:
            return None
        return 128 - code if code < 0 else code

    def signal(self, sig: int) -> None:
        pid = self.init_pid()
        if pid is not None:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if sig == signal.SIGKILL and self.proc is not None and self.proc.poll() is None:
            # unshare --kill-child takes the container's PID 1, and with it the whole PID namespace.
            self.proc.kill()


@dataclass
class Pod:
    name: str
    namespace: str
    labels: dict
    annotations: dict
    spec: dict
    owner: tuple[str, str]  # (kind, name): ("Deployment", x) or ("Job", x)
    ip: str
    dir: Path
    netns: str = ""
    task: str | None = None  # Volcano task
    index: int | None = None
    phase: str = "Pending"
    reason: str = ""
    init: list[Container] = field(default_factory=list)
    containers: list[Container] = field(default_factory=list)
    init_done: int = 0
    terminating: bool = False
    gone: bool = False  # every process ended and the namespace is removed
    created_at: float = field(default_factory=time.time)
    events: list[str] = field(default_factory=list)
    volumes: dict[str, Path] = field(default_factory=dict)
    env_errors: list[str] = field(default_factory=list)

    def __post_init__(self):
        self.init = [Container(c, init=True) for c in self.spec.get("initContainers") or []]
        self.containers = [Container(c) for c in self.spec["containers"]]

    def event(self, message: str) -> None:
        """Record what happened to the pod (kept in memory and in POD_DIR/events.log)."""
        self.events.append(message)
        try:
            with open(self.dir / "events.log", "a") as f:
                f.write(f"{time.strftime('%H:%M:%S')} {message}\n")
        except OSError:
            pass

    @property
    def hostname(self) -> str:
        return self.spec.get("hostname") or self.name

    @property
    def restart_policy(self) -> str:
        return self.spec.get("restartPolicy", "Always")

    @property
    def grace(self) -> float:
        return float(self.spec.get("terminationGracePeriodSeconds", 30))

    def ports(self) -> dict[str, int]:
        return {
            p["name"]: p["containerPort"] for c in self.spec["containers"] for p in c.get("ports") or [] if "name" in p
        }

    def all_containers(self) -> list[Container]:
        return self.init + self.containers

    def exit_codes(self) -> list[int]:
        return [c.exit_code for c in self.containers if c.exit_code is not None]

    def agent_view(self) -> dict:
        """What the node agent needs: address, names, labels, ports, and the main containers with their probes."""
        return {
            "name": self.name,
            "ip": self.ip,
            "hostname": self.hostname,
            "subdomain": self.spec.get("subdomain"),
            "labels": self.labels,
            "ports": self.ports(),
            "terminating": self.terminating,
            "containers": [
                {
                    "name": c.name,
                    "generation": c.generation,
                    "running": c.state == "running",
                    **{k: c.spec[k] for k in ("readinessProbe", "livenessProbe", "startupProbe") if k in c.spec},
                }
                for c in self.containers
            ],
        }


class Kubelet:
    """Starts, watches, restarts and stops the containers of pods."""

    def __init__(self, make_spec, root_env: dict):
        self.make_spec = make_spec  # (pod, container) -> the container_entry spec dict
        self.root_env = root_env

    # ---- starting --------------------------------------------------------------------------------------
    def start(self, pod: Pod, c: Container) -> None:
        c.generation += 1
        c.log = pod.dir / f"{c.name}.log"
        with open(c.log, "ab") as log:
            if c.generation > 1:
                log.write(f"\n--- harness: container {c.name} restarted (restart {c.restarts}) ---\n".encode())
            log.flush()
            c.proc = self.launch(pod, c, log)
        c.state, c.reason, c.exit_code, c.started_at, c.killed_for = "running", "", None, time.monotonic(), None

    def launch(self, pod: Pod, c: Container, log) -> subprocess.Popen:
        """Start generation ``c.generation`` of the container, its output (both streams) to ``log``."""
        spec = self.make_spec(pod, c)
        spec_path = pod.dir / f"{c.name}.spec-{c.generation}.json"
        spec_path.write_text(json.dumps(spec))
        argv = ["ip", "netns", "exec", pod.netns, "unshare", "-m", "-u", "-p", "-f", "--mount-proc",
                "--kill-child", "--propagation", "private", sys.executable, ENTRY, str(spec_path)]  # fmt: skip
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.root_env,
            preexec_fn=die_with_parent,
        )

    def signal(self, pod: Pod, c: Container, sig: int) -> None:
        """Send ``sig`` to the container's PID 1 (SIGKILL: to everything in it)."""
        c.signal(sig)

    def exec_prefix(self, pod: Pod, c: Container) -> tuple[list[str], dict] | None:
        """(argv prefix, environment) that runs a command inside the running container as its user, for the node
        agent's exec probes (None when it is not running)."""
        pid = c.init_pid()
        if pid is None:
            return None
        path = pod.dir / f"{c.name}.exec-{c.generation}.json"
        if not path.exists():
            path.write_text(json.dumps(self.make_spec(pod, c)))
        enter = ["nsenter", "-t", str(pid), "-m", "-u", "-p", "-n", "-i", "--", sys.executable, ENTRY, "--exec",
                 str(path), "--"]  # fmt: skip
        return enter, self.root_env

    def exec_in(self, pod: Pod, c: Container, argv: list[str], timeout: float) -> subprocess.CompletedProcess | None:
        """Run ``argv`` inside the running container as its user (None when it is not running)."""
        pid = c.init_pid()
        if pid is None:
            return None
        spec = dict(self.make_spec(pod, c), argv=argv)
        path = pod.dir / f"{c.name}.prestop.json"
        path.write_text(json.dumps(spec))
        enter = ["nsenter", "-t", str(pid), "-m", "-u", "-p", "-n", "-i", "--", sys.executable, ENTRY, "--exec",
                 str(path)]  # fmt: skip
        return subprocess.run(
            enter,
            capture_output=True,
            timeout=timeout,
            env=self.root_env,
        )

    def cleanup(self) -> None:
        """After every pod is gone: remove what the runtime left (nothing, for process trees)."""

    # ---- one step of the pod's life --------------------------------------------------------------------
    def sync(self, pod: Pod, probe_status: dict) -> None:
        if pod.terminating or pod.gone or pod.phase in ("Succeeded", "Failed"):
            return
        if pod.env_errors:
            pod.reason = "CreateContainerConfigError: " + "; ".join(pod.env_errors)
            return
        now = time.monotonic()
        if pod.init_done < len(pod.init):
            c = pod.init[pod.init_done]
            if c.state == "waiting" and now >= c.next_start:
                self.start(pod, c)
                pod.phase = "Pending"
            elif c.state == "running" and (code := c.poll()) is not None:
                c.state, c.exit_code = "terminated", code
                if code == 0:
                    pod.init_done += 1
                elif pod.restart_policy == "Never":
                    pod.phase, pod.reason = "Failed", f"init container {c.name} exited with {code}"
                else:
                    self._schedule_restart(pod, c, code)
            return
        for c in pod.containers:
            if c.state == "waiting" and now >= c.next_start:
                self.start(pod, c)
            elif c.state == "running":
                code = c.poll()
                status = probe_status.get(c.name) or {}
                live_failed = status.get("generation") == c.generation and status.get("liveness_failed")
                if code is None and c.killed_for is None and live_failed:
                    pod.event(f"container {c.name} failed its liveness probe; killed")
                    c.killed_for = "liveness"
                    threading.Thread(target=self._stop_container, args=(pod, c, pod.grace), daemon=True).start()
                    continue
                if code is None:
                    continue
                c.state, c.exit_code = "terminated", code
                policy = pod.restart_policy
                if policy == "Always" or (policy == "OnFailure" and code != 0):
                    self._schedule_restart(pod, c, code)
        if all(c.state == "terminated" for c in pod.containers):
            pod.phase = "Succeeded" if all(code == 0 for code in pod.exit_codes()) else "Failed"
            failed = [c for c in pod.containers if c.exit_code]
            pod.reason = f"container {failed[0].name} exited with {failed[0].exit_code}" if failed else "Completed"
        elif any(c.state == "running" for c in pod.containers):
            pod.phase = "Running"

    def _schedule_restart(self, pod: Pod, c: Container, code: int) -> None:
        c.restarts += 1
        c.state, c.reason = "waiting", f"CrashLoopBackOff (exit code {code})"
        c.next_start = time.monotonic() + c.backoff
        pod.event(f"container {c.name} exited with {code}; restart {c.restarts} in {c.backoff:g}s")
        c.backoff = min(c.backoff * 2, BACKOFF_MAX)

    # ---- stopping --------------------------------------------------------------------------------------
    def _run_prestop(self, pod: Pod, c: Container, timeout: float) -> None:
        hook = ((c.spec.get("lifecycle") or {}).get("preStop")) or {}
        if "sleep" in hook:
            time.sleep(min(float(hook["sleep"]["seconds"]), timeout))
            return
        if "exec" not in hook:
            return
        try:
            proc = self.exec_in(pod, c, hook["exec"]["command"], timeout)
            if proc is not None and proc.returncode != 0:
                pod.event(f"preStop of {c.name} exited with {proc.returncode}: {proc.stderr[-300:]!r}")
        except subprocess.TimeoutExpired:
            pod.event(f"preStop of {c.name} did not finish within {timeout:g}s")

    def _stop_container(self, pod: Pod, c: Container, grace: float) -> None:
        """preStop, SIGTERM, wait out the grace period, SIGKILL (what deleting a pod does to a container)."""
        deadline = time.monotonic() + grace
        if c.state != "running" or c.poll() is not None:
            return
        self._run_prestop(pod, c, max(0.0, deadline - time.monotonic()))
        self.signal(pod, c, signal.SIGTERM)
        c.sigterm_at = time.monotonic()
        while c.proc is not None and c.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if c.proc is not None and c.proc.poll() is None:
            pod.event(f"container {c.name} still running {grace:g}s after SIGTERM; killed")
            self.signal(pod, c, signal.SIGKILL)
            c.proc.wait(30)
        else:
            c.exit_after_sigterm = time.monotonic() - c.sigterm_at
            pod.event(f"container {c.name} exited ({c.poll()}) {c.exit_after_sigterm:.2f}s after SIGTERM")

    def terminate(self, pod: Pod, grace: float | None = None, on_gone=None) -> threading.Thread:
        """Delete ``pod`` as the API server and kubelet do: terminating at once (it leaves its
        Services), then every container stopped in parallel, then ``on_gone(pod)``."""
        pod.terminating = True
        grace = pod.grace if grace is None else grace

        def run():
            threads = [
                threading.Thread(target=self._stop_container, args=(pod, c, grace), daemon=True)
                for c in pod.all_containers()
                if c.proc is not None
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for c in pod.all_containers():
                if c.state == "running":
                    c.state, c.exit_code = "terminated", c.poll()
            if on_gone:
                on_gone(pod)
            pod.gone = True

        thread = threading.Thread(target=run, daemon=True, name=f"terminate-{pod.name}")
        thread.start()
        return thread
