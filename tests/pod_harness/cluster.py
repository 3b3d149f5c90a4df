"""Run rendered Kubernetes manifests the way a one-node cluster would, with no image.

``Cluster(docs, workdir)`` takes the documents `elastic-control -r --backend k8s`
wrote and acts as the API server's controllers, the scheduler, kubelet,
kube-proxy and cluster DNS of one node:

- ConfigMaps and Secrets are data for env (``configMapKeyRef``, ``secretKeyRef``,
  ``envFrom``) and volumes; PersistentVolumeClaims are folders under
  ``workdir/claims/`` (they outlive pods); emptyDirs are folders of their pod.
- Deployments keep ``replicas`` pods (a deleted pod is replaced at once, under a
  new name and IP). Volcano Jobs get pods ``JOB-TASK-I`` with the ``svc`` plugin
  (hostname/subdomain, ``VC_<TASK>_HOSTS``/``_NUM``, /etc/volcano/TASK.host, the
  headless Service JOB and names ``JOB-TASK-I.JOB``, its NetworkPolicy admitting
  the job's pods unless ``--disable-network-policy``) and the ``env`` plugin
  (``VK_TASK_INDEX``, ``VC_TASK_INDEX``, after the container's own variables); their policies are
  applied as Volcano's job controller matches them (task-level first, in order,
  by event or exit code): RestartJob within ``maxRetry``, AbortJob, CompleteJob...;
  a job pod deleted or evicted (``delete_pod``, ``evict``) raises PodEvicted, and
  with no policy for it the pod is made again (syncJob), the job not restarted.
- every pod gets its own network namespace and IP on a bridge, the kubelet's
  hosts file (localhost, its own names) and resolv.conf (the namespace's search
  list, ``ndots:5``, the cluster DNS at network.DNS_IP); Services get a cluster IP
  on which the node agent (node_agent.py) forwards to ready endpoints; the node
  agent also answers the cluster DNS as CoreDNS would: Service names, and the
  headless names (``JOB-TASK-I.JOB``...) only while their pod is ready, as the
  endpoints controller publishes them; probes run from the node.
- NetworkPolicies (ingress, matchLabels) apply to Service traffic (in the node
  agent) and to direct pod-to-pod connections (nftables in each pod's namespace,
  rewritten as pods come and go), dropping what they do not admit.
- Pod Security "restricted" is enforced at admission (admission.py), and the
  containers run as their uid/gid/fsGroup with no capabilities and
  no_new_privs when the manifest says so.
- ``enableServiceLinks`` (the default) injects ``NAME_SERVICE_HOST``,
  ``NAME_PORT=tcp://...`` variables as the kubelet does.

Containers run one of two ways (runtime.py): by default as process trees over
this checkout's .venv (image.py emulates the Dockerfile); with
``Cluster(..., image=TAG, podman_env=ENV)`` as ``podman run`` of the built image
with runc (podman.py): the image's own files, user and ENV, the
securityContext, memory and CPU limits and podman's default seccomp profile
enforced, every container (init containers, eval jobs, client pods) from TAG.

What it does not emulate: image pulls, multiple nodes (ReadWriteOnce is always
satisfiable), probe types other than httpGet/tcpSocket, egress policies, DNS
beyond A records over UDP (no SRV, PTR, pod ``a-b-c-d`` records, TCP or upstream
resolver), and, in the default runtime, resource limits (no cgroups) and seccomp
profiles.

``POD_HARNESS_PYTHONPATH`` (a test hook) is put first on every container's
PYTHONPATH: the pods then run another checkout's modules (a branch under review)
with this checkout's manifests.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import itertools
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from pod_harness.admission import restricted_violations
from pod_harness.image import SYSTEM_PATH, image_paths, interpreter_exposure, load_image, venv_bin
from pod_harness.network import DNS_IP, NODE_IP, Network
from pod_harness.node_agent import admitted_ports, pod_ready
from pod_harness.podman import PodmanRuntime, bytes_of, cores_of, image_config
from pod_harness.runtime import Container, Kubelet, Pod, die_with_parent

AGENT = str(Path(__file__).resolve().parent / "node_agent.py")
VOLCANO_API = "batch.volcano.sh/"
CLUSTER_DOMAIN = "cluster.local"
HANDLED_KINDS = {
    "ConfigMap", "Secret", "PersistentVolumeClaim", "Service", "Deployment", "PodDisruptionBudget", "NetworkPolicy",
    "ServiceAccount", "Role", "RoleBinding",
}  # fmt: skip
LABEL_INSTANCE = "app.kubernetes.io/instance"
TERMINAL_JOB_PHASES = {"Completed", "Failed", "Aborted", "Terminated"}


class HarnessError(RuntimeError):
    pass


def _interrupt(*_) -> None:
    raise KeyboardInterrupt("SIGTERM")


def _command_args(spec: dict, env: dict) -> tuple[list[str], list[str]]:
    """The container's command and args with $(VAR) expanded from its env, as the kubelet does."""
    return [_expand(a, env) for a in spec.get("command") or []], [_expand(a, env) for a in spec.get("args") or []]


def _mount_source(pod: Pod, vm: dict) -> Path:
    """The host folder (or file, with subPath) behind a volumeMount of the pod."""
    source = pod.volumes.get(vm["name"])
    if source is None:
        raise HarnessError(f"pod {pod.name}: volumeMount {vm['name']!r} has no volume")
    return source / vm["subPath"] if vm.get("subPath") else source


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: known names replaced, $$ escapes, unknown left as written."""

    def repl(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", repl, text)


def _service_env_name(name: str) -> str:
    return name.upper().replace("-", "_")


class DeploymentController:
    def __init__(self, cluster: Cluster, doc: dict):
        self.cluster, self.doc = cluster, doc
        self.name = doc["metadata"]["name"]
        self.replicas = doc["spec"].get("replicas", 1)
        template = doc["spec"]["template"]
        self.template_hash = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]
        self.pods: list[Pod] = []

    def sync(self) -> None:
        self.pods = [p for p in self.pods if not p.gone]
        live = [p for p in self.pods if not p.terminating]
        for _ in range(self.replicas - len(live)):
            name = f"{self.name}-{self.template_hash}-{secrets.token_hex(3)[:5]}"
            template = copy.deepcopy(self.doc["spec"]["template"])
            labels = {**template["metadata"].get("labels", {}), "pod-template-hash": self.template_hash}
            pod = self.cluster.create_pod(name, template, labels, owner=("Deployment", self.name))
            if pod is not None:
                self.pods.append(pod)


class VolcanoJob:
    """Volcano's job controller for one Job, with its svc and env plugins."""

    def __init__(self, cluster: Cluster, doc: dict, *, task_index_label: bool = True):
        self.cluster, self.doc = cluster, doc
        self.name = doc["metadata"]["name"]
        self.spec = doc["spec"]
        self.task_index_label = task_index_label
        self.phase = "Pending"
        self.retry_count = 0
        self.version = 0
        self.events: list[str] = []
        self.pods: dict[tuple[str, int], Pod] = {}
        self.plugins = self.spec.get("plugins") or {}
        self.ips: dict[str, str] = {}
        for task in self.spec["tasks"]:
            for i in range(task.get("replicas", 1)):
                self.ips[self.pod_name(task["name"], i)] = cluster.network.next_pod_ip()
        if "svc" in self.plugins:
            cluster.config_maps[f"{self.name}-svc"] = self.svc_hosts()
            if not self._svc_flag("disable-network-policy"):
                # The plugin's NetworkPolicy JOB: the job's pods accept the job's pods (other policies add up).
                only_the_job = {"matchLabels": self.selector()}
                cluster.network_policies.append(
                    {
                        "podSelector": only_the_job,
                        "policyTypes": ["Ingress"],
                        "ingress": [{"from": [{"podSelector": only_the_job}]}],
                    }
                )
        self._pending_restart: str | None = None

    def _svc_flag(self, name: str) -> bool:
        """A boolean flag of the svc plugin's arguments (Go's flag syntax: -name, --name, --name=true)."""
        return any(a.lstrip("-") in (name, f"{name}=true") for a in self.plugins.get("svc") or [])

    def selector(self) -> dict[str, str]:
        """The labels that select the job's pods (its headless Service's and NetworkPolicy's selector)."""
        return {"volcano.sh/job-name": self.name, "volcano.sh/job-namespace": self.cluster.namespace}

    def pod_name(self, task: str, index: int) -> str:
        return f"{self.name}-{task}-{index}"

    def svc_hosts(self) -> dict[str, str]:
        data = {}
        for task in self.spec["tasks"]:
            hosts = [f"{self.pod_name(task['name'], i)}.{self.name}" for i in range(task.get("replicas", 1))]
            key = task["name"].replace("-", "_")
            data[f"{key}.host"] = "\n".join(hosts)
            data[f"VC_{key.upper()}_HOSTS"] = ",".join(hosts)
            data[f"VC_{key.upper()}_NUM"] = str(len(hosts))
        return data

    def headless_service(self) -> dict | None:
        """The svc plugin's headless Service JOB (the node agent's view), whose endpoints give the pods their
        names ``JOB-TASK-I.JOB``: its ready pods, or all with the plugin's ``--publish-not-ready-addresses``."""
        if "svc" not in self.plugins:
            return None
        return {
            "name": self.name,
            "ip": None,
            "selector": self.selector(),
            "publishNotReadyAddresses": self._svc_flag("publish-not-ready-addresses"),
            "ports": [],
        }

    def create_task_pod(self, task: dict, index: int) -> None:
        template = copy.deepcopy(task["template"])
        name = self.pod_name(task["name"], index)
        spec = template["spec"]
        labels = {
            **template.get("metadata", {}).get("labels", {}),
            **self.selector(),
            "volcano.sh/task-spec": task["name"],
            "volcano.sh/queue-name": self.spec.get("queue", "default"),
        }
        if self.task_index_label:  # added by Volcano 1.9
            labels["volcano.sh/task-index"] = str(index)
        if "svc" in self.plugins:
            spec.setdefault("hostname", name)
            spec.setdefault("subdomain", self.name)
            host_env = [
                {"name": key, "valueFrom": {"configMapKeyRef": {"name": f"{self.name}-svc", "key": key}}}
                for key in self.svc_hosts()
                if key.startswith("VC_")
            ]
            volume = {"name": f"{self.name}-svc", "configMap": {"name": f"{self.name}-svc"}}
            spec.setdefault("volumes", []).append(volume)
            for c in spec.get("containers", []) + spec.get("initContainers", []):
                c.setdefault("env", []).extend(copy.deepcopy(host_env))
                c.setdefault("volumeMounts", []).append({"name": f"{self.name}-svc", "mountPath": "/etc/volcano"})
        if "env" in self.plugins:
            for c in spec.get("containers", []) + spec.get("initContainers", []):
                c.setdefault("env", []).extend(
                    [{"name": "VK_TASK_INDEX", "value": str(index)}, {"name": "VC_TASK_INDEX", "value": str(index)}]
                )
        spec.setdefault("schedulerName", self.spec.get("schedulerName", "volcano"))
        pod = self.cluster.create_pod(name, template, labels, owner=("Job", self.name), ip=self.ips[name])
        if pod is not None:
            pod.task, pod.index = task["name"], index
            self.pods[(task["name"], index)] = pod
        else:
            self.pods.pop((task["name"], index), None)  # refused: no pod to make again at every sync

    def start(self) -> None:
        self.version += 1
        for task in self.spec["tasks"]:
            for i in range(task.get("replicas", 1)):
                self.create_task_pod(task, i)
        self.phase = "Running"

    def action_for(self, task_name: str, event: str | None, exit_code: int | None) -> str | None:
        """Volcano's applyPolicies: the task's policies, then the job's, first match wins."""
        task = next((t for t in self.spec["tasks"] if t["name"] == task_name), {})
        for policy in (task.get("policies") or []) + (self.spec.get("policies") or []):
            events = list(policy.get("events") or []) + ([policy["event"]] if policy.get("event") else [])
            if event and (event in events or "*" in events):
                return policy["action"]
            if policy.get("exitCode") is not None and exit_code is not None and policy["exitCode"] == exit_code:
                return policy["action"]
        return None

    def _terminate_all(self, then_phase: str, why: str) -> None:
        self.events.append(why)
        self.phase = then_phase
        for pod in self.pods.values():
            if not pod.terminating:
                self.cluster.kubelet.terminate(pod, on_gone=self.cluster.pod_gone)

    def sync(self) -> None:
        if self.phase in TERMINAL_JOB_PHASES:
            return
        if self.phase == "Pending":
            self.start()
            return
        if self.phase == "Restarting":
            if all(p.gone for p in self.pods.values()):
                self.pods.clear()
                self.start()
                self.events.append(f"restarted (retry {self.retry_count} of {self.spec.get('maxRetry', 3)})")
            return
        if self.phase in ("Aborting", "Completing", "Failing", "Terminating"):
            if all(p.gone for p in self.pods.values()):
                self.phase = {"Aborting": "Aborted", "Completing": "Completed", "Failing": "Failed"}.get(
                    self.phase, "Terminated"
                )
            return
        for (task, index), pod in list(self.pods.items()):
            if pod.gone:  # deleted from outside with no policy for PodEvicted: syncJob makes every missing pod
                self.create_task_pod(next(t for t in self.spec["tasks"] if t["name"] == task), index)
        for (task, index), pod in list(self.pods.items()):
            if pod.phase == "Failed" and not pod.terminating:
                code = next((c.exit_code for c in pod.containers if c.exit_code), None)
                action = self.action_for(task, "PodFailed", code)
                why = f"pod {pod.name} failed (exit code {code}): {action or 'no policy'}"
                if self._act(action, why, task, index):
                    return
        for task in self.spec["tasks"]:
            mine = [p for (t, _), p in self.pods.items() if t == task["name"]]
            if mine and all(p.phase == "Succeeded" for p in mine):
                action = self.action_for(task["name"], "TaskCompleted", None)
                if action and self._act(action, f"task {task['name']} completed: {action}", task["name"], None):
                    return
        if self.pods and all(p.phase in ("Succeeded", "Failed") for p in self.pods.values()):
            succeeded = sum(p.phase == "Succeeded" for p in self.pods.values())
            self.phase = "Completed" if succeeded >= self.spec.get("minSuccess", len(self.pods)) else "Failed"

    def pod_deleted(self, pod: Pod) -> None:
        """A pod of the job deleted or evicted from outside (``kubectl delete``, a drain): Volcano's job
        controller sees its deletion timestamp as the PodEvicted event and applies the policies to it. With
        no policy for it, the pod is made again once it is gone (``sync``), as syncJob makes missing pods."""
        if self.phase != "Running" or self.pods.get((pod.task, pod.index)) is not pod:
            return  # a pod of an earlier version, or a job already restarting or ending: Volcano ignores it
        action = self.action_for(pod.task, "PodEvicted", None)
        why = f"pod {pod.name} evicted (PodEvicted): {action or 'no policy, made again'}"
        if not self._act(action, why, pod.task, pod.index):
            self.events.append(why)

    def _act(self, action: str | None, why: str, task: str, index: int | None) -> bool:
        if action is None:
            return False
        if action == "RestartJob":
            if self.retry_count >= self.spec.get("maxRetry", 3):
                self._terminate_all("Failing", f"{why}; maxRetry {self.spec.get('maxRetry', 3)} reached: Failed")
            else:
                self.retry_count += 1
                self._terminate_all("Restarting", why)
            return True
        if action == "AbortJob":
            self._terminate_all("Aborting", why)
            return True
        if action in ("CompleteJob", "TerminateJob"):
            self._terminate_all("Completing" if action == "CompleteJob" else "Terminating", why)
            return True
        if action in ("RestartTask", "RestartPod"):
            self.events.append(why)
            targets = [(t, i) for (t, i) in self.pods if t == task and (action == "RestartTask" or i == index)]
            for key in targets:
                if self.pods[key].terminating:
                    continue  # already being deleted (PodEvicted): sync makes it again once it is gone
                pod = self.pods.pop(key)
                spec = next(t for t in self.spec["tasks"] if t["name"] == key[0])

                def recreate(gone_pod, spec=spec, key=key):
                    self.cluster.pod_gone(gone_pod)
                    self.create_task_pod(spec, key[1])

                self.cluster.kubelet.terminate(pod, on_gone=recreate)
            return True
        raise HarnessError(f"the harness does not emulate Volcano action {action!r}")


class Cluster:
    def __init__(
        self,
        docs: list[dict],
        workdir: Path,
        *,
        task_index_label: bool = True,
        image: str | None = None,
        podman_env: dict | None = None,
    ):
        """``image``: run every container from this image (in podman's store) with podman and runc;
        ``podman_env`` is the environment of every podman call (CONTAINERS_CONF...)."""
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.docs = docs
        self.task_index_label = task_index_label
        self.image_tag = image
        self.podman_env = dict(podman_env if podman_env is not None else os.environ)
        self.image = image_config(image, self.podman_env) if image else load_image()
        self.network = Network()
        self.lock = threading.RLock()
        self.config_maps: dict[str, dict] = {}
        self.secrets: dict[str, dict] = {}
        self.claims: dict[str, dict] = {}
        self.services: dict[str, dict] = {}
        self.service_ips: dict[str, str] = {}
        self.pdbs: list[dict] = []
        self.network_policies: list[dict] = []  # specs, enforced by the node agent and per-pod nftables
        self.service_accounts: set[str] = set()  # a pod naming another account is refused, as the API does
        self.clients: dict[str, dict] = {}  # "outsider" / "member": ip, netns, labels (made in start())
        self.deployments: dict[str, DeploymentController] = {}
        self.jobs: dict[str, VolcanoJob] = {}
        self.pods: dict[str, Pod] = {}
        self.refused: list[str] = []  # admission refusals
        self.probe_status: dict = {}
        self.kubelet = (
            PodmanRuntime(self.run_spec, tag=image, env=self.podman_env, prefix=self.network.prefix)
            if image
            else Kubelet(self.container_spec, {"PATH": SYSTEM_PATH})
        )
        self.namespace = self._namespace(docs)
        self.instance = self._instance(docs)
        self._agent: subprocess.Popen | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._state_text = ""
        self._clients = itertools.count()
        self._resolv = self.workdir / "resolv.conf"
        self._expose = interpreter_exposure()
        self._ingress: dict[str, dict | None] = {}  # pod namespace -> what its nft chain admits (set_ingress)

    @classmethod
    def from_manifests(cls, manifest_dir: Path, workdir: Path, **kwargs) -> Cluster:
        docs = []
        for path in sorted(Path(manifest_dir).glob("*.yaml")):
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
        return cls(docs, workdir, **kwargs)

    @staticmethod
    def _namespace(docs: list[dict]) -> str:
        found = {d["metadata"].get("namespace", "default") for d in docs}
        if len(found) != 1:
            raise HarnessError(f"the harness runs one namespace; the manifests use {sorted(found)}")
        return found.pop()

    @staticmethod
    def _instance(docs: list[dict]) -> str:
        found = {(d["metadata"].get("labels") or {}).get(LABEL_INSTANCE) for d in docs} - {None}
        return found.pop() if len(found) == 1 else ""

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def __enter__(self) -> Cluster:
        # SIGTERM (a CI timeout, `kill`) unwinds like Ctrl-C, so the namespaces are removed either way.
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, _interrupt)
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            if getattr(self, "_old_sigterm", None) is not None:
                signal.signal(signal.SIGTERM, self._old_sigterm)

    def start(self) -> None:
        self.network.create()
        if isinstance(self.kubelet, PodmanRuntime):
            self.kubelet.begin()
        # The kubelet's resolv.conf for dnsPolicy ClusterFirst: the cluster DNS, the namespace's search list.
        domain = CLUSTER_DOMAIN
        self._resolv.write_text(
            f"search {self.namespace}.svc.{domain} svc.{domain} {domain}\nnameserver {DNS_IP}\noptions ndots:5\n"
        )
        self._agent_state = self.workdir / "agent-state.json"
        self._agent_status = self.workdir / "agent-status.json"
        self._write_agent_state()
        log = open(self.workdir / "node-agent.log", "ab")
        self._agent = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                self.network.node_ns,
                sys.executable,
                AGENT,
                str(self._agent_state),
                str(self._agent_status),
                DNS_IP,
            ],  # fmt: skip
            stdout=log,
            stderr=subprocess.STDOUT,
            env={"PATH": SYSTEM_PATH},
            preexec_fn=die_with_parent,
        )
        # Two client pods, as `kubectl run` gives: one of another app, one labelled as the instance's.
        for kind, labels in (("outsider", {}), ("member", {LABEL_INSTANCE: self.instance})):
            ip = self.network.next_pod_ip()
            self.clients[kind] = {"ip": ip, "netns": self.network.add_pod(ip), "labels": labels}
        for doc in self.docs:
            self._admit_object(doc)
        self._write_agent_state()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="harness-controllers")
        self._thread.start()

    def stop(self, grace: float = 3.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        with self.lock:
            for job in self.jobs.values():
                job.phase = "Terminated"
            threads = [self.kubelet.terminate(p, grace=grace) for p in self.pods.values() if not p.terminating]
        for t in threads:
            t.join(grace + 15)
        self.kubelet.cleanup()
        if self._agent is not None and self._agent.poll() is None:
            self._agent.kill()
            self._agent.wait(10)
        self.network.destroy()

    # ---- objects -----------------------------------------------------------------------------------------
    def _admit_object(self, doc: dict) -> None:
        kind, name = doc["kind"], doc["metadata"]["name"]
        if kind == "ConfigMap":
            self.config_maps[name] = dict(doc.get("data") or {})
        elif kind == "Secret":
            data = {k: base64.b64decode(v).decode() for k, v in (doc.get("data") or {}).items()}
            data.update(doc.get("stringData") or {})
            self.secrets[name] = data
        elif kind == "PersistentVolumeClaim":
            self.claims[name] = doc["spec"]
            self.claim_dir(name).mkdir(parents=True, exist_ok=True)
        elif kind == "Service":
            self.services[name] = doc
            if doc["spec"].get("clusterIP") != "None":
                self.service_ips[name] = self.network.service_ip()
        elif kind == "PodDisruptionBudget":
            self.pdbs.append(doc)
        elif kind == "NetworkPolicy":
            self.network_policies.append(doc["spec"])
        elif kind == "ServiceAccount":
            self.service_accounts.add(name)
        elif kind in ("Role", "RoleBinding"):
            pass  # no API server answers the harness's pods: a token (and what it may do) means nothing here
        elif kind == "Deployment":
            self.deployments[name] = DeploymentController(self, doc)
        elif kind == "Job" and doc["apiVersion"].startswith(VOLCANO_API):
            self.jobs[name] = VolcanoJob(self, doc, task_index_label=self.task_index_label)  # pods: first sync
        else:
            raise HarnessError(f"the harness does not run kind {kind} ({doc['apiVersion']})")

    def claim_dir(self, claim: str) -> Path:
        return self.workdir / "claims" / claim

    # ---- pods ----------------------------------------------------------------------------------------------
    def create_pod(self, name: str, template: dict, labels: dict, *, owner, ip: str | None = None) -> Pod | None:
        """Admit (Pod Security "restricted") and start a pod; None when admission refuses it."""
        spec = template["spec"]
        account = spec.get("serviceAccountName")
        if account and account not in self.service_accounts:  # the API server refuses such a pod
            self.refused.append(f"pod {name}: error looking up service account {self.namespace}/{account}")
            return None
        problems = restricted_violations(spec)
        if problems:
            self.refused.append(f"pod {name}: violates PodSecurity restricted: {'; '.join(problems)}")
            return None
        pod = Pod(
            name=name,
            namespace=self.namespace,
            labels=labels,
            annotations=dict(template.get("metadata", {}).get("annotations") or {}),
            spec=spec,
            owner=owner,
            ip=ip or self.network.next_pod_ip(),
            dir=self.workdir / "pods" / f"{name}-{secrets.token_hex(2)}",
        )
        pod.dir.mkdir(parents=True)
        pod.netns = self.network.add_pod(pod.ip)
        self._make_volumes(pod)
        (pod.dir / "hosts").write_text(self._hosts_for(pod))
        for c in pod.all_containers():
            try:
                self.container_env(pod, c.spec)
            except HarnessError as e:
                pod.env_errors.append(str(e))
        self.pods[name] = pod
        return pod

    def _enforce_policies(self) -> None:
        """The NetworkPolicies on direct connections (pod IPs, headless names), as the CNI enforces them: each
        pod's namespace admits, per source pod or client, the ports its policies admit from that source's
        labels. Rewritten (nft) only for the pods where that changed: pods come and go with new IPs."""
        sources = [(p.ip, p.labels) for p in self.pods.values() if p.netns and not p.gone]
        sources += [(c["ip"], c["labels"]) for c in self.clients.values()]
        live = set()
        for pod in self.pods.values():
            if not pod.netns or pod.gone:
                continue
            live.add(pod.netns)
            view = pod.agent_view()
            admitted: dict[str, set[int] | None] | None = None
            if admitted_ports(self.network_policies, view, None) is not None:  # some policy selects the pod
                admitted = {
                    ip: admitted_ports(self.network_policies, view, labels) for ip, labels in sources if ip != pod.ip
                }
            if self._ingress.get(pod.netns, "unset") != admitted:
                try:
                    self.network.set_ingress(pod.netns, admitted)
                except RuntimeError as e:
                    # nft can fail while the pod is being removed (its namespace's processes are killed, nft
                    # among them): tried again next round, so the controllers never stop over one pod.
                    if str(e) not in pod.events:
                        pod.event(str(e))
                    continue
                self._ingress[pod.netns] = admitted
        for netns in set(self._ingress) - live:
            del self._ingress[netns]

    def pod_gone(self, pod: Pod) -> None:
        self.network.remove_pod(pod.netns)
        with self.lock:
            if self.pods.get(pod.name) is pod:
                del self.pods[pod.name]

    def _fs_group(self, pod: Pod) -> int | None:
        return (pod.spec.get("securityContext") or {}).get("fsGroup")

    def _own(self, path: Path, pod: Pod) -> None:
        """fsGroup: the volume becomes group-owned by it, group-writable, set-gid (recursively, as the kubelet)."""
        group = self._fs_group(pod)
        if group is None:
            return
        for root, _dirs, files in os.walk(path):
            os.chown(root, -1, group)
            os.chmod(root, (os.stat(root).st_mode & 0o7777) | 0o2070)
            for f in files:
                p = os.path.join(root, f)
                os.chown(p, -1, group)
                os.chmod(p, (os.stat(p).st_mode & 0o7777) | 0o060)

    def _make_volumes(self, pod: Pod) -> None:
        for volume in pod.spec.get("volumes") or []:
            name = volume["name"]
            if "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]["claimName"]
                if claim not in self.claims:
                    pod.env_errors.append(f'persistentvolumeclaim "{claim}" not found')
                    continue
                path = self.claim_dir(claim)
                self._own(path, pod)
            elif "emptyDir" in volume:
                path = pod.dir / "volumes" / name
                path.mkdir(parents=True)
                self._own(path, pod)
            elif "configMap" in volume or "secret" in volume:
                source = volume.get("configMap") or volume.get("secret")
                ref = source.get("name") or source.get("secretName")
                data = (self.config_maps if "configMap" in volume else self.secrets).get(ref)
                if data is None:
                    if not source.get("optional"):
                        pod.env_errors.append(f"{'configmap' if 'configMap' in volume else 'secret'} {ref!r} not found")
                    continue
                path = pod.dir / "volumes" / name
                path.mkdir(parents=True)
                items = source.get("items") or [{"key": key, "path": key} for key in data]
                for item in items:
                    target = path / item["path"]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_text(data[item["key"]])
                    target.chmod(item.get("mode", source.get("defaultMode", 0o644)))
                self._own(path, pod)
            else:
                raise HarnessError(f"pod {pod.name}: the harness does not emulate volume {volume}")
            pod.volumes[name] = path

    def _hosts_for(self, pod: Pod) -> str:
        """The kubelet's hosts file: localhost and the pod's own names; every other name is the DNS's."""
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        sub = pod.spec.get("subdomain")
        if sub:
            fqdn = f"{pod.hostname}.{sub}.{self.namespace}.svc.{CLUSTER_DOMAIN}"
            lines.append(f"{pod.ip}\t{fqdn}\t{pod.hostname}")
        else:
            lines.append(f"{pod.ip}\t{pod.hostname}")
        return "\n".join(lines) + "\n"

    # ---- containers ----------------------------------------------------------------------------------------
    def _lookup(self, kind: str, ref: dict) -> str | None:
        store = self.config_maps if kind == "configMapKeyRef" else self.secrets
        data = store.get(ref["name"])
        if data is None or ref["key"] not in data:
            if ref.get("optional"):
                return None
            what = "configmap" if kind == "configMapKeyRef" else "secret"
            raise HarnessError(f"{what} {ref['name']!r} has no key {ref['key']!r}")
        return data[ref["key"]]

    def _field(self, pod: Pod, path: str) -> str:
        m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
        if m:
            return (pod.labels if m.group(1) == "labels" else pod.annotations).get(m.group(2), "")
        values = {
            "metadata.name": pod.name,
            "metadata.namespace": pod.namespace,
            "metadata.uid": pod.dir.name,
            "spec.nodeName": "harness-node",
            "spec.serviceAccountName": pod.spec.get("serviceAccountName", "default"),
            "status.hostIP": NODE_IP,
            "status.podIP": pod.ip,
            "status.podIPs": pod.ip,
        }
        if path not in values:
            raise HarnessError(f"the harness does not know fieldRef {path}")
        return values[path]

    def service_links(self) -> dict[str, str]:
        env = {}
        for name, ip in self.service_ips.items():
            base = _service_env_name(name)
            ports = self.services[name]["spec"]["ports"]
            env[f"{base}_SERVICE_HOST"] = ip
            env[f"{base}_SERVICE_PORT"] = str(ports[0]["port"])
            env[f"{base}_PORT"] = f"tcp://{ip}:{ports[0]['port']}"
            for p in ports:
                if p.get("name"):
                    env[f"{base}_SERVICE_PORT_{_service_env_name(p['name'])}"] = str(p["port"])
                proto = p.get("protocol", "TCP")
                key = f"{base}_PORT_{p['port']}_{proto}"
                env[key] = f"{proto.lower()}://{ip}:{p['port']}"
                env[f"{key}_PROTO"], env[f"{key}_PORT"], env[f"{key}_ADDR"] = proto.lower(), str(p["port"]), ip
        return env

    def container_env(self, pod: Pod, cspec: dict) -> dict[str, str]:
        """The container's environment as the kubelet builds it (image ENV underneath)."""
        env = dict(self.image.env)
        env.update(
            PATH=f"{venv_bin()}:{SYSTEM_PATH}",
            HOSTNAME=pod.hostname,
            HOME=self.image.home or "/",
        )
        if os.environ.get("POD_HARNESS_PYTHONPATH"):
            env["PYTHONPATH"] = os.environ["POD_HARNESS_PYTHONPATH"]
        env.update(self.kubelet_env(pod, cspec))
        return env

    def kubelet_env(self, pod: Pod, cspec: dict) -> dict[str, str]:
        """What the kubelet hands the runtime: envFrom, the service links, env (the image's ENV not in it)."""
        own: dict[str, str] = {}
        for source in cspec.get("envFrom") or []:
            ref = source.get("configMapRef") or source.get("secretRef")
            store = self.config_maps if "configMapRef" in source else self.secrets
            data = store.get(ref["name"])
            if data is None and not ref.get("optional"):
                raise HarnessError(f"envFrom {ref['name']!r} not found")
            own.update({source.get("prefix", "") + k: v for k, v in (data or {}).items()})
        services = self.service_links() if pod.spec.get("enableServiceLinks", True) else {}
        for e in cspec.get("env") or []:
            if "value" in e or "valueFrom" not in e:
                own[e["name"]] = _expand(str(e.get("value", "")), {**services, **own})
                continue
            source = e["valueFrom"]
            if "fieldRef" in source:
                own[e["name"]] = self._field(pod, source["fieldRef"]["fieldPath"])
            elif "configMapKeyRef" in source or "secretKeyRef" in source:
                kind = "configMapKeyRef" if "configMapKeyRef" in source else "secretKeyRef"
                value = self._lookup(kind, source[kind])
                if value is not None:
                    own[e["name"]] = value
            else:
                raise HarnessError(f"the harness does not resolve env source {sorted(source)}")
        return {**{k: v for k, v in services.items() if k not in own}, **own}

    def _security(self, pod: Pod, cspec: dict) -> dict:
        pod_sc = pod.spec.get("securityContext") or {}
        sc = cspec.get("securityContext") or {}
        uid = sc.get("runAsUser", pod_sc.get("runAsUser", self.image.uid))
        if uid is None and self.image_tag and sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
            # The built image's USER is a name (image_config): the kubelet refuses what it cannot check.
            raise HarnessError("container has runAsNonRoot and image has non-numeric user, cannot verify")
        uid = 0 if uid is None else uid
        gid = sc.get("runAsGroup", pod_sc.get("runAsGroup", uid if self.image.uid == uid else 0))
        if sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) and uid == 0:
            raise HarnessError("container has runAsNonRoot and image will run as root")
        groups = [g for g in [pod_sc.get("fsGroup"), *pod_sc.get("supplementalGroups", [])] if g is not None]
        return {
            "uid": uid,
            "gid": gid,
            "groups": groups,
            "no_new_privs": sc.get("allowPrivilegeEscalation") is False,
            "drop_all_caps": "ALL" in ((sc.get("capabilities") or {}).get("drop") or []),
            "read_only_root": bool(sc.get("readOnlyRootFilesystem")),
        }

    def container_spec(self, pod: Pod, c: Container) -> dict:
        """The spec container_entry.py turns into the running container."""
        env = self.container_env(pod, c.spec)
        command, args = _command_args(c.spec, env)
        if not command:
            command = list(self.image.entrypoint)
            args = args or ([] if c.spec.get("command") else list(self.image.cmd))
        mounts = [
            {"source": str(_mount_source(pod, vm)), "target": vm["mountPath"], "read_only": bool(vm.get("readOnly"))}
            for vm in c.spec.get("volumeMounts") or []
        ]
        read_only_root = bool((c.spec.get("securityContext") or {}).get("readOnlyRootFilesystem"))
        if self.image.home:
            home = pod.dir / f"home-{c.name}"
            home.mkdir(exist_ok=True)
            if self.image.uid is not None:
                os.chown(home, self.image.uid, self.image.uid)
            # The image's home is part of its root file system: read-only with it.
            mounts.append({"source": str(home), "target": self.image.home, "read_only": read_only_root})
        workdir = c.spec.get("workingDir") or self.image.workdir
        if workdir != "/":
            empty = pod.dir / "workdir"
            empty.mkdir(exist_ok=True)
            mounts.append({"source": str(empty), "target": workdir, "read_only": True})
        scratch = pod.dir / f"scratch-{c.name}-{c.generation}"
        scratch.mkdir(exist_ok=True)
        targets = [m["target"].rstrip("/") + "/" for m in mounts]
        reexpose = [p for p in image_paths() if any(p.startswith(t) for t in targets)]
        return {
            "reexpose": reexpose,
            "hostname": pod.hostname,
            "hosts_file": str(pod.dir / "hosts"),
            "resolv_file": str(self._resolv),
            "passwd_line": self.image.passwd_line(),
            "group_line": self.image.group_line(),
            "scratch": str(scratch),
            "expose": self._expose,
            "mounts": mounts,
            "env": env,
            "argv": command + args,
            "cwd": workdir,
            **self._security(pod, c.spec),
        }

    def run_spec(self, pod: Pod, c: Container) -> dict:
        """The container as the kubelet hands it to the container runtime (PodmanRuntime turns it into
        ``podman run``): the image's ENV, USER and WORKDIR are the image's own, not in here."""
        wanted = c.spec.get("image")
        if wanted and wanted not in (self.image_tag, f"localhost/{self.image_tag}"):
            raise HarnessError(f"ErrImageNeverPull: image {wanted} is not on this node (only {self.image_tag})")
        env = self.kubelet_env(pod, c.spec)
        command, args = _command_args(c.spec, env)
        kinds = {v["name"]: next(iter(set(v) - {"name"})) for v in pod.spec.get("volumes") or []}
        mounts = []
        for vm in c.spec.get("volumeMounts") or []:
            source = _mount_source(pod, vm)
            if vm.get("subPath") and not source.exists():
                source.mkdir(parents=True)  # the kubelet creates a missing subPath as a folder
            # ConfigMap and Secret volumes are read-only whatever the mount says (as since Kubernetes 1.10).
            read_only = bool(vm.get("readOnly")) or kinds.get(vm["name"]) in ("configMap", "secret")
            mounts.append({"source": str(source), "target": vm["mountPath"], "read_only": read_only})
        limits = (c.spec.get("resources") or {}).get("limits") or {}
        requests = (c.spec.get("resources") or {}).get("requests") or {}
        pod_sc = pod.spec.get("securityContext") or {}
        sc = c.spec.get("securityContext") or {}
        seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
        return {
            "netns": pod.netns,
            "hostname": pod.hostname,
            "hosts_file": str(pod.dir / "hosts"),
            "resolv_file": str(self._resolv),
            "env": env,
            "entrypoint": command or None,  # command replaces the ENTRYPOINT and drops the CMD
            "args": args,  # args replace the CMD
            "workdir": c.spec.get("workingDir"),
            "mounts": mounts,
            "add_caps": list((sc.get("capabilities") or {}).get("add") or []),
            "seccomp": seccomp,
            "memory_limit": bytes_of(limits["memory"]) if "memory" in limits else None,
            "cpu_limit": cores_of(limits["cpu"]) if "cpu" in limits else None,
            "cpu_request": cores_of(cpu) if (cpu := requests.get("cpu", limits.get("cpu"))) is not None else None,
            **self._security(pod, c.spec),
        }

    # ---- the control loop ------------------------------------------------------------------------------
    def _agent_pod(self, pod: Pod) -> dict:
        """The pod as the node agent sees it; a running container with an exec probe also carries the command
        prefix (and its environment) that runs a command inside it, as the kubelet runs exec probes."""
        view = pod.agent_view()
        for c, seen in zip(pod.containers, view["containers"], strict=True):
            exec_probe = any(
                "exec" in (c.spec.get(k) or {}) for k in ("readinessProbe", "livenessProbe", "startupProbe")
            )
            if exec_probe and seen["running"] and (prefix := self.kubelet.exec_prefix(pod, c)):
                seen["exec_prefix"], seen["exec_env"] = prefix
        return view

    def _write_agent_state(self) -> None:
        services = []
        for name, doc in self.services.items():
            spec = doc["spec"]
            services.append(
                {
                    "name": name,
                    "ip": self.service_ips.get(name),
                    "selector": spec.get("selector") or {},
                    "publishNotReadyAddresses": bool(spec.get("publishNotReadyAddresses")),
                    "ports": [{"port": p["port"], "targetPort": p.get("targetPort", p["port"])} for p in spec["ports"]],
                }
            )
        services += [svc for job in self.jobs.values() if (svc := job.headless_service())]
        state = {
            "namespace": self.namespace,
            "domain": CLUSTER_DOMAIN,
            "services": services,
            "pods": [self._agent_pod(p) for p in self.pods.values() if p.netns],
            "policies": self.network_policies,
            "clients": [{"ip": c["ip"], "labels": c["labels"]} for c in self.clients.values()],
        }
        text = json.dumps(state, sort_keys=True)
        if text != self._state_text:
            tmp = self._agent_state.with_suffix(".tmp")
            tmp.write_text(text)
            os.replace(tmp, self._agent_state)
            self._state_text = text

    def _read_agent_status(self) -> None:
        try:
            self.probe_status = json.loads(self._agent_status.read_text()).get("pods", {})
        except (OSError, ValueError):
            pass

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self.lock:
                self._read_agent_status()
                for pod in list(self.pods.values()):
                    try:
                        self.kubelet.sync(pod, self.probe_status.get(pod.name, {}))
                    except HarnessError as e:
                        pod.env_errors.append(str(e))
                for job in self.jobs.values():
                    job.sync()
                for dep in self.deployments.values():
                    dep.sync()
                # Before the next round starts the new pods' containers: their peers' rules know them.
                self._enforce_policies()
                self._write_agent_state()
            time.sleep(0.1)

    # ---- what tests use ----------------------------------------------------------------------------------
    def is_ready(self, pod: Pod) -> bool:
        with self.lock:
            return pod_ready(pod.agent_view(), self.probe_status)

    def select(self, **labels) -> list[Pod]:
        with self.lock:
            return [
                p
                for p in self.pods.values()
                if not p.gone and all(p.labels.get(k.replace("__", "/")) == v for k, v in labels.items())
            ]

    def component(self, component: str, **extra) -> list[Pod]:
        """Pods of an app.kubernetes.io/component, live (not terminating) first."""
        with self.lock:
            pods = [
                p
                for p in self.pods.values()
                if p.labels.get("app.kubernetes.io/component") == component
                and all(p.labels.get(k) == v for k, v in extra.items())
            ]
        return sorted(pods, key=lambda p: (p.terminating, p.created_at))

    def ready_endpoints(self, service: str) -> list[Pod]:
        selector = self.services[service]["spec"]["selector"]
        with self.lock:
            return [
                p
                for p in self.pods.values()
                if all(p.labels.get(k) == v for k, v in selector.items()) and self.is_ready(p)
            ]

    def wait(self, predicate: Callable[[], object], *, timeout: float, what: str, poll: float = 0.25):
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{what}: not within {timeout:g}s\n{self.describe()}")
            time.sleep(poll)

    def delete_pod(self, pod: Pod, grace: float | None = None) -> threading.Thread:
        """`kubectl delete pod`: terminating now (out of its Services), preStop, SIGTERM, grace, SIGKILL."""
        with self.lock:
            thread = self.kubelet.terminate(pod, grace=grace, on_gone=self.pod_gone)
            self._deleted_from_outside(pod)
            return thread

    def _deleted_from_outside(self, pod: Pod) -> None:
        if pod.owner[0] == "Job" and pod.owner[1] in self.jobs:
            self.jobs[pod.owner[1]].pod_deleted(pod)

    def evict(self, pod: Pod) -> bool:
        """The eviction API (a node drain): refused (False) when a PodDisruptionBudget would be broken."""
        with self.lock:
            for pdb in self.pdbs:
                selector = pdb["spec"]["selector"]["matchLabels"]
                if not all(pod.labels.get(k) == v for k, v in selector.items()):
                    continue
                covered = [
                    p
                    for p in self.pods.values()
                    if all(p.labels.get(k) == v for k, v in selector.items()) and not p.terminating
                ]
                healthy = [p for p in covered if self.is_ready(p)]
                expected = sum(
                    c.replicas
                    for c in self.deployments.values()
                    if all(c.doc["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in selector.items())
                )
                spec = pdb["spec"]
                if "maxUnavailable" in spec:
                    allowed = spec["maxUnavailable"] - (expected - len(healthy))
                else:
                    allowed = len(healthy) - spec["minAvailable"]
                if allowed <= 0 or (pod not in healthy and allowed < 1):
                    return False
            self.kubelet.terminate(pod, on_gone=self.pod_gone)
            self._deleted_from_outside(pod)
            return True

    def log(self, pod: Pod, container: str | None = None) -> str:
        c = next(c for c in pod.all_containers() if container in (None, c.name))
        return c.log.read_text(errors="replace") if c.log and c.log.exists() else ""

    def describe(self) -> str:
        """Every pod with its phase, containers and the tail of each log (for failure messages)."""
        lines = []
        with self.lock:
            for job in self.jobs.values():
                lines.append(f"job {job.name}: {job.phase}, retries {job.retry_count}, events {job.events[-5:]}")
            if self.refused:
                lines.append(f"refused: {self.refused}")
            for pod in self.pods.values():
                ready = pod_ready(pod.agent_view(), self.probe_status)
                lines.append(
                    f"pod {pod.name} {pod.ip} {pod.phase}{' terminating' if pod.terminating else ''} "
                    f"ready={ready} {pod.reason} {pod.events[-3:]}"
                )
                for c in pod.all_containers():
                    tail = self.log(pod, c.name).splitlines()[-8:]
                    lines.append(f"  {c.name}: {c.state} exit={c.exit_code} restarts={c.restarts} {c.reason}")
                    lines += [f"    | {t[:300]}" for t in tail]
        return "\n".join(lines)

    # ---- a client inside the cluster (as `kubectl run` would give) ---------------------------------------
    def _client_pod(self, member: bool = False) -> Pod:
        n = next(self._clients)
        client = self.clients["member" if member else "outsider"]
        spec = {
            "securityContext": {"runAsNonRoot": True, "runAsUser": self.image.uid or 10001},
            "enableServiceLinks": False,
            "containers": [{"name": f"client-{n}", "command": ["true"]}],
        }
        pod = Pod(
            name=f"client-{n}",
            namespace=self.namespace,
            labels=dict(client["labels"]),
            annotations={},
            spec=spec,
            owner=("Pod", "client"),
            ip=client["ip"],
            dir=self.workdir / "clients" / f"client-{n}",
            netns=client["netns"],
        )
        pod.dir.mkdir(parents=True)
        (pod.dir / "hosts").write_text(self._hosts_for(pod))
        return pod

    def client_command(
        self, argv: list[str], env: dict | None = None, mounts: list[dict] | None = None, member: bool = False
    ) -> list[str]:
        pod = self._client_pod(member)
        c = Container(pod.spec["containers"][0])
        if isinstance(self.kubelet, PodmanRuntime):  # `kubectl run --rm -i --image TAG`
            spec = self.run_spec(pod, c)
            spec.update(entrypoint=list(argv), args=[])
            spec["env"].update(env or {})
            spec["mounts"] += mounts or []
            (pod.dir / "spec.json").write_text(json.dumps(spec))
            run = self.kubelet.run_argv(spec, f"{self.network.prefix}-{pod.name}", pod.dir / "env")
            return [*run[:2], "--interactive", *run[2:]]  # stdin: what run(input=...) writes
        spec = self.container_spec(pod, c)
        spec["argv"] = list(argv)
        spec["env"].update(env or {})
        spec["mounts"] += mounts or []
        path = pod.dir / "spec.json"
        path.write_text(json.dumps(spec))
        return ["ip", "netns", "exec", pod.netns, "unshare", "-m", "-u", "-p", "-f", "--mount-proc", "--kill-child",
                "--propagation", "private", sys.executable, str(Path(__file__).parent / "container_entry.py"),
                str(path)]  # fmt: skip

    def run(
        self, argv: list[str], *, env: dict | None = None, mounts=None, timeout: float = 120, input=None, member=False
    ):
        """Run ``argv`` in a client pod of the namespace (``member``: labelled as the instance's); the
        CompletedProcess (text)."""
        return subprocess.run(
            self.client_command(argv, env, mounts, member),
            capture_output=True,
            text=True,
            timeout=timeout,
            input=input,
            env=self.kubelet.root_env,
            cwd=str(self.workdir),
        )

    def spawn(
        self, argv: list[str], *, env: dict | None = None, mounts=None, log: Path, member: bool = False
    ) -> subprocess.Popen:
        out = open(log, "ab")
        return subprocess.Popen(
            self.client_command(argv, env, mounts, member),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=self.kubelet.root_env,
            cwd=str(self.workdir),
        )


def copy_into_claim(cluster: Cluster, claim: str, source: Path, target: str) -> Path:
    """Put files on a claim before pods read them (what `kubectl cp` or a loader job would do)."""
    dest = cluster.claim_dir(claim) / target
    if source.is_dir():
        shutil.copytree(source, dest, dirs_exist_ok=True)
    else:
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, dest)
    return dest
