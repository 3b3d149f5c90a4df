"""Read, server-side apply, list and delete the kinds ElasticCTR renders.

Built-in kinds go through the typed APIs with server-side apply (field manager
``elastic-control``, forced: our manifests own what they set, and only that);
the Prometheus Operator's kinds (ServiceMonitor, PrometheusRule) the same way
through CustomObjectsApi; the Volcano Job through CustomObjectsApi too. Volcano's webhook refuses most spec
updates, so replacing the job is delete, wait until it and its pods are gone,
create.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ctr_foundation.errors import ApplyError
from elastic_control.kube import adaptor
from elastic_control.kube import constants as k

APPLY_CONTENT_TYPE = "application/apply-patch+yaml"


@dataclass(frozen=True)
class TypedKind:
    """How to reach one built-in kind through the typed client: method name suffix and API."""

    kind: str
    suffix: str  # e.g. "config_map" for read_namespaced_config_map
    api: Callable
    updatable: bool = True  # a claim's spec is (mostly) immutable: an existing claim is kept as it is
    prunable: bool = True  # claims hold models, files and MLflow runs: never deleted by -a or delete

    def call(self, verb: str, *args, **kwargs):
        return getattr(self.api(), f"{verb}_namespaced_{self.suffix}")(*args, **kwargs)


TYPED_KINDS = {
    "ConfigMap": TypedKind("ConfigMap", "config_map", adaptor.core),
    "Secret": TypedKind("Secret", "secret", adaptor.core),
    "PersistentVolumeClaim": TypedKind(
        "PersistentVolumeClaim", "persistent_volume_claim", adaptor.core, updatable=False, prunable=False
    ),
    "Service": TypedKind("Service", "service", adaptor.core),
    "Deployment": TypedKind("Deployment", "deployment", adaptor.apps),
    "PodDisruptionBudget": TypedKind("PodDisruptionBudget", "pod_disruption_budget", adaptor.policy),
    "NetworkPolicy": TypedKind("NetworkPolicy", "network_policy", adaptor.networking),
    # The trainers' account, which may patch their job's progress annotation (templates/training_job.yaml.j2).
    "ServiceAccount": TypedKind("ServiceAccount", "service_account", adaptor.core),
    "Role": TypedKind("Role", "role", adaptor.rbac),
    "RoleBinding": TypedKind("RoleBinding", "role_binding", adaptor.rbac),
}


@dataclass(frozen=True)
class CustomKind:
    """A custom resource kind applied like a built-in one (server-side apply through CustomObjectsApi)."""

    kind: str
    group: str
    version: str
    plural: str
    updatable: bool = True
    prunable: bool = True

    def call(self, verb: str, name: str, namespace: str, *args, **kwargs):
        """The typed API's verbs (read, patch, delete) on this kind."""
        method = {"read": "get"}.get(verb, verb)
        return getattr(adaptor.custom(), f"{method}_namespaced_custom_object")(
            self.group, self.version, namespace, self.plural, name, *args, **kwargs
        )


CUSTOM_KINDS = {
    name: CustomKind(name, k.MONITORING_GROUP, k.MONITORING_VERSION, plural)
    for name, plural in (
        (k.SERVICE_MONITOR_KIND, k.SERVICE_MONITOR_PLURAL),
        (k.PROMETHEUS_RULE_KIND, k.PROMETHEUS_RULE_PLURAL),
    )
}
# What `delete` and pruning remove by label; claims stay.
DELETABLE_KINDS = tuple(name for name, kind in {**TYPED_KINDS, **CUSTOM_KINDS}.items() if kind.prunable)


def is_volcano_job(doc: dict) -> bool:
    return doc.get("kind") == k.VOLCANO_JOB_KIND and doc.get("apiVersion", "").startswith(k.VOLCANO_JOB_GROUP + "/")


def describe(doc: dict) -> str:
    return f"{doc['kind']} {doc['metadata'].get('namespace', '')}/{doc['metadata']['name']}"


def applied_hash(obj: dict | None) -> str | None:
    return ((obj or {}).get("metadata", {}).get("annotations") or {}).get(k.SPEC_HASH_ANNOTATION)


def _fail(doc: dict, e: adaptor.ApiException, doing: str) -> ApplyError:
    hint = ""
    if e.status == 403 and "PodSecurity" not in adaptor.api_error_message(e):
        hint = " (your user lacks the RBAC rights: `kubectl auth can-i --list -n NAMESPACE`)"
    return ApplyError(
        f"{doing} failed: HTTP {e.status}: {adaptor.api_error_message(e)}{hint}",
        kind=doc["kind"],
        namespace=doc["metadata"].get("namespace", ""),
        name=doc["metadata"]["name"],
    )


def typed_kind(doc: dict) -> TypedKind | CustomKind:
    kind = TYPED_KINDS.get(doc["kind"]) or CUSTOM_KINDS.get(doc["kind"])
    if kind is None:
        raise ApplyError(f"elastic-control does not know how to apply kind {doc['kind']!r}")
    return kind


def read_typed(doc: dict) -> dict | None:
    """The live object ``doc`` describes, as plain JSON (None when absent)."""
    kind = typed_kind(doc)
    name, namespace = doc["metadata"]["name"], doc["metadata"]["namespace"]
    with adaptor.reachable(f"reading {describe(doc)}"):
        try:
            return adaptor.to_dict(kind.call("read", name, namespace))
        except adaptor.ApiException as e:
            if e.status == 404:
                return None
            raise _fail(doc, e, "reading") from e


def server_side_apply(doc: dict, *, dry_run: bool = False) -> dict:
    """PATCH ``doc`` with server-side apply; creates the object when it does not exist."""
    kind = typed_kind(doc)
    name, namespace = doc["metadata"]["name"], doc["metadata"]["namespace"]
    extra = {"dry_run": "All"} if dry_run else {}
    with adaptor.reachable(f"applying {describe(doc)}"):
        try:
            return adaptor.to_dict(
                kind.call(
                    "patch",
                    name,
                    namespace,
                    doc,
                    field_manager=k.MANAGED_BY,
                    force=True,
                    _content_type=APPLY_CONTENT_TYPE,
                    **extra,
                )
            )
        except adaptor.ApiException as e:
            raise _fail(doc, e, "applying") from e


@dataclass(frozen=True)
class Listed:
    """One listed object: what pruning and `delete` need of it."""

    name: str
    labels: dict


def list_labelled(kind_name: str, namespace: str, selector: str) -> list[Listed]:
    """The objects of ``kind_name`` with the labels of ``selector``; none when the cluster lacks the kind."""
    if kind_name in CUSTOM_KINDS:
        kind = CUSTOM_KINDS[kind_name]
        with adaptor.reachable(f"listing {kind_name}s"):
            try:
                found = adaptor.custom().list_namespaced_custom_object(
                    kind.group, kind.version, namespace, kind.plural, label_selector=selector
                )
            except adaptor.ApiException as e:
                if e.status == 404:  # the Prometheus Operator is not installed: nothing of ours to find
                    return []
                raise
        return [Listed(i["metadata"]["name"], i["metadata"].get("labels") or {}) for i in found.get("items", [])]
    kind = TYPED_KINDS[kind_name]
    with adaptor.reachable(f"listing {kind_name}s"):
        items = getattr(kind.api(), f"list_namespaced_{kind.suffix}")(namespace, label_selector=selector).items
    return [Listed(i.metadata.name, i.metadata.labels or {}) for i in items]


def delete_typed(kind_name: str, name: str, namespace: str) -> bool:
    """Delete one object (its dependents in the background); False when it was already gone."""
    kind = TYPED_KINDS.get(kind_name) or CUSTOM_KINDS[kind_name]
    with adaptor.reachable(f"deleting {kind_name} {namespace}/{name}"):
        try:
            kind.call("delete", name, namespace, propagation_policy="Background")
            return True
        except adaptor.ApiException as e:
            if e.status == 404:
                return False
            raise


def read_volcano_job(name: str, namespace: str) -> dict | None:
    with adaptor.reachable(f"reading Volcano job {namespace}/{name}"):
        try:
            return adaptor.custom().get_namespaced_custom_object(
                k.VOLCANO_JOB_GROUP, k.VOLCANO_JOB_VERSION, namespace, k.VOLCANO_JOB_PLURAL, name
            )
        except adaptor.ApiException as e:
            if e.status == 404:
                return None
            raise


def job_pods(name: str, namespace: str) -> list:
    with adaptor.reachable(f"listing the pods of job {namespace}/{name}"):
        return adaptor.core().list_namespaced_pod(namespace, label_selector=f"{k.VOLCANO_JOB_NAME_LABEL}={name}").items


def delete_volcano_job(name: str, namespace: str, *, wait: float = 0.0, poll: float = 0.5) -> bool:
    """Delete the job (its pods go with it); with ``wait``, block until both are gone. False if absent."""
    with adaptor.reachable(f"deleting Volcano job {namespace}/{name}"):
        try:
            adaptor.custom().delete_namespaced_custom_object(
                k.VOLCANO_JOB_GROUP,
                k.VOLCANO_JOB_VERSION,
                namespace,
                k.VOLCANO_JOB_PLURAL,
                name,
                propagation_policy="Foreground",
            )
        except adaptor.ApiException as e:
            if e.status == 404:
                return False
            raise
    deadline = time.monotonic() + wait
    while wait and time.monotonic() < deadline:
        if read_volcano_job(name, namespace) is None and not job_pods(name, namespace):
            return True
        time.sleep(poll)
    if wait:
        raise ApplyError(
            f"still terminating after {wait:g}s; check `kubectl get vcjob,pods -n {namespace}` and run -a again",
            kind="Job",
            namespace=namespace,
            name=name,
        )
    return True


def create_volcano_job(doc: dict, *, dry_run: bool = False) -> None:
    namespace = doc["metadata"]["namespace"]
    extra = {"dry_run": "All"} if dry_run else {}
    with adaptor.reachable(f"creating {describe(doc)}"):
        try:
            adaptor.custom().create_namespaced_custom_object(
                k.VOLCANO_JOB_GROUP, k.VOLCANO_JOB_VERSION, namespace, k.VOLCANO_JOB_PLURAL, doc, **extra
            )
        except adaptor.ApiException as e:
            raise _fail(doc, e, "creating") from e


def delete_labelled(namespace: str, instance: str) -> list[str]:
    """Delete every object of DELETABLE_KINDS labelled with the instance; returns what was deleted."""
    deleted = []
    selector = f"{k.LABEL_INSTANCE}={instance}"
    for kind_name in DELETABLE_KINDS:
        for item in list_labelled(kind_name, namespace, selector):
            if delete_typed(kind_name, item.name, namespace):
                deleted.append(f"{kind_name} {namespace}/{item.name}")
    return deleted


def apply_volcano_job(doc: dict, *, dry_run: bool = False, delete_wait: float = 300.0) -> str:
    """Create the job; an existing one is deleted first, whatever its spec (what `eval submit` wants:
    each submission runs again). -a converges instead (kube/converge.py)."""
    name, namespace = doc["metadata"]["name"], doc["metadata"]["namespace"]
    existing = read_volcano_job(name, namespace)
    if dry_run:
        if existing is None:
            create_volcano_job(doc, dry_run=True)
        return "created" if existing is None else "replaced (delete, then create)"
    if existing is not None:
        delete_volcano_job(name, namespace, wait=delete_wait)
    create_volcano_job(doc)
    return "created" if existing is None else "replaced (deleted, then created)"


def training_record_doc(job_doc: dict) -> dict:
    """The ConfigMap recording that -a created the training job ``job_doc`` (its spec hash, when)."""
    meta = job_doc["metadata"]
    labels = {key: value for key, value in meta.get("labels", {}).items() if key != k.LABEL_COMPONENT}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": meta["name"] + k.TRAINING_RECORD_SUFFIX,
            "namespace": meta["namespace"],
            "labels": {**labels, k.LABEL_COMPONENT: k.TRAINING_RECORD_COMPONENT},
        },
        "data": {
            "spec-hash": applied_hash(job_doc) or "",
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "ttl-seconds-after-finished": str(job_doc["spec"].get("ttlSecondsAfterFinished", "")),
        },
    }


def read_training_record(job: str, namespace: str) -> dict | None:
    """The data of the training job's record (training_record_doc), None when -a never created the job."""
    doc = {"kind": "ConfigMap", "metadata": {"name": job + k.TRAINING_RECORD_SUFFIX, "namespace": namespace}}
    live = read_typed(doc)
    return (live or {}).get("data") if live is not None else None
