"""The pod harness behaves as the cluster it stands for, on small hand-written manifests (seconds each):
Volcano's PodEvicted event, cluster DNS (search list, ndots, names published with readiness) and
NetworkPolicies on direct pod-to-pod connections."""

from __future__ import annotations

import json
import socket
import struct

import pytest
from pod_harness.network import missing_requirements

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
SKIP = missing_requirements()
if SKIP:
    pytest.skip(SKIP, allow_module_level=True)

from pod_harness.cluster import Cluster  # noqa: E402

NS = "default"
RESTRICTED_CONTAINER = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "readOnlyRootFilesystem": True,
}
RESTRICTED_POD = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}


def pod_spec(command: list[str], **extra) -> dict:
    container = {"name": "main", "command": command, "securityContext": RESTRICTED_CONTAINER, **extra}
    return {
        "securityContext": RESTRICTED_POD,
        "terminationGracePeriodSeconds": 1,
        "restartPolicy": "Never",
        "containers": [container],
    }


def volcano_job(name: str, tasks: dict[str, dict], policies: list[dict], *, svc_args=(), max_retry: int = 3) -> dict:
    """A Volcano Job with the svc (``svc_args``) and env plugins; ``tasks``: name -> pod spec, one replica each."""
    return {
        "apiVersion": "batch.volcano.sh/v1alpha1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "minAvailable": len(tasks),
            "maxRetry": max_retry,
            "plugins": {"svc": list(svc_args), "env": []},
            "policies": policies,
            "tasks": [
                {"name": task, "replicas": 1, "template": {"metadata": {"labels": {"app": name}}, "spec": spec}}
                for task, spec in tasks.items()
            ],
        },
    }


SLEEP = ["python", "-c", "import time; time.sleep(120)"]


@pytest.mark.parametrize("how", ["delete", "evict"])
def test_a_deleted_or_evicted_job_pod_raises_pod_evicted_and_the_job_restarts(tmp_path, how):
    """Volcano's job controller turns a pod's deletion (kubectl delete, a drain's eviction) into the
    PodEvicted event; the training job's policy for it is RestartJob."""
    doc = volcano_job(
        "sleeper",
        {"worker": pod_spec(SLEEP)},
        [{"event": "PodEvicted", "action": "RestartJob"}, {"event": "PodFailed", "action": "AbortJob"}],
    )
    with Cluster([doc], tmp_path / "cluster") as harness:
        job = harness.jobs["sleeper"]
        first = harness.wait(lambda: job.pods.get(("worker", 0)), timeout=30, what="the worker pod")
        harness.wait(lambda: harness.is_ready(first), timeout=30, what="the worker running")
        if how == "delete":
            harness.delete_pod(first)
        else:
            assert harness.evict(first)
        harness.wait(lambda: job.retry_count == 1, timeout=30, what="the job restarted")
        assert any("PodEvicted" in e and "RestartJob" in e for e in job.events), job.events
        second = harness.wait(
            lambda: (p := job.pods.get(("worker", 0))) is not None and p is not first and harness.is_ready(p) and p,
            timeout=30,
            what="the worker's new pod running",
        )
        assert first.gone and job.phase == "Running" and second.name == first.name, harness.describe()
        # The container ended by SIGTERM does not count as PodFailed (AbortJob): the deletion came first.
        assert not any("AbortJob" in e for e in job.events), job.events


def test_a_deleted_job_pod_with_no_policy_for_it_is_made_again(tmp_path):
    """No policy matches PodEvicted: Volcano's syncJob makes the missing pod again, the job is not restarted."""
    doc = volcano_job("sleeper", {"worker": pod_spec(SLEEP)}, [{"event": "PodFailed", "action": "AbortJob"}])
    with Cluster([doc], tmp_path / "cluster") as harness:
        job = harness.jobs["sleeper"]
        first = harness.wait(lambda: job.pods.get(("worker", 0)), timeout=30, what="the worker pod")
        harness.wait(lambda: harness.is_ready(first), timeout=30, what="the worker running")
        harness.delete_pod(first).join(30)
        harness.wait(
            lambda: (p := job.pods.get(("worker", 0))) is not None and p is not first and harness.is_ready(p),
            timeout=30,
            what="the worker's pod made again",
        )
        assert job.retry_count == 0 and job.phase == "Running", job.events
        assert any("PodEvicted" in e for e in job.events), job.events


def deployment(name: str, spec: dict) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"replicas": 1, "template": {"metadata": {"labels": {"app": name}}, "spec": spec}},
    }


def service(name: str, port: int) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"selector": {"app": name}, "ports": [{"port": port, "targetPort": port}]},
    }


# Listens on 8080 once /var/run/gate/open exists (the test opens it): ready (tcpSocket probe) from then on.
GATED_SERVER = [
    "python",
    "-c",
    "import os, socket, time\n"
    "while not os.path.exists('/var/run/gate/open'): time.sleep(0.1)\n"
    "s = socket.create_server(('', 8080))\n"
    "while True: s.accept()[0].close()\n",
]
RESOLVE = """
import json, socket, sys
out = {}
for name in json.loads(sys.argv[1]):
    try:
        out[name] = sorted({a[4][0] for a in socket.getaddrinfo(name, 80, socket.AF_INET, socket.SOCK_STREAM)})
    except socket.gaierror as e:
        out[name] = e.errno
print(json.dumps(out))
"""


def resolve(harness, names: list[str]) -> dict:
    out = harness.run(["python", "-c", RESOLVE, json.dumps(names)], timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def gated_server_spec() -> dict:
    spec = pod_spec(
        GATED_SERVER,
        ports=[{"name": "paddle", "containerPort": 8080}],
        readinessProbe={"tcpSocket": {"port": 8080}, "periodSeconds": 1},
        volumeMounts=[{"name": "gate", "mountPath": "/var/run/gate"}],
    )
    spec["volumes"] = [{"name": "gate", "emptyDir": {}}]
    return spec


def test_pods_resolve_names_through_the_cluster_dns_and_headless_names_follow_readiness(tmp_path):
    """resolv.conf as the kubelet writes it (the namespace's search list, ndots:5, the cluster DNS); Service
    names in every short form; a job pod's headless name only once the pod is ready, as the endpoints
    controller publishes it; anything else NXDOMAIN."""
    docs = [
        deployment("web", pod_spec(SLEEP)),
        service("web", 80),
        volcano_job("trainjob", {"server": gated_server_spec()}, [{"event": "PodEvicted", "action": "RestartJob"}]),
    ]
    with Cluster(docs, tmp_path / "cluster") as harness:
        conf = harness.run(["cat", "/etc/resolv.conf"]).stdout
        assert f"search {NS}.svc.cluster.local svc.cluster.local cluster.local" in conf, conf
        assert "options ndots:5" in conf and "nameserver 127.0.0.1" not in conf, conf
        web_ip = harness.service_ips["web"]
        forms = ["web", f"web.{NS}", f"web.{NS}.svc", f"web.{NS}.svc.cluster.local"]
        assert resolve(harness, forms) == {name: [web_ip] for name in forms}
        getent = harness.run(["getent", "hosts", "web"])
        assert getent.returncode == 0 and getent.stdout.split()[0] == web_ip, getent

        job = harness.jobs["trainjob"]
        pod = harness.wait(lambda: job.pods.get(("server", 0)), timeout=30, what="the server pod")
        harness.wait(lambda: pod.phase == "Running", timeout=30, what="the server running")
        headless = ["trainjob-server-0.trainjob", f"trainjob-server-0.trainjob.{NS}.svc.cluster.local"]
        before = resolve(harness, [*headless, f"trainjob.{NS}.svc.cluster.local", "no-such-name", "pypi.org"])
        assert not harness.is_ready(pod)
        assert all(not isinstance(v, list) for v in before.values()), before  # running, not ready: no name
        (pod.volumes["gate"] / "open").write_text("")
        harness.wait(lambda: harness.is_ready(pod), timeout=30, what="the server ready")
        after = resolve(harness, [*headless, f"trainjob-server-0.trainjob.{NS}", "trainjob", "no-such-name"])
        # NXDOMAIN (EAI_NONAME), answered at once: a resolver timing out would say EAI_AGAIN.
        assert after.pop("no-such-name") == before["no-such-name"] == before["pypi.org"] == socket.EAI_NONAME
        assert after == {name: [pod.ip] for name in after}, after


# The trainer dials pserver 0's headless name on the Paddle port every half second and logs what happened.
DIAL = [
    "python",
    "-c",
    "import socket, time\n"
    "while True:\n"
    "    try:\n"
    "        socket.create_connection(('trainjob-pserver-0.trainjob', 8080), timeout=2).close()\n"
    "        print('connected', flush=True)\n"
    "    except OSError as e:\n"
    "        print(type(e).__name__, e, flush=True)\n"
    "    time.sleep(0.5)\n",
]
LISTEN = ["python", "-c", "import socket\ns = socket.create_server(('', 8080))\nwhile True: s.accept()[0].close()\n"]


def only_from_the_job(port) -> dict:
    """A NetworkPolicy: the job's pods accept the job's pods on ``port`` only."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "job-only", "namespace": NS},
        "spec": {
            "podSelector": {"matchLabels": {"app": "trainjob"}},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "trainjob"}}}], "ports": [{"port": port}]}],
        },
    }


# From a client pod (another app's): connect to a pod IP and port, print what happened.
CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()
    print("connected")
except OSError as e:
    print(type(e).__name__)
"""
NO_POLICY = ["--disable-network-policy"]


@pytest.mark.parametrize(
    "svc_args, port, trainer, outsider",
    [
        ([], None, "connected", "TimeoutError"),  # the svc plugin's own NetworkPolicy: the job's pods only
        (NO_POLICY, None, "connected", "connected"),  # no policy selects the pods: anyone
        (NO_POLICY, "paddle", "connected", "TimeoutError"),
        (NO_POLICY, 9999, "TimeoutError", "TimeoutError"),  # the Paddle port left out: the trainer is cut too
    ],
)
def test_network_policies_cut_direct_pod_to_pod_connections(tmp_path, svc_args, port, trainer, outsider):
    """A trainer dials pserver 0 over its headless name, pod IP to pod IP (no Service, no node agent), and a
    client pod of another app dials the pserver's IP: the pserver's policies decide, as the CNI would, and
    what they leave out is dropped (the SYN gets no answer)."""
    pserver = pod_spec(LISTEN, ports=[{"name": "paddle", "containerPort": 8080}])
    pserver["containers"][0]["readinessProbe"] = {"tcpSocket": {"port": 8080}, "periodSeconds": 1}
    docs = [volcano_job("trainjob", {"pserver": pserver, "trainer": pod_spec(DIAL)}, [], svc_args=svc_args)]
    if port is not None:
        docs.append(only_from_the_job(port))
    with Cluster(docs, tmp_path / "cluster") as harness:
        pods = harness.jobs["trainjob"].pods
        harness.wait(lambda: len(pods) == 2 and all(harness.is_ready(p) for p in pods.values()), timeout=30, what="up")
        dialer = pods[("trainer", 0)]
        harness.wait(
            lambda: any(line.startswith(("connected", "TimeoutError")) for line in harness.log(dialer).splitlines()),
            timeout=30,
            what="the trainer's dial reached the pserver's IP",
        )
        results = {line.split()[0] for line in harness.log(dialer).splitlines()} - {"gaierror"}
        assert results == {trainer}, harness.log(dialer)[-2000:]
        other = harness.run(["python", "-c", CONNECT, pods[("pserver", 0)].ip, "8080"])
        assert other.stdout.split() == [outsider], other
        # The node (probes, the Service proxy) is never cut off: the pserver is ready either way.
        assert harness.is_ready(pods[("pserver", 0)])


def dns_query(name: str, qtype: int) -> bytes:
    labels = b"".join(bytes([len(part)]) + part.encode() for part in name.split("."))
    return struct.pack("!HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0) + labels + b"\0" + struct.pack("!HH", qtype, 1)


def test_the_cluster_dns_answers_as_coredns_does():
    """A records of known names (any case), an empty answer (not NXDOMAIN) for AAAA of a known name, which
    glibc's getaddrinfo asks beside A, and NXDOMAIN for the rest."""
    from pod_harness.node_agent import dns_answer

    records = {"web.default.svc.cluster.local": ["10.96.0.1"]}
    a = dns_answer(dns_query("Web.default.svc.cluster.local", 1), records)
    ident, flags, _, answers = struct.unpack("!HHHH", a[:8])
    assert (ident, flags & 0x800F, answers) == (0x1234, 0x8000, 1) and a.endswith(socket.inet_aton("10.96.0.1"))
    aaaa = dns_answer(dns_query("web.default.svc.cluster.local", 28), records)
    assert struct.unpack("!HH", aaaa[2:4] + aaaa[6:8]) == (0x8580, 0)  # NOERROR, authoritative, no answer
    missing = dns_answer(dns_query("web.default", 1), records)
    assert struct.unpack("!H", missing[2:4])[0] & 0xF == 3  # NXDOMAIN


# Exit 0 only inside the container: its emptyDir holds the file, written by the same uid.
OWN_FILE_CHECK = "import os, sys; sys.exit(open('/var/run/scratch/ready').read() != str(os.getuid()))"


def test_exec_probes_run_inside_the_container_as_its_user(tmp_path):
    """An exec readiness probe sees the container's own files (its emptyDir, written by the container itself)
    and runs as its uid; an exec liveness probe that fails restarts the container."""
    scratch = [{"name": "scratch", "mountPath": "/var/run/scratch"}]
    waits = [
        "python",
        "-c",
        "import os, pathlib, time\n"
        "time.sleep(2)\n"
        "pathlib.Path('/var/run/scratch/ready').write_text(str(os.getuid()))\n"
        "time.sleep(300)\n",
    ]
    probe = {"periodSeconds": 1, "failureThreshold": 1}
    ready_spec = pod_spec(
        waits,
        volumeMounts=scratch,
        readinessProbe={
            "exec": {"command": ["python", "-c", OWN_FILE_CHECK]},
            **probe,
        },
    )  # fmt: skip
    dying_spec = pod_spec(
        SLEEP,
        livenessProbe={"exec": {"command": ["python", "-c", "import sys; sys.exit(3)"]}, "initialDelaySeconds": 1,
                       **probe},
    )  # fmt: skip
    for spec in (ready_spec, dying_spec):
        spec["restartPolicy"] = "Always"
        spec["securityContext"] = {**spec["securityContext"], "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001}
    ready_spec["volumes"] = [{"name": "scratch", "emptyDir": {}}]
    with Cluster([deployment("gated", ready_spec), deployment("dying", dying_spec)], tmp_path / "cluster") as harness:
        (pod,) = harness.select(app="gated")
        harness.wait(lambda: pod.containers[0].state == "running", timeout=60, what="gated running")
        assert not harness.is_ready(pod)  # the file is not there yet: the probe fails inside the container
        harness.wait(lambda: harness.is_ready(pod), timeout=60, what="ready once its own file exists")
        (dying,) = harness.select(app="dying")
        harness.wait(lambda: dying.containers[0].restarts >= 1, timeout=60, what="restarted by its liveness probe")
        assert dying.containers[0].killed_for == "liveness"
