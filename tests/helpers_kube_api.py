"""A local HTTP server answering the Kubernetes API paths elastic-control uses.

It keeps objects in memory and acts like the controllers where the code
depends on it: a Deployment or a Volcano Job gets pods, a Service gets a
cluster IP (and node ports), deleting a job removes its pods a moment later.
Answers have the API server's real shapes (lists, Status objects, chunked
log streams) so the real `kubernetes` client parses them. Scenarios:

- ``crd_installed=False``: no jobs.batch.volcano.sh CRD (404).
- ``unschedulable=True``: the training job's pods stay Pending with a
  FailedScheduling event ("Insufficient cpu").
- ``recreate_trainer=True``: while trainer 0's log is followed, its pod is
  deleted and recreated (RestartJob) before the stream ends; the new pod's
  stream ends with the job Completed.
- ``node_ports``: Service name -> nodePort to allocate (point it at a local
  test server to make a NodePort service reachable).
- ``on_volcano_job``: called as ``fn(api, namespace, job)`` after a Volcano
  Job and its pods were created (under the API's lock: start a thread to act
  like Volcano's controller, e.g. tests/helpers_kube_eval.py).
- ``deny``: {"METHOD path-substring": status} answers 401/403 Status objects
  (e.g. {"GET /pods": 403}) as an API server whose RBAC refuses the call.
- ``task_index_label=False``: Volcano before 1.9 (pods without volcano.sh/task-index).
- ``may_not_create``: resources (e.g. {"roles", "rolebindings"}) a SelfSubjectAccessReview says the
  user may not create, as for a user bound to the `edit` ClusterRole.
- ``prometheus_operator=True``: the cluster serves monitoring.coreos.com/v1 (ServiceMonitor,
  PrometheusRule: discovery document and objects); otherwise that group version is 404.
- ``quota_exceeded``: Deployments' ReplicaSets create no pods and record FailedCreate
  "exceeded quota" events; ``podgroup_pending``: the job's PodGroup stays Pending
  with an Unschedulable condition and no pod is created; ``claims_pending``: claims
  stay Pending with a ProvisioningFailed event; ``job_pods_forbidden``: admission refuses the
  job's pods and Volcano records FailedCreatePod on the Job.

A JSON merge patch (PATCH application/merge-patch+json) changes an existing object (trainer 0's progress
annotation on the Volcano Job). Server-side apply (PATCH application/apply-patch+yaml) creates or updates; an
apply that changes nothing keeps the resourceVersion (as the API server does),
and a Deployment whose pod template changed replaces its pods (a rollout).
``restarts`` counts pods replaced that way.

Use ``with FakeKubeAPI() as api: api.write_kubeconfig(path)``.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import re
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

import yaml

VOLCANO = "batch.volcano.sh/v1alpha1"
MONITORING = "monitoring.coreos.com/v1"
KINDS = {  # (group/version, plural) -> kind
    ("v1", "pods"): "Pod",
    ("v1", "services"): "Service",
    ("v1", "configmaps"): "ConfigMap",
    ("v1", "secrets"): "Secret",
    ("v1", "persistentvolumeclaims"): "PersistentVolumeClaim",
    ("v1", "events"): "Event",
    ("v1", "namespaces"): "Namespace",
    ("v1", "nodes"): "Node",
    ("apps/v1", "deployments"): "Deployment",
    ("apps/v1", "replicasets"): "ReplicaSet",
    ("policy/v1", "poddisruptionbudgets"): "PodDisruptionBudget",
    ("networking.k8s.io/v1", "networkpolicies"): "NetworkPolicy",
    ("v1", "serviceaccounts"): "ServiceAccount",
    ("rbac.authorization.k8s.io/v1", "roles"): "Role",
    ("rbac.authorization.k8s.io/v1", "rolebindings"): "RoleBinding",
    ("scheduling.volcano.sh/v1beta1", "podgroups"): "PodGroup",
    (VOLCANO, "jobs"): "Job",
    ("scheduling.volcano.sh/v1beta1", "queues"): "Queue",
    ("apiextensions.k8s.io/v1", "customresourcedefinitions"): "CustomResourceDefinition",
    (MONITORING, "servicemonitors"): "ServiceMonitor",
    (MONITORING, "prometheusrules"): "PrometheusRule",
}
# The Service proxy subresource: GET /api/v1/namespaces/NS/services/NAME:PORT/proxy/PATH
_SERVICE_PROXY = re.compile(
    r"^/api/v1/namespaces/(?P<ns>[^/]+)/services/(?P<svc>[^/:]+)(?::(?P<port>[^/]+))?/proxy(?P<path>/.*)?$"
)
_PATH = re.compile(
    r"^/(?:api/(?P<core>v1)|apis/(?P<gv>[^/]+/[^/]+))"
    r"(?:/namespaces/(?P<ns>[^/]+)(?=/))?/(?P<plural>[a-z]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>log|status))?/?$"
)


@contextlib.contextmanager
def fake_cluster(tmp_path: Path, monkeypatch, *, apply_timeout: str | None = None, **options):
    """A FakeKubeAPI (``options``: its scenario) with KUBECONFIG pointing at it, no in-cluster config, and
    the adaptor's cached client reset before and after; ``apply_timeout``: ELASTIC_CTR_APPLY_TIMEOUT."""
    from elastic_control.kube import adaptor

    with FakeKubeAPI(**options) as api:
        monkeypatch.setenv("KUBECONFIG", str(api.write_kubeconfig(tmp_path / "kubeconfig")))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        if apply_timeout is not None:
            monkeypatch.setenv("ELASTIC_CTR_APPLY_TIMEOUT", apply_timeout)
        adaptor.reset()
        try:
            yield api
        finally:
            adaptor.reset()


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class FakeKubeAPI:
    def __init__(
        self,
        *,
        crd_installed: bool = True,
        queue_state: str = "Open",
        namespaces=("default",),
        unschedulable: bool = False,
        recreate_trainer: bool = False,
        node_ports: dict | None = None,
        job_delete_delay: float = 0.3,
        log_line_delay: float = 0.02,
        on_volcano_job=None,
        deny: dict | None = None,
        task_index_label: bool = True,
        quota_exceeded: bool = False,
        podgroup_pending: bool = False,
        claims_pending: bool = False,
        trainer_log: list[str] | None = None,
        end_stream_early: bool = False,
        job_pods_forbidden: bool = False,
        prometheus_operator: bool = False,
        may_not_create: set[str] | frozenset[str] = frozenset(),
    ):
        self.prometheus_operator = prometheus_operator
        self.may_not_create = set(may_not_create)
        self.crd_installed, self.queue_state = crd_installed, queue_state
        self.unschedulable, self.recreate_trainer = unschedulable, recreate_trainer
        self.node_ports = dict(node_ports or {})
        # (namespace, service, port name) -> base URL of what answers behind it (tests start the real thing)
        self.service_backends: dict[tuple[str, str, str], str] = {}
        self.job_delete_delay, self.log_line_delay = job_delete_delay, log_line_delay
        self.on_volcano_job = on_volcano_job
        self.deny = dict(deny or {})
        self.task_index_label = task_index_label
        self.quota_exceeded, self.podgroup_pending, self.claims_pending = (
            quota_exceeded,
            podgroup_pending,
            claims_pending,
        )
        self.trainer_log, self.end_stream_early = trainer_log, end_stream_early
        self.job_pods_forbidden = job_pods_forbidden
        self.restarts = 0  # pods replaced because a Deployment's template changed
        self.streams_cut: set[str] = set()
        self.stopping = False
        self.lock = threading.RLock()
        self.store: dict[tuple, dict] = {}  # (gv, plural, namespace, name) -> object
        self.requests: list[tuple[str, str, dict]] = []
        self.logs: dict[str, list[str]] = {}  # pod uid -> lines
        self.previous_logs: dict[str, list[str]] = {}  # pod uid -> the previous container instance's lines
        self._rv = itertools.count(1000)
        self._node_port = itertools.count(30000)
        self.trainer_generations = 0
        self.recreated = False
        for ns in namespaces:
            self._put(
                "v1",
                "namespaces",
                None,
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}, "status": {"phase": "Active"}},
            )
        self._put(
            "v1",
            "nodes",
            None,
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": "node-1"},
                "status": {
                    "addresses": [
                        {"type": "InternalIP", "address": "127.0.0.1"},
                        {"type": "Hostname", "address": "node-1"},
                    ]
                },
            },
        )
        self._put(
            "scheduling.volcano.sh/v1beta1",
            "queues",
            None,
            {
                "apiVersion": "scheduling.volcano.sh/v1beta1",
                "kind": "Queue",
                "metadata": {"name": "default"},
                "spec": {"weight": 1, "reclaimable": True},
                "status": {"state": queue_state},
            },
        )
        if crd_installed:
            self._put(
                "apiextensions.k8s.io/v1",
                "customresourcedefinitions",
                None,
                {
                    "apiVersion": "apiextensions.k8s.io/v1",
                    "kind": "CustomResourceDefinition",
                    "metadata": {"name": "jobs.batch.volcano.sh"},
                    "spec": {
                        "group": "batch.volcano.sh",
                        "scope": "Namespaced",
                        "names": {"kind": "Job", "plural": "jobs", "singular": "job", "shortNames": ["vcjob", "vj"]},
                        "versions": [
                            {
                                "name": "v1alpha1",
                                "served": True,
                                "storage": True,
                                "schema": {"openAPIV3Schema": {"type": "object"}},
                            }
                        ],
                    },
                },
            )

    # ---- lifecycle -------------------------------------------------------------------------------------
    def __enter__(self):
        api = self

        class Handler(_Handler):
            fake = api

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopping = True
        self.server.shutdown()
        self.server.server_close()

    def write_kubeconfig(self, path: Path) -> Path:
        path = Path(path)
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "fake",
                    "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                    "contexts": [
                        {"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": "default"}}
                    ],
                    "users": [{"name": "fake", "user": {"token": "fake-token"}}],
                }
            )
        )
        return path

    # ---- store -----------------------------------------------------------------------------------------
    def _put(self, gv, plural, ns, obj):
        meta = obj.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", now())
        meta["resourceVersion"] = str(next(self._rv))
        if ns:
            meta["namespace"] = ns
        self.store[(gv, plural, ns, meta["name"])] = obj
        return obj

    def get(self, gv, plural, ns, name):
        return self.store.get((gv, plural, ns, name))

    def items(self, gv, plural, ns=None):
        return [
            o
            for (g, p, n, _), o in sorted(self.store.items(), key=lambda kv: kv[0][3])
            if g == gv and p == plural and (ns is None or n == ns)
        ]

    def pods(self, ns="default", **labels):
        return [
            p
            for p in self.items("v1", "pods", ns)
            if all(p["metadata"].get("labels", {}).get(k) == v for k, v in labels.items())
        ]

    def event(self, ns, pod_name, reason, message, type_="Warning", kind="Pod"):
        name = f"{pod_name}.{uuid.uuid4().hex[:12]}"
        self._put(
            "v1",
            "events",
            ns,
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"name": name},
                "involvedObject": {"kind": kind, "name": pod_name, "namespace": ns},
                "reason": reason,
                "message": message,
                "type": type_,
                "count": 1,
                "firstTimestamp": now(),
                "lastTimestamp": now(),
                "source": {"component": "volcano"},
            },
        )

    # ---- controllers -----------------------------------------------------------------------------------
    def _make_pod(self, ns, name, template, labels, *, pending=False, log=None):
        spec = copy.deepcopy(template["spec"])
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": {**template["metadata"].get("labels", {}), **labels}},
            "spec": spec,
        }
        if pending:
            pod["status"] = {
                "phase": "Pending",
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": "0/3 nodes are available: 3 Insufficient cpu.",
                        "lastTransitionTime": now(),
                    }
                ],
            }
        else:
            pod["status"] = {
                "phase": "Running",
                "podIP": "10.0.0.7",
                "startTime": now(),
                "conditions": [{"type": "Ready", "status": "True"}],
                "containerStatuses": [
                    {
                        "name": c["name"],
                        "ready": True,
                        "restartCount": 0,
                        "image": c["image"],
                        "imageID": "",
                        "state": {"running": {"startedAt": now()}},
                    }
                    for c in spec["containers"]
                ],
            }
        self._put("v1", "pods", ns, pod)
        self.logs[pod["metadata"]["uid"]] = log if log is not None else [f"{name} started", f"{name} working"]
        if pending:
            self.event(ns, name, "FailedScheduling", "0/3 nodes are available: 3 Insufficient cpu.")
        return pod

    def _deployment_pods(self, ns, obj):
        name = obj["metadata"]["name"]
        replicas = obj["spec"].get("replicas", 1)
        template_hash = uuid.uuid4().hex[:10]
        rs = {
            "apiVersion": "apps/v1",
            "kind": "ReplicaSet",
            "metadata": {
                "name": f"{name}-{template_hash}",
                "labels": dict(obj["spec"]["template"]["metadata"].get("labels", {})),
                "ownerReferences": [
                    {"apiVersion": "apps/v1", "kind": "Deployment", "name": name, "uid": obj["metadata"]["uid"]}
                ],
            },
            "spec": {"replicas": replicas, "selector": obj["spec"]["selector"], "template": obj["spec"]["template"]},
            "status": {"replicas": 0 if self.quota_exceeded else replicas},
        }
        for old in self.items("apps/v1", "replicasets", ns):
            if any(o.get("name") == name for o in old["metadata"].get("ownerReferences", [])):
                self.store.pop(("apps/v1", "replicasets", ns, old["metadata"]["name"]), None)
        self._put("apps/v1", "replicasets", ns, rs)
        if self.quota_exceeded:
            self.event(
                ns, rs["metadata"]["name"], "FailedCreate",
                f'pods "{rs["metadata"]["name"]}-x7k2p" is forbidden: exceeded quota: compute-resources, '
                "requested: limits.cpu=2, used: limits.cpu=8, limited: limits.cpu=8",
                kind="ReplicaSet",
            )  # fmt: skip
            obj["status"] = {"replicas": 0, "readyReplicas": 0}
            return
        obj["status"] = {"replicas": replicas, "readyReplicas": replicas, "availableReplicas": replicas}
        for _ in range(replicas):
            self._make_pod(ns, f"{name}-{template_hash[:6]}-{uuid.uuid4().hex[:5]}", obj["spec"]["template"], {})

    def _on_create(self, gv, plural, ns, obj):
        if (gv, plural) == ("apps/v1", "deployments"):
            self._deployment_pods(ns, obj)
        elif (gv, plural) == ("v1", "persistentvolumeclaims"):
            obj["status"] = {"phase": "Pending" if self.claims_pending else "Bound"}
            if self.claims_pending:
                self.event(
                    ns, obj["metadata"]["name"], "ProvisioningFailed",
                    "storageclass.storage.k8s.io \"nfs-client\" not found" if obj["spec"].get("storageClassName")
                    else "no persistent volumes available for this claim and no storage class is set",
                    kind="PersistentVolumeClaim",
                )  # fmt: skip
        elif (gv, plural) == ("v1", "services"):
            obj["spec"]["clusterIP"] = "10.96.0.10"
            if obj["spec"].get("type") in ("NodePort", "LoadBalancer"):
                for port in obj["spec"]["ports"]:
                    port.setdefault("nodePort", self.node_ports.get(obj["metadata"]["name"], next(self._node_port)))
        elif (gv, plural) == (VOLCANO, "jobs"):
            job = obj["metadata"]["name"]
            total = sum(task.get("replicas", 1) for task in obj["spec"]["tasks"])
            group = f"{job}-{obj['metadata']['uid']}"
            self._put(
                "scheduling.volcano.sh/v1beta1",
                "podgroups",
                ns,
                {
                    "apiVersion": "scheduling.volcano.sh/v1beta1",
                    "kind": "PodGroup",
                    "metadata": {
                        "name": group,
                        "ownerReferences": [
                            {"apiVersion": VOLCANO, "kind": "Job", "name": job, "uid": obj["metadata"]["uid"]}
                        ],
                    },
                    "spec": {"minMember": obj["spec"]["minAvailable"], "queue": obj["spec"].get("queue", "default")},
                    "status": {"phase": "Pending" if self.podgroup_pending else "Running"}
                    | (
                        {"conditions": [{"type": "Unschedulable", "status": "True", "reason": "NotEnoughResources",
                                         "message": f"{total}/{total} tasks in gang unschedulable: pod group is not "
                                         "ready, 4 Pending, 4 minAvailable; Pending: 1 Unschedulable, 3 Schedulable. "
                                         "Origin reason is elastic-ctr-pserver-0: 0/3 nodes are unavailable: "
                                         "3 Insufficient cpu."}]}
                        if self.podgroup_pending
                        else {}
                    ),
                },
            )  # fmt: skip
            if self.podgroup_pending:
                obj["status"] = {
                    "state": {"phase": "Pending"},
                    "pending": 0,
                    "minAvailable": obj["spec"]["minAvailable"],
                }
                return
            if self.job_pods_forbidden:  # what Volcano's job controller records when admission refuses its pods
                self.event(
                    ns, job, "FailedCreatePod",
                    f'Error creating pods: [failed to create pod pod {job}-pserver-0, err: pods "{job}-pserver-0" is '
                    'forbidden: violates PodSecurity "restricted:latest": allowPrivilegeEscalation != false]',
                    kind="Job",
                )  # fmt: skip
                obj["status"] = {"state": {"phase": "Pending"}, "minAvailable": obj["spec"]["minAvailable"]}
                return
            for task in obj["spec"]["tasks"]:
                for i in range(task.get("replicas", 1)):
                    self._volcano_pod(ns, job, task, i)
            obj["status"] = {
                "state": {"phase": "Pending" if self.unschedulable else "Running"},
                "running": 0 if self.unschedulable else total,
                "pending": total if self.unschedulable else 0,
                "minAvailable": obj["spec"]["minAvailable"],
            }
            if self.on_volcano_job:
                self.on_volcano_job(self, ns, obj)

    def _on_update(self, gv, plural, ns, old, new):
        """What controllers do after an update: a Deployment whose pod template changed rolls its pods."""
        if (gv, plural) == ("apps/v1", "deployments"):
            if old["spec"]["template"] != new["spec"]["template"] or old["spec"].get("replicas") != new["spec"].get(
                "replicas"
            ):
                selector = new["spec"]["selector"]["matchLabels"]
                for pod in self.pods(ns, **selector):
                    self.store.pop(("v1", "pods", ns, pod["metadata"]["name"]), None)
                    self.restarts += 1
                self._deployment_pods(ns, new)

    def _volcano_pod(self, ns, job, task, index, log=None):
        labels = {
            "volcano.sh/job-name": job,
            "volcano.sh/job-namespace": ns,
            "volcano.sh/task-spec": task["name"],
        }
        if self.task_index_label:  # Volcano 1.9 and later
            labels["volcano.sh/task-index"] = str(index)
        if task["name"] == "trainer" and index == 0 and log is None:
            self.trainer_generations += 1
            log = self.trainer_log or ["pass-20191221-00 step 10 loss 0.52", "pass-20191221-00 step 20 loss 0.49"]
        return self._make_pod(
            ns, f"{job}-{task['name']}-{index}", task["template"], labels, pending=self.unschedulable, log=log
        )

    def _on_delete(self, gv, plural, ns, obj):
        if (gv, plural) == (VOLCANO, "jobs"):
            job = obj["metadata"]["name"]

            def remove_pods():  # the job controller takes a moment
                with self.lock:
                    for pod in self.pods(ns, **{"volcano.sh/job-name": job}):
                        self.store.pop(("v1", "pods", ns, pod["metadata"]["name"]), None)

            threading.Timer(self.job_delete_delay, remove_pods).start()
        elif (gv, plural) == ("apps/v1", "deployments"):
            selector = obj["spec"]["selector"]["matchLabels"]
            for pod in self.pods(ns, **selector):
                self.store.pop(("v1", "pods", ns, pod["metadata"]["name"]), None)

    def recreate_trainer0(self, ns, job_name):
        """What RestartJob does to trainer 0: a new pod (new uid) under the same name."""
        job = self.get(VOLCANO, "jobs", ns, job_name)
        task = next(t for t in job["spec"]["tasks"] if t["name"] == "trainer")
        self.trainer_generations += 1
        self._volcano_pod(
            ns,
            job_name,
            task,
            0,
            log=[
                "restarted by RestartJob, resuming from the last pass",
                "pass-20191221-01 step 10 loss 0.47",
                "training finished",
            ],
        )


class _Handler(BaseHTTPRequestHandler):
    fake: FakeKubeAPI
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    # ---- plumbing --------------------------------------------------------------------------------------
    def _send(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _status(self, code, reason, message):
        self._send(
            code,
            {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": message,
                "reason": reason,
                "code": code,
            },
        )

    def _body(self):
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length) or b"{}")

    def _route(self, method):
        url = urlparse(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        fake = self.fake
        with fake.lock:
            fake.requests.append((method, url.path, query))
        if url.path in ("/version", "/version/"):
            return self._send(
                200,
                {
                    "major": "1",
                    "minor": "33",
                    "gitVersion": "v1.33.1",
                    "gitCommit": "8adc0f041b8e7ad1d30e29cc59c6ae7a15e19828",
                    "gitTreeState": "clean",
                    "buildDate": "2025-05-15T08:19:08Z",
                    "goVersion": "go1.24.2",
                    "compiler": "gc",
                    "platform": "linux/amd64",
                },
            )
        for rule, code in fake.deny.items():
            verb, _, part = rule.partition(" ")
            if verb == method and part in url.path:
                reason = "Unauthorized" if code == 401 else "Forbidden"
                message = (
                    "Unauthorized"
                    if code == 401
                    else f'pods is forbidden: User "dev@example.com" cannot {method.lower()} resource in API group ""'
                    ' in the namespace "default"'
                )
                return self._status(code, reason, message)
        proxied = _SERVICE_PROXY.match(unquote(url.path))  # the client sends NAME%3APORT
        if proxied:
            return self._service_proxy(proxied, url.query, method)
        if url.path.rstrip("/") == f"/apis/{MONITORING}" and method == "GET" and fake.prometheus_operator:
            resources = [
                {"name": plural, "singularName": "", "namespaced": True, "kind": kind, "verbs": ["get", "list"]}
                for (gv, plural), kind in KINDS.items()
                if gv == MONITORING
            ]
            return self._send(200, {"kind": "APIResourceList", "groupVersion": MONITORING, "resources": resources})
        if url.path == "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews" and method == "POST":
            review = self._body()
            attributes = review["spec"]["resourceAttributes"]
            denied = attributes["verb"] == "create" and attributes["resource"] in fake.may_not_create
            review["status"] = {"allowed": not denied, **({"reason": "no RBAC rule allows it"} if denied else {})}
            return self._send(201, review)
        m = _PATH.match(url.path)
        if not m:
            return self._status(404, "NotFound", f"the server could not find the requested resource ({url.path})")
        gv = m.group("core") or m.group("gv")
        ns, plural, name, sub = m.group("ns"), m.group("plural"), m.group("name"), m.group("sub")
        if (gv, plural) not in KINDS or (gv == MONITORING and not fake.prometheus_operator):
            return self._status(404, "NotFound", f"the server could not find the requested resource ({url.path})")
        if gv == "v1" and plural == "namespaces":
            ns, plural, name = None, "namespaces", name
        kind = KINDS[(gv, plural)]
        if sub == "log":
            return self._log(ns, name, query)
        with fake.lock:
            if method == "GET" and name is None:
                items = fake.items(gv, plural, ns)
                items = [o for o in items if _matches(o, query.get("labelSelector"), query.get("fieldSelector"))]
                return self._send(
                    200,
                    {
                        "apiVersion": gv,
                        "kind": f"{kind}List",
                        "metadata": {"resourceVersion": str(next(fake._rv))},
                        "items": items,
                    },
                )
            obj = fake.get(gv, plural, ns, name) if name else None
            if method == "GET":
                if obj is None:
                    return self._status(404, "NotFound", f'{plural} "{name}" not found')
                return self._send(200, obj)
            if method == "POST":
                body = self._body()
                if fake.get(gv, plural, ns, body["metadata"]["name"]) is not None:
                    return self._status(409, "AlreadyExists", f'{plural} "{body["metadata"]["name"]}" already exists')
                if query.get("dryRun") == "All":
                    return self._send(201, body)
                fake._put(gv, plural, ns, body)
                fake._on_create(gv, plural, ns, body)
                return self._send(201, body)
            if method == "PUT":
                body = self._body()
                if obj is None:
                    return self._status(404, "NotFound", f'{plural} "{name}" not found')
                if body["metadata"].get("resourceVersion") != obj["metadata"]["resourceVersion"]:
                    return self._status(409, "Conflict", "the object has been modified")
                if query.get("dryRun") == "All":
                    return self._send(200, body)
                body["metadata"]["uid"] = obj["metadata"]["uid"]
                body.setdefault("status", obj.get("status", {}))
                return self._send(200, fake._put(gv, plural, ns, body))
            content_type = self.headers.get("Content-Type", "").split(";")[0]
            if method == "PATCH" and content_type == "application/merge-patch+json":
                if obj is None:
                    return self._status(404, "NotFound", f'{plural} "{name}" not found')
                merged = _merge_patch(obj, self._body())
                if merged == obj:
                    return self._send(200, obj)
                fake._put(gv, plural, ns, merged)
                return self._send(200, merged)
            if method == "PATCH":
                if content_type != "application/apply-patch+yaml":
                    return self._status(415, "UnsupportedMediaType", "only apply and merge patches are answered here")
                if not query.get("fieldManager"):
                    return self._status(400, "BadRequest", "fieldManager is required for apply patches")
                body = self._body()
                if query.get("dryRun") == "All":
                    return self._send(200 if obj else 201, body)
                if obj is None:
                    fake._put(gv, plural, ns, body)
                    fake._on_create(gv, plural, ns, body)
                    return self._send(201, body)
                merged = copy.deepcopy(obj)
                for key, value in body.items():
                    if key == "metadata":
                        meta = merged.setdefault("metadata", {})
                        for mk in ("labels", "annotations"):
                            if mk in value:
                                meta[mk] = {**meta.get(mk, {}), **value[mk]}
                    elif key != "status":
                        merged[key] = value
                if gv == "v1" and plural == "services":  # allocated addresses stay
                    for field in ("clusterIP", "clusterIPs"):
                        if field in obj["spec"]:
                            merged["spec"][field] = obj["spec"][field]
                if merged == obj:
                    return self._send(200, obj)  # no change: same resourceVersion
                fake._put(gv, plural, ns, merged)
                fake._on_update(gv, plural, ns, obj, merged)
                return self._send(200, merged)
            if method == "DELETE":
                if obj is None:
                    return self._status(404, "NotFound", f'{plural} "{name}" not found')
                fake.store.pop((gv, plural, ns, name))
                fake._on_delete(gv, plural, ns, obj)
                if (gv, plural) == ("v1", "services"):  # the API answers a Service delete with the object
                    return self._send(200, obj)
                return self._send(
                    200,
                    {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "metadata": {},
                        "status": "Success",
                        "details": {"name": name, "kind": plural, "uid": obj["metadata"]["uid"]},
                    },
                )
        return self._status(405, "MethodNotAllowed", method)

    def _log(self, ns, name, query):
        fake = self.fake
        with fake.lock:
            pod = fake.get("v1", "pods", ns, name)
            lines = list(fake.logs.get(pod["metadata"]["uid"], [])) if pod else None
            if pod and query.get("previous") == "true":  # the container's instance before its last restart
                lines = fake.previous_logs.get(pod["metadata"]["uid"])
                if lines is None:
                    container = query.get("container", "")
                    return self._status(
                        400, "BadRequest", f'previous terminated container "{container}" in pod "{name}" not found'
                    )
        if pod is None:
            return self._status(404, "NotFound", f'pods "{name}" not found')
        if pod["status"]["phase"] == "Pending":
            return self._status(400, "BadRequest", f'container in pod "{name}" is waiting to start: PodInitializing')
        if query.get("tailLines"):
            lines = lines[-int(query["tailLines"]) :]
        # Each line was "written" one millisecond after the previous, from the pod's creation.
        born = time.mktime(time.strptime(pod["metadata"]["creationTimestamp"], "%Y-%m-%dT%H:%M:%SZ")) - time.timezone
        stamped = [(born + i / 1000, line) for i, line in enumerate(lines)]
        if query.get("sinceSeconds"):
            stamped = [(t, line) for t, line in stamped if t >= time.time() - int(query["sinceSeconds"])]
        if query.get("timestamps") == "true":
            fmt = lambda t: time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t * 1e6) % 1000000:06d}000Z"  # noqa: E731
            lines = [f"{fmt(t)} {line}" for t, line in stamped]
        else:
            lines = [line for _, line in stamped]
        uid = pod["metadata"]["uid"]
        cut_short = False
        if query.get("follow") == "true" and fake.end_stream_early and uid not in fake.streams_cut:
            fake.streams_cut.add(uid)  # the first stream of each pod ends halfway, the pod still running
            lines, cut_short = lines[: len(lines) // 2], True
        if query.get("follow") != "true":
            body = "".join(line + "\n" for line in lines).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for line in lines:
            data = (line + "\n").encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
            time.sleep(fake.log_line_delay)
        labels = pod["metadata"]["labels"]
        is_trainer0 = labels.get("volcano.sh/task-spec") == "trainer" and pod["metadata"]["name"].endswith("-trainer-0")
        if not is_trainer0 and not cut_short:
            # `kubectl logs -f` of a running pod does not end: keep the stream open while the pod runs.
            while not fake.stopping:
                with fake.lock:
                    alive = fake.get("v1", "pods", ns, name) is pod and pod["status"]["phase"] == "Running"
                if not alive:
                    break
                time.sleep(0.05)
        if is_trainer0 and not cut_short:
            job_name = labels["volcano.sh/job-name"]
            with fake.lock:
                job = fake.get(VOLCANO, "jobs", ns, job_name)
                if fake.recreate_trainer and not fake.recreated and job is not None:
                    fake.recreated = True
                    fake.recreate_trainer0(ns, job_name)  # the stream ends because the pod went away
                elif job is not None:
                    job["status"]["state"]["phase"] = "Completed"
                    pod["status"]["phase"] = "Succeeded"
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _service_proxy(self, m, query: str, method: str = "GET"):
        """As the API server proxies to one ready endpoint of the Service (503 when it has none): the request's
        headers go along, except Authorization, which authenticated the caller to the API server and which
        the API server removes."""
        import urllib.error
        import urllib.request

        base = self.fake.service_backends.get((m.group("ns"), m.group("svc"), m.group("port") or ""))
        if base is None:
            return self._status(503, "ServiceUnavailable", f'no endpoints available for service "{m.group("svc")}"')
        target = base + (m.group("path") or "/") + (f"?{query}" if query else "")
        dropped = {"authorization", "host", "connection", "content-length", "accept-encoding"}
        headers = {k: v for k, v in self.headers.items() if k.lower() not in dropped}
        length = int(self.headers.get("Content-Length") or 0)
        data = self.rfile.read(length) if length else None
        request = urllib.request.Request(target, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=600) as answer:
                code, body = answer.status, answer.read()
        except urllib.error.HTTPError as e:
            code, body = e.code, e.read()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._route("GET")

    def do_POST(self):
        self._route("POST")

    def do_PUT(self):
        self._route("PUT")

    def do_DELETE(self):
        self._route("DELETE")

    def do_PATCH(self):
        self._route("PATCH")


def _merge_patch(target, patch):
    """RFC 7386: objects merge key by key, null removes a key, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge_patch(out.get(key), value)
    return out


def _matches(obj, label_selector, field_selector) -> bool:
    labels = obj["metadata"].get("labels", {})
    for term in filter(None, (label_selector or "").split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    for term in filter(None, (field_selector or "").split(",")):
        key, _, value = term.partition("=")
        node = obj
        for part in key.split("."):
            node = node.get(part, {}) if isinstance(node, dict) else {}
        if node != value:
            return False
    return True
