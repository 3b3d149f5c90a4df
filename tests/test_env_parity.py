"""The component catalogue (elastic_control/catalogue.py): one declaration, the same in a pod and as a local process.

Built for both addressing schemes, every component has the same variables
(names from ctr_foundation/env_vars.py only), the same plain values, the same
secrets, addresses that name the same component and paths that name the same
file; and what `-r` writes, the manifests and local/components.json, is
exactly the catalogue's, so a change to the catalogue reaches both.
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from helpers_kube import render_plan

from ctr_foundation import env_vars as ev
from ctr_foundation import names
from ctr_foundation.names import StateFolder
from elastic_control import catalogue as cat
from elastic_control.config import Resources
from elastic_control.kube.render import cluster_addressing, container_run
from elastic_control.local.components import local_addressing, process_spec
from elastic_control.plan import Plan

RULE = "auc_drop<=0.01"
CREDENTIALS = ["HDFS_UGI"]


def _plan() -> Plan:
    resources = Resources(trainers=2, pservers=2, cube_shards=3)
    extra = {"promotion_gate": RULE}
    return Plan(
        backend="local", backend_reason="", resources=resources, slot_conf_text="", data_config_path="", extra=extra
    )


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    plan = _plan()
    local = local_addressing(plan, StateFolder.of(tmp_path_factory.mktemp("state")), model_path="/tmp/m")
    cluster = cluster_addressing(plan, "/var/lib/elastic-ctr/models")
    return (
        local,
        cat.build_catalogue(plan, local, credentials=CREDENTIALS),
        cluster,
        cat.build_catalogue(plan, cluster, credentials=CREDENTIALS),
    )


def cluster_name(local_name: str) -> str:
    """The cluster entry a local process stands for: one pod template per training role."""
    role = local_name.rsplit("-", 1)[0]
    return role if role in cat.ROLES else local_name


def test_every_local_process_has_its_cluster_entry_and_back(both):
    _, local, _, cluster = both
    assert sorted({cluster_name(n) for n in local.names()}) == sorted(cluster.names())
    assert len(local.components) == 1 + 1 + 2 * 3 + 1 + 1 + 2 + 2
    assert local.shards == cluster.shards == 3


def _target_local(address: str, local: cat.Catalogue) -> str:
    port = int(urlsplit(address if "://" in address else f"//{address}").port)
    (name,) = [c.name for c in local.components if port in dict(c.ports).values()]
    return name


def _target_cluster(address: str, me: cat.Component, cluster: cat.Catalogue, job: str) -> str:
    u = urlsplit(address if "://" in address else f"//{address}")
    if u.hostname == names.LOOPBACK:  # beside it in its pod: the same shard's other container
        shard = me.name.rsplit("-", 1)[1]
        (name,) = [
            c.name for c in cluster.components if c.name.endswith(f"-{shard}") and u.port in dict(c.ports).values()
        ]
        return name
    host = u.hostname.split(".")[0]
    for c in cluster.components:
        service = f"{job}-cube-{c.name.rsplit('-', 1)[1]}" if c.kind == cat.CUBE_SERVER else f"{job}-{c.name}"
        if host == service:
            return c.name
    role, index = host[len(job) + 1 :].rsplit("-", 1)  # the svc plugin's JOB-ROLE-I.JOB
    assert role in cat.ROLES and u.port == cluster[role].port("paddle"), address
    return f"{role}-{index}"


def test_same_names_values_and_secrets_and_addresses_and_paths_name_the_same_thing(both):
    local_addr, local, cluster_addr, cluster = both
    to_local: dict[tuple, str] = {}
    to_cluster: dict[str, tuple] = {}
    checked = dict.fromkeys(ev.KINDS, 0)
    for lc in local.components:
        cc = cluster[cluster_name(lc.name)]
        lenv, cenv = {e.name: e for e in lc.env}, {e.name: e for e in cc.env}
        assert list(lenv) == list(cenv), lc.name
        assert lc.secrets == cc.secrets and set(lc.secrets) == {"ELASTIC_CTR_TOKEN", *CREDENTIALS} & set(lenv)
        assert lc.kind == cc.kind and lc.health == cc.health and lc.group == cc.group, lc.name
        assert [cluster_name(a) for a in lc.after] == list(cc.after), lc.name
        if lc.name != "pserver-1":  # only pserver 0 serves the barriers; the pod template stands for any index
            assert [n for n, _ in lc.ports] == [n for n, _ in cc.ports], lc.name
        for name in lenv:
            kind, le, ce = ev.REGISTRY[name].kind, lenv[name], cenv[name]
            checked[kind] += 1
            if kind == ev.SECRET:
                assert le.value is None and ce.value is None, name
            elif name == ev.PADDLE_TRAINER_ID.name:  # the replica's index: the pod's entry shell reads it
                assert le.value == lc.name.rsplit("-", 1)[1] and ce.shell and "VC_TASK_INDEX" in ce.value
            elif kind == ev.VALUE:
                assert le.value == ce.value, f"{lc.name} {name}: {le.value!r} locally, {ce.value!r} in a pod"
            elif kind == ev.ADDRESS:
                lv, cv = le.value.split(","), ce.value.split(",")
                assert len(lv) == len(cv), f"{lc.name} {name}"
                for one_local, one_cluster in zip(lv, cv, strict=True):
                    target = _target_local(one_local, local)
                    assert target == _target_cluster(one_cluster, cc, cluster, cluster_addr.job), (
                        f"{lc.name} {name}: {one_local} is {target} locally, {one_cluster} in a pod"
                    )
            elif kind == ev.LISTEN_PORT:
                assert int(le.value) in dict(lc.ports).values() and int(ce.value) in dict(cc.ports).values()
            elif kind == ev.OWN_HOST:
                assert le.value == names.LOOPBACK
                assert ce.pod_field == "status.podIP" or f"-{lc.kind}-${{VC_TASK_INDEX}}." in ce.value
            elif kind == ev.PATH:
                assert Path(le.value).is_absolute(), f"{lc.name} {name}: {le.value}"
                # A cube pod's folder is its own emptyDir: the same pod path names each shard's own folder.
                where = (ce.value, lc.name.rsplit("-", 1)[1]) if ce.value in cc.scratch else (ce.value,)
                assert to_local.setdefault(where, le.value) == le.value, f"{lc.name} {name}"
                assert to_cluster.setdefault(le.value, where) == where, f"{lc.name} {name}"
    assert all(checked[kind] for kind in ev.KINDS)
    assert checked[ev.OWN_HOST] == 4  # POD_IP of every pserver and trainer
    assert len({v for k, v in to_local.items() if len(k) == 2}) == 3  # three shards, three local folders
    assert local_addr.local and not cluster_addr.local


def test_local_only_tunings_are_the_declared_ones(both):
    """Arguments differ between the schemes only where the catalogue says so (and the bind address)."""
    _, local, _, cluster = both
    assert "--poll-interval" in local[cat.TRANSFER].args and "--poll-interval" not in cluster[cat.TRANSFER].args
    assert "--drain-delay" in cluster[cat.SERVING].args and "--allowed-hosts" in cluster[cat.MLFLOW].args
    assert "--check-window" in cluster[cat.TRAINER].args and "--check-window" not in local["trainer-0"].args
    # Pods keep a copy of their logs on the shared claim and the file server serves it; local logs are files.
    for role in cat.ROLES:
        assert "--keep-logs" in cluster[role].args and "--keep-logs" not in local[f"{role}-0"].args
    assert "--kept-logs" in cluster[cat.FILESERVER].args and "--kept-logs" not in local[cat.FILESERVER].args
    assert [c.script for c in local.components if c.kind == "cube-agent"] == ["cube-agent"] * 3


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    plan, manifests = render_plan(
        root / "state", backend="local", trainers=2, pservers=2, cube_shards=3, promotion_gate=RULE
    )
    local = json.loads((root / "state" / "local" / "components.json").read_text())
    return plan, manifests, {c["name"]: c for c in local["components"]}


def _containers(manifests: Path) -> dict[str, dict]:
    """Each container of the manifests by its catalogue name (cube-server-I, pserver, ...)."""
    out = {}
    for path in sorted(manifests.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc["kind"] == "Deployment":
                spec = doc["spec"]["template"]
                shard = spec["metadata"]["labels"].get("elastic-ctr/shard")
                for c in spec["spec"]["containers"]:
                    out[c["name"] if shard is None else f"{c['name']}-{shard}"] = c
            elif doc and doc["kind"] == "Job":
                for task in doc["spec"]["tasks"]:
                    (out[task["name"]],) = task["template"]["spec"]["containers"]
    return out


def test_what_r_writes_is_the_catalogue(rendered):
    plan, manifests, local = rendered
    job = plan.job_name
    credentials = [s for s in local[cat.TRANSFER]["secrets"] if s != ev.TOKEN.name]  # the example has HDFS_UGI
    cluster = cat.build_catalogue(
        plan, cluster_addressing(plan, "/var/lib/elastic-ctr/models"), credentials=credentials
    )
    refs = {"ELASTIC_CTR_TOKEN": (f"{job}-token", "token"), "HDFS_UGI": (f"{job}-credentials", "HDFS_UGI")}
    containers = _containers(manifests)
    assert sorted(containers) == sorted(cluster.names())
    for c in cluster.components:
        want, got = container_run(c, refs), containers[c.name]
        assert (got["command"], got["env"], got["ports"]) == (want["command"], want["env"], want["ports"]), c.name
    # Locally: the catalogue built on the ports the plan drew.
    ports = {
        name: dict(zip(_port_names(name), [p["port"], *p["extra_ports"]], strict=False)) for name, p in local.items()
    }
    layout = StateFolder.of(Path(manifests).parent)
    paths = local_addressing(plan, layout, model_path=local["cube-transfer"]["env"]["MODEL_PATH"]).paths
    addressing = cat.Loopback(ports, paths)
    for c in cat.build_catalogue(plan, addressing, credentials=credentials).components:
        spec = process_spec(c)
        assert (spec.argv, spec.env, spec.secrets, spec.after) == tuple(
            local[c.name][k] for k in ("argv", "env", "secrets", "after")
        ), c.name
    assert local["cube-transfer"]["env"][ev.PROMOTION_GATE.name] == RULE


def _port_names(name: str) -> list[str]:
    kind = cat.ClusterDns.kind_of(name)
    return [n for n, _ in cat.PORTS[kind]] + ([cat.COORDINATOR] if name == "pserver-0" else [])


def test_a_change_in_the_catalogue_reaches_the_process_and_the_pod(tmp_path, monkeypatch):
    """One place to change what a component runs: a new variable and a new port show up on both sides."""
    build = cat.build_catalogue

    def with_debug(plan, a, **kwargs):
        out = build(plan, a, **kwargs)
        serving = out[cat.SERVING]
        changed = cat.Component(**{**serving.__dict__, "env": (*serving.env, cat.Env(ev.DEBUG.name, "1"))})
        return cat.Catalogue(tuple(changed if c is serving else c for c in out.components), out.shards)

    monkeypatch.setattr(cat, "build_catalogue", with_debug)
    for module in ("elastic_control.local.components", "elastic_control.kube.render"):
        monkeypatch.setattr(f"{module}.build_catalogue", with_debug)
    monkeypatch.setitem(cat.PORTS, cat.SERVING, (("http", 18010), ("grpc", names.SERVING_GRPC_PORT)))
    _, manifests = render_plan(tmp_path / "state", backend="local", trainers=1, pservers=1, cube_shards=1)
    local = json.loads((tmp_path / "state" / "local" / "components.json").read_text())
    (serving,) = [c for c in local["components"] if c["name"] == cat.SERVING]
    assert serving["env"][ev.DEBUG.name] == "1"
    pod = _containers(manifests)[cat.SERVING]
    assert {"name": ev.DEBUG.name, "value": "1"} in pod["env"]
    assert pod["ports"][0]["containerPort"] == 18010 and "18010" in pod["command"]
    text = (manifests / "50-serving.yaml").read_text()
    assert "port: 18010" in text  # the Service too
