"""The image runtime: every container of a pod (init containers and eval jobs too) is ``podman run`` of
the built image, as a kubelet with runc would start it; the pod model and its life (restarts,
probes, preStop, grace periods, Volcano's policies) stay the harness's own (no ``podman kube play``).

``Cluster(docs, workdir, image=TAG, podman_env=ENV)`` uses it. One container is::

    podman run --rm --name PREFIX-POD-CONTAINER-GENERATION --label ...=PREFIX --pull never
        --log-driver passthrough --network ns:/run/netns/POD --hostname HOSTNAME --runtime runc
        --user UID:GID [--group-add FSGROUP ...] [--read-only --read-only-tmpfs=false]
        [--cap-drop ALL] [--cap-add X] [--security-opt no-new-privileges] [--security-opt seccomp=unconfined]
        --shm-size 64m --pids-limit 4096 [--memory M --memory-swap M] [--cpus C] [--cpu-shares S]
        --env-file POD_DIR/CONTAINER.env-N [-e NAME=VALUE (values with line breaks)]
        --mount type=bind,... (emptyDirs rw, ConfigMap/Secret volumes ro, claims, /etc/hosts and
        /etc/resolv.conf of the pod ro) [--workdir DIR] [--entrypoint JSON] TAG ARGS...

- user and groups from the securityContext (pod, then container), runAsNonRoot checked against the
  image's own ``User`` (``podman image inspect``), fsGroup and supplementalGroups as extra groups;
- env exactly as the kubelet builds it (env, envFrom, service links, $(VAR) expansion) over the
  image's ENV (podman adds that, and HOSTNAME and HOME, as a container runtime does); command and
  args as rendered: ``command`` replaces the image's ENTRYPOINT (and its CMD), ``args`` the CMD;
- memory limits become the container's memory cgroup (no swap: ``--memory-swap`` equal), CPU
  limits its CFS quota and requests its shares, when the host's cgroups offer those controllers
  (``podman info``; the test machine's cgroup v1 with cgroupfs has both); where they do not, the
  limit is skipped and the pod's events say so. 4096 pids per container stand for a kubelet's
  podPidsLimit; /dev/shm is 64 MiB, as on a kubelet;
- the exit code is ``podman run``'s exit status: the container's code, 128+N for signal N (137 for
  SIGKILL and the OOM killer, as the kubelet reports them); 125-127 when podman itself could not
  create or start it (a kubelet would report a StartError instead);
- signals: ``podman kill --signal TERM``, ``KILL`` after the grace period; a preStop exec hook is
  ``podman exec`` (the container's user, env and capabilities);
- output: the container's stdout and stderr go straight to its log file (passthrough);
- leftovers: every container is ``--rm`` and labelled with the run's prefix and the test process's
  pid. The cluster removes its containers on stop; a reaper (reaper.py, in its own session) removes
  them and the run's network namespaces when the test process dies without stopping the cluster
  (SIGKILL); ``remove_leftovers()`` (the image fixture's finalizer, and every cluster's start)
  removes those of test processes that are gone.

Not emulated beyond the host-venv runtime's list (runtime.py): the image's ``imagePullPolicy`` and
pulls (TAG must be in podman's store; a container naming another image fails with
ErrImageNeverPull), ephemeral-storage, hugepages, per-container OOM score adjustments, user
namespaces, AppArmor (podman's default profile is applied when the host has AppArmor), and the
pod-level cgroup (limits are per container).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from pod_harness.image import Image
from pod_harness.network import pid_alive
from pod_harness.runtime import Container, Kubelet, Pod

LABEL = "io.elastic-ctr.pod-harness"  # the run's prefix (ectr-PID-HEX, as the network namespaces)
OWNER = "io.elastic-ctr.pod-harness.owner"  # the pid of the test process that started it
PIDS_LIMIT = 4096
SHM_SIZE = "64m"
ENV_FILE_MAX_LINE = 60_000  # podman reads --env-file line by line, up to 64 KiB a line
_UNITS = {
    "": 1, "k": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4, "P": 1000**5, "E": 1000**6,
    "Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4, "Pi": 1024**5, "Ei": 1024**6,
}  # fmt: skip


def podman_missing() -> str | None:
    """Why the image runtime cannot run here (None when it can)."""
    if shutil.which("podman") is None:
        return "podman not available"
    return None


def bytes_of(quantity: str | int) -> int:
    """A Kubernetes quantity (``128Mi``, ``1G``, ``1e9``, ``500m``) in bytes, rounded up."""
    text = str(quantity).strip()
    for suffix in sorted(_UNITS, key=len, reverse=True):
        if suffix and text.endswith(suffix):
            return int(-(-float(text[: -len(suffix)]) * _UNITS[suffix] // 1))
    if text.endswith("m"):
        return int(-(-float(text[:-1]) // 1000))
    return int(-(-float(text) // 1))


def cores_of(quantity: str | int | float) -> float:
    """A CPU quantity (``500m``, ``1``, ``0.25``) in cores."""
    text = str(quantity).strip()
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def podman(env: dict, *args: str, timeout: float = 60, cwd: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["podman", *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd or "/tmp"
    )


def image_config(tag: str, env: dict) -> Image:
    """The image's own config (``podman image inspect``): ENV, USER, WORKDIR, ENTRYPOINT, CMD."""
    res = podman(env, "image", "inspect", "--format", "{{json .Config}}", tag)
    if res.returncode != 0:
        raise RuntimeError(f"image {tag} is not in podman's store: {res.stderr.strip()}")
    config = json.loads(res.stdout)
    user = (config.get("User") or "").split(":")[0]
    return Image(
        env=dict(e.split("=", 1) for e in config.get("Env") or []),
        uid=int(user) if user.isdigit() else (0 if not user or user == "root" else None),
        user_name=None,
        home=None,
        workdir=config.get("WorkingDir") or "/",
        cmd=list(config.get("Cmd") or []),
        entrypoint=list(config.get("Entrypoint") or []),
    )


def cgroup_controllers(env: dict) -> set[str]:
    res = podman(env, "info", "--format", "json")
    if res.returncode != 0:
        return set()
    return set(json.loads(res.stdout)["host"].get("cgroupControllers") or [])


def remove_leftovers(env: dict, *, prefix: str | None = None, owner: int | None = None) -> list[str]:
    """Remove the harness's containers: those of run ``prefix``, of test process ``owner``, and (always)
    those whose test process is gone. Returns their names."""
    res = podman(env, "ps", "--all", "--filter", f"label={LABEL}", "--format", "json")
    if res.returncode != 0:
        return []
    names = []
    for entry in json.loads(res.stdout or "[]"):
        labels = entry.get("Labels") or {}
        try:
            pid = int(labels.get(OWNER, "0"))
        except ValueError:
            pid = 0
        if labels.get(LABEL) == prefix or pid == owner or not pid_alive(pid):
            names += entry.get("Names") or []
    if names:
        # --ignore: without it podman 4.3 removes none of them when one is already gone (and exits 0).
        podman(env, "rm", "--force", "--ignore", "--time", "0", *names, timeout=120)
    return names


class PodmanRuntime(Kubelet):
    """The kubelet's container runtime calls, made with podman and runc on the built image.

    ``make_spec(pod, container)`` (Cluster.run_spec) describes the container as the kubelet would hand
    it to the runtime; this class turns that into ``podman run`` and owns the containers' names."""

    def __init__(self, make_spec, *, tag: str, env: dict, prefix: str):
        super().__init__(make_spec, env)
        self.tag, self.env, self.prefix = tag, env, prefix
        self.controllers = cgroup_controllers(env)
        self.runc = shutil.which("runc") is not None
        self._reaper: subprocess.Popen | None = None
        self._clients = 0

    # ---- the run's lifetime ----------------------------------------------------------------------------
    def begin(self) -> None:
        """Remove what dead runs left, and start the reaper for this run."""
        remove_leftovers(self.env)
        self._reaper = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("reaper.py")), str(os.getpid()), self.prefix],
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C or a killed process group leaves it to do its work
            cwd="/tmp",
        )

    def cleanup(self) -> None:
        remove_leftovers(self.env, prefix=self.prefix)
        if self._reaper is not None and self._reaper.poll() is None:
            self._reaper.kill()
            self._reaper.wait(10)

    # ---- podman run ------------------------------------------------------------------------------------
    def limit_notes(self, spec: dict) -> list[str]:
        """The limits of ``spec`` this host's cgroups cannot enforce."""
        notes = []
        if spec.get("memory_limit") and "memory" not in self.controllers:
            notes.append("no memory cgroup controller: memory limit not enforced")
        if (spec.get("cpu_limit") or spec.get("cpu_request")) and "cpu" not in self.controllers:
            notes.append("no cpu cgroup controller: CPU limit and request not enforced")
        return notes

    def run_argv(self, spec: dict, name: str, env_file: Path) -> list[str]:
        argv = ["podman", "run", "--rm", "--name", name, "--label", f"{LABEL}={self.prefix}",
                "--label", f"{OWNER}={os.getpid()}", "--pull", "never", "--log-driver", "passthrough",
                "--network", f"ns:/run/netns/{spec['netns']}", "--hostname", spec["hostname"]]  # fmt: skip
        if self.runc:
            argv += ["--runtime", "runc"]
        argv += ["--user", f"{spec['uid']}:{spec['gid']}"]
        for group in spec.get("groups") or []:
            argv += ["--group-add", str(group)]
        if spec.get("read_only_root"):
            argv += ["--read-only", "--read-only-tmpfs=false"]  # no tmpfs on /tmp, /run: a volume or nothing
        if spec.get("drop_all_caps"):
            argv += ["--cap-drop", "ALL"]
        for cap in spec.get("add_caps") or []:
            argv += ["--cap-add", cap]
        if spec.get("no_new_privs"):
            argv += ["--security-opt", "no-new-privileges"]
        if spec.get("seccomp") == "Unconfined":
            argv += ["--security-opt", "seccomp=unconfined"]  # RuntimeDefault and unset: podman's default
        argv += ["--shm-size", SHM_SIZE, "--pids-limit", str(PIDS_LIMIT)]
        if spec.get("memory_limit") and "memory" in self.controllers:
            argv += ["--memory", str(spec["memory_limit"]), "--memory-swap", str(spec["memory_limit"])]
        if "cpu" in self.controllers:
            if spec.get("cpu_limit"):
                argv += ["--cpus", f"{spec['cpu_limit']:g}"]
            if spec.get("cpu_request"):
                argv += ["--cpu-shares", str(max(2, int(spec["cpu_request"] * 1024)))]
        lines = []
        for key, value in spec["env"].items():
            if "\n" in value or "\r" in value or len(key) + len(value) > ENV_FILE_MAX_LINE or "*" in key:
                argv += ["--env", f"{key}={value}"]
            else:
                lines.append(f"{key}={value}\n")
        env_file.write_text("".join(lines))
        env_file.chmod(0o600)
        argv += ["--env-file", str(env_file)]
        mounts = [
            {"source": spec["hosts_file"], "target": "/etc/hosts", "read_only": True},
            {"source": spec["resolv_file"], "target": "/etc/resolv.conf", "read_only": True},
            *spec["mounts"],
        ]
        for m in mounts:
            option = f"type=bind,source={m['source']},target={m['target']}"
            argv += ["--mount", option + (",ro=true" if m.get("read_only") else "")]
        if spec.get("workdir"):
            argv += ["--workdir", spec["workdir"]]
        if spec.get("entrypoint") is not None:
            argv += ["--entrypoint", json.dumps(spec["entrypoint"])]
        return argv + [self.tag, *spec.get("args", [])]

    def container_name(self, pod: Pod, c: Container) -> str:
        return f"{self.prefix}-{pod.name}-{c.name}-{c.generation}"

    def launch(self, pod: Pod, c: Container, log) -> subprocess.Popen:
        spec = self.make_spec(pod, c)
        for note in self.limit_notes(spec):
            pod.event(f"container {c.name}: {note}")
        c.runtime_name = self.container_name(pod, c)
        c.pid_of = self.pid
        spec_path = pod.dir / f"{c.name}.spec-{c.generation}.json"
        spec_path.write_text(json.dumps(spec))
        spec_path.chmod(0o600)  # the env holds the Secrets' values
        argv = self.run_argv(spec, c.runtime_name, pod.dir / f"{c.name}.env-{c.generation}")
        (pod.dir / f"{c.name}.podman-{c.generation}.json").write_text(json.dumps(argv))
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=str(pod.dir),  # conmon writes a file `oom` into its working folder on an OOM kill
            # No die_with_parent: its signal comes when the *thread* that started the client ends (the
            # controllers' thread, before stop() stops the pods), and killing the client would not stop
            # the container anyway (conmon keeps it). A dead test process is the reaper's.
        )

    # ---- the running container -------------------------------------------------------------------------
    def pid(self, c: Container) -> int | None:
        res = podman(self.env, "inspect", "--format", "{{.State.Pid}}", c.runtime_name or "")
        value = res.stdout.strip()
        return int(value) if res.returncode == 0 and value.isdigit() and int(value) > 0 else None

    def signal(self, pod: Pod, c: Container, sig: int) -> None:
        """``podman kill --signal``; a container podman has not started yet (or is still removing) is tried
        again until it runs or its ``podman run`` ended."""
        name = signal.Signals(sig).name
        deadline = time.monotonic() + 20
        while c.proc is not None and c.proc.poll() is None:
            res = podman(self.env, "kill", "--signal", name, c.runtime_name or "", timeout=30)
            if res.returncode == 0:
                return
            if time.monotonic() > deadline:
                pod.event(f"podman kill --signal {name} {c.runtime_name} failed: {res.stderr.strip()[-300:]}")
                return
            time.sleep(0.2)

    def exec_prefix(self, pod: Pod, c: Container) -> tuple[list[str], dict] | None:
        if c.proc is None or c.proc.poll() is not None:
            return None
        return ["podman", "exec", c.runtime_name or ""], self.env

    def exec_in(self, pod: Pod, c: Container, argv: list[str], timeout: float) -> subprocess.CompletedProcess | None:
        if c.proc is None or c.proc.poll() is not None:
            return None
        return subprocess.run(
            ["podman", "exec", c.runtime_name or "", *argv],
            env=self.env,
            capture_output=True,
            timeout=timeout,
            cwd="/tmp",
        )
