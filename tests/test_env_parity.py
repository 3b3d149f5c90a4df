"""Every component gets the same variables in a pod and as a local process: names, values, and what they point at.

One `-r --backend local` renders both the Kubernetes manifests and the local
plan. For each component (each pod's container, each replica of the Volcano
job with its entry shell's exports applied) and its local process:

- the variable names are the same (the token comes from a Secret in the pod
  and from the supervisor locally: both must get it, neither in clear);
- a plain value (``env_vars.VALUE``: shard numbers, counts, roles, the
  promotion gate) is the same string;
- an address (URL, host:port, lists of them) names the same component: the
  pod side is resolved through the Services, the Volcano ``svc`` host names
  and the pod's own loopback to a container, the local side through the port
  each local process listens on;
- a listening port and the pod's own host name the component itself;
- a path names the same file or folder: pod paths are resolved through the
  volume mounts (a claim, a ConfigMap, the pod's own emptyDir), and the pod
  locations and the local paths map one to one across all components (two
  shards never share a local folder where their pods have their own
  emptyDirs; every component reading slot.conf reads the same local file).
"""

from __future__ import annotations

import json
import re
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

import pytest
import yaml
from helpers_kube import render_plan

from ctr_foundation import env_vars as ev

RULE = "auc_drop<=0.01"
SECRET_REF = "<from a Secret>"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost")


# ---- the pod side ---------------------------------------------------------------------------------------------


class Pod:
    def __init__(self, name: str, labels: dict, spec: dict, task_index: int | None = None):
        self.name, self.labels, self.spec, self.task_index = name, labels, spec, task_index

    def containers(self):
        return self.spec.get("containers", [])


def _shell_exports(container: dict, task_index: int | None) -> dict[str, str]:
    """The variables the entry shell exports (`/bin/sh -c 'export A="..." B="..."; exec ...'`), VC_TASK_INDEX set."""
    command = container.get("command") or []
    if command[:2] != ["/bin/sh", "-c"]:
        return {}
    script = command[2]
    out = {}
    for name, value in re.findall(r'([A-Z_][A-Z0-9_]*)="([^"]*)"', script.split(";", 1)[0]):
        value = re.sub(r"\$\{VC_TASK_INDEX(:\?[^}]*)?\}", str(task_index), value)
        assert "$" not in value, f"unexpanded shell variable in {name}={value!r}"
        out[name] = value
    return out


def pod_environment(pod: Pod, container: dict) -> dict[str, str]:
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
        elif "secretKeyRef" in e.get("valueFrom", {}):
            env[e["name"]] = SECRET_REF
        elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[e["name"]] = f"podip.{pod.name}"
        else:
            raise AssertionError(f"{pod.name}/{container['name']}: {e['name']} has an unknown source {e}")
    env.update(_shell_exports(container, pod.task_index))
    return env


class Cluster:
    """The rendered objects, enough to resolve an address or a path the way a cluster would."""

    def __init__(self, manifests: Path):
        self.pods: list[Pod] = []
        self.services: dict[str, dict] = {}
        for path in sorted(manifests.glob("*.yaml")):
            for doc in yaml.safe_load_all(path.read_text()):
                if not doc:
                    continue
                if doc["kind"] == "Deployment":
                    template = doc["spec"]["template"]
                    # Replicas (serving has 2) are copies of one template: one local process stands for them.
                    self.pods.append(Pod(doc["metadata"]["name"], template["metadata"]["labels"], template["spec"]))
                elif doc["kind"] == "Job":
                    job = doc["metadata"]["name"]
                    for task in doc["spec"]["tasks"]:
                        for i in range(task["replicas"]):
                            labels = dict(task["template"]["metadata"].get("labels", {}))
                            self.pods.append(Pod(f"{job}-{task['name']}-{i}", labels, task["template"]["spec"], i))
                    self.job = job
                elif doc["kind"] == "Service":
                    self.services[doc["metadata"]["name"]] = doc

    def pod(self, name: str) -> Pod:
        return next(p for p in self.pods if p.name == name)

    def listener(self, pod: Pod, port: int) -> tuple[str, str]:
        """(pod, container) listening on ``port`` in ``pod``: its containerPort, else its own port variable."""
        for c in pod.containers():
            if any(p["containerPort"] == port for p in c.get("ports", [])):
                return pod.name, c["name"]
        for c in pod.containers():
            env = pod_environment(pod, c)
            if any(ev.REGISTRY[k].kind == ev.LISTEN_PORT and env[k] == str(port) for k in env if k in ev.REGISTRY):
                return pod.name, c["name"]
        raise AssertionError(f"nothing in pod {pod.name} listens on {port}")

    def resolve(self, host: str, port: int, *, from_pod: Pod) -> tuple[str, str]:
        if host in LOOPBACK_HOSTS or host == f"podip.{from_pod.name}":
            return self.listener(from_pod, port)
        if host.startswith("podip."):
            return self.listener(self.pod(host[len("podip.") :]), port)
        first = host.split(".")[0]
        if first in self.services:
            svc = self.services[first]
            (entry,) = [p for p in svc["spec"]["ports"] if p["port"] == port]
            selector = svc["spec"]["selector"]
            (pod,) = [p for p in self.pods if all(p.labels.get(k) == v for k, v in selector.items())]
            target = entry.get("targetPort", port)
            if isinstance(target, str):
                target = next(
                    p["containerPort"] for c in pod.containers() for p in c.get("ports", []) if p.get("name") == target
                )
            return self.listener(pod, target)
        # Volcano's svc plugin: JOB-TASK-I.JOB names pod I of a task.
        labels = host.split(".")
        assert len(labels) == 2 and labels[1] == self.job, f"cannot resolve host {host}"
        return self.listener(self.pod(labels[0]), port)

    def location(self, pod: Pod, container: dict, path: str) -> tuple:
        """What a path in a container is: (volume identity, path inside the volume)."""
        mounts = sorted(container.get("volumeMounts", []), key=lambda m: -len(m["mountPath"]))
        volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
        for m in mounts:
            root = PurePosixPath(m["mountPath"])
            p = PurePosixPath(path)
            if p == root or root in p.parents:
                inside = str(PurePosixPath(m.get("subPath", "")) / p.relative_to(root))
                vol = volumes[m["name"]]
                if "emptyDir" in vol:
                    return ("emptyDir", pod.name, m["name"]), inside
                if "persistentVolumeClaim" in vol:
                    return ("claim", vol["persistentVolumeClaim"]["claimName"]), inside
                if "configMap" in vol:
                    return ("configMap", vol["configMap"]["name"]), inside
                if "secret" in vol:
                    return ("secret", vol["secret"]["secretName"]), inside
                raise AssertionError(f"{pod.name}: unknown volume {vol}")
        return ("image", pod.name), path


def local_name(pod: Pod, container: dict) -> str:
    """The local component a pod's container corresponds to."""
    name = container["name"]
    if name in ("cube-server", "cube-agent"):
        return f"{name}-{pod.labels['elastic-ctr/shard']}"
    if name in ("pserver", "trainer"):
        return f"{name}-{pod.task_index}"
    return name


# ---- the local side -------------------------------------------------------------------------------------------


def _split(value: str) -> list[str]:
    return [v for v in value.split(",") if v]


def _host_port(address: str) -> tuple[str, str, int]:
    """(scheme, host, port) of a URL or host:port."""
    if "://" in address:
        u = urlsplit(address)
        return u.scheme, u.hostname, u.port
    host, port = address.rsplit(":", 1)
    return "", host, int(port)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    plan, manifests = render_plan(
        root / "state", backend="local", trainers=2, pservers=2, cube_shards=3, promotion_gate=RULE
    )
    local = json.loads((root / "state" / "local" / "components.json").read_text())
    return Cluster(manifests), {c["name"]: c for c in local["components"]}


def test_every_container_has_a_local_process_and_back(rendered):
    cluster, local = rendered
    pods_side = sorted(local_name(p, c) for p in cluster.pods for c in p.containers())
    assert pods_side == sorted(local)
    assert len(local) == 1 + 1 + 2 * 3 + 1 + 1 + 2 + 2


def test_same_names_and_values_and_each_address_and_path_names_the_same_thing(rendered):
    cluster, local = rendered
    by_port = {p: name for name, c in local.items() for p in ([c["port"]] if c["port"] else []) + c["extra_ports"]}
    to_local: dict[tuple, str] = {}
    to_pod: dict[str, tuple] = {}
    checked = {kind: 0 for kind in ev.KINDS}

    def same_component(pod_address: str, local_address: str, *, pod: Pod, what: str) -> None:
        pscheme, phost, pport = _host_port(pod_address)
        lscheme, lhost, lport = _host_port(local_address)
        assert pscheme == lscheme, f"{what}: {pod_address} vs {local_address}"
        assert lhost in LOOPBACK_HOSTS, f"{what}: the local address {local_address} is not on loopback"
        target = local_name(
            cluster.pod(cluster.resolve(phost, pport, from_pod=pod)[0]), _container(cluster, pod, phost, pport)
        )
        assert by_port.get(lport) == target, (
            f"{what}: the pod's {pod_address} is {target}, locally {local_address} is {by_port.get(lport)}"
        )

    for pod in cluster.pods:
        for container in pod.containers():
            name = local_name(pod, container)
            pod_env, comp = pod_environment(pod, container), local[name]
            local_env = dict(comp["env"])
            unregistered = sorted(set(pod_env) - set(ev.REGISTRY))
            assert not unregistered, f"{name}: {unregistered} are not in ctr_foundation/env_vars.py"
            # Secrets: a Secret reference in the pod, the supervisor's injection locally; never a plain value.
            pod_secrets = {k for k, v in pod_env.items() if v == SECRET_REF}
            assert pod_secrets == {k for k in pod_env if ev.REGISTRY[k].kind == ev.SECRET}, name
            assert pod_secrets == set(comp["secrets"]), f"{name}: secrets {pod_secrets} vs {comp['secrets']}"
            assert not pod_secrets & set(local_env), f"{name}: a secret is written into the local plan"
            assert set(pod_env) - pod_secrets == set(local_env), (
                f"{name}: only in the pod {sorted(set(pod_env) - pod_secrets - set(local_env))}, "
                f"only locally {sorted(set(local_env) - set(pod_env))}"
            )
            for key in sorted(set(local_env)):
                kind, what = ev.REGISTRY[key].kind, f"{name} {key}"
                pv, lv = pod_env[key], local_env[key]
                checked[kind] += 1
                if kind == ev.VALUE:
                    assert pv == lv, f"{what}: {pv!r} in the pod, {lv!r} locally"
                elif kind == ev.ADDRESS:
                    assert len(_split(pv)) == len(_split(lv)), f"{what}: {pv} vs {lv}"
                    for p_one, l_one in zip(_split(pv), _split(lv), strict=True):
                        same_component(p_one, l_one, pod=pod, what=what)
                elif kind == ev.LISTEN_PORT:
                    assert cluster.listener(pod, int(pv)) == (pod.name, container["name"]), what
                    assert int(lv) in ([comp["port"]] + comp["extra_ports"]), what
                elif kind == ev.OWN_HOST:
                    port_var = next(k for k in pod_env if ev.REGISTRY.get(k) and ev.REGISTRY[k].kind == ev.LISTEN_PORT)
                    assert cluster.resolve(pv, int(pod_env[port_var]), from_pod=pod) == (pod.name, container["name"])
                    assert lv in LOOPBACK_HOSTS and by_port[int(local_env[port_var])] == name, what
                elif kind == ev.PATH:
                    where = cluster.location(pod, container, pv)
                    assert Path(lv).is_absolute(), f"{what}: {lv} is not absolute"
                    assert to_local.setdefault(where, lv) == lv, (
                        f"{what}: the pod's {where} is {to_local[where]} elsewhere but {lv} here"
                    )
                    assert to_pod.setdefault(lv, where) == where, (
                        f"{what}: the local {lv} is the pod's {to_pod[lv]} elsewhere but {where} here"
                    )
    # The test really compared something of every kind the components use.
    assert checked[ev.VALUE] and checked[ev.ADDRESS] and checked[ev.LISTEN_PORT] and checked[ev.PATH]
    assert checked[ev.OWN_HOST] == 4  # POD_IP of every pserver and trainer
    # Two cube shards: their own emptyDirs in the pods, their own folders locally.
    cube_roots = {v for k, v in to_local.items() if k[0][0] == "emptyDir"}
    assert len(cube_roots) == 3


def _container(cluster: Cluster, pod: Pod, host: str, port: int) -> dict:
    pod_name, container_name = cluster.resolve(host, port, from_pod=pod)
    return next(c for c in cluster.pod(pod_name).containers() if c["name"] == container_name)


def test_the_gate_rule_is_a_value_both_sides_carry(rendered):
    _, local = rendered
    assert local["cube-transfer"]["env"][ev.PROMOTION_GATE.name] == RULE
