"""Create-or-replace, read, list and delete the kinds ElasticCTR renders.

Built-in kinds go through the typed APIs; the Volcano Job through
CustomObjectsApi. Volcano's webhook refuses most spec updates, so replacing
the job is delete, wait until it and its pods are gone, create.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ctr_foundation.errors import ApplyError
from elastic_control.kube import adaptor
from elastic_control.kube import constants as k


@dataclass(frozen=True)
class TypedKind:
    """How to reach one built-in kind through the typed client: method name suffix and API."""

    kind: str
    suffix: str  # e.g. "config_map" for read_namespaced_config_map
    api: Callable
    replaceable: bool = True  # PVC specs are immutable: an existing claim is kept as it is

    def call(self, verb: str, *args, **kwargs):
        return getattr(self.api(), f"{verb}_namespaced_{self.suffix}")(*args, **kwargs)


TYPED_KINDS = {
    "ConfigMap": TypedKind("ConfigMap", "config_map", adaptor.core),
    "Secret": TypedKind("Secret", "secret", adaptor.core),
    "PersistentVolumeClaim": TypedKind(
        "PersistentVolumeClaim", "persistent_volume_claim", adaptor.core, replaceable=False
    ),
    "Service": TypedKind("Service", "service", adaptor.core),
    "Deployment": TypedKind("Deployment", "deployment", adaptor.apps),
}
# What `delete` removes by label; claims stay (they hold models, files and MLflow runs).
DELETABLE_KINDS = ("Deployment", "Service", "ConfigMap", "Secret")


def is_volcano_job(doc: dict) -> bool:
    return doc.get("kind") == k.VOLCANO_JOB_KIND and doc.get("apiVersion", "").startswith(k.VOLCANO_JOB_GROUP + "/")


def describe(doc: dict) -> str:
    return f"{doc['kind']} {doc['metadata'].get('namespace', '')}/{doc['metadata']['name']}"


def _fail(doc: dict, e: adaptor.ApiException, doing: str) -> ApplyError:
    import json

    try:
        message = json.loads(e.body).get("message") or e.reason
    except (TypeError, ValueError):
        message = e.reason
    return ApplyError(
        f"{doing} failed: HTTP {e.status}: {message}",
        kind=doc["kind"],
        namespace=doc["metadata"].get("namespace", ""),
        name=doc["metadata"]["name"],
    )


def apply_typed(doc: dict, *, dry_run: bool = False) -> str:
    """Create ``doc`` or replace the existing object; returns "created", "replaced" or "kept"."""
    kind = TYPED_KINDS.get(doc["kind"])
    if kind is None:
        raise ApplyError(f"elastic-control does not know how to apply kind {doc['kind']!r}")
    name, namespace = doc["metadata"]["name"], doc["metadata"]["namespace"]
    extra = {"dry_run": "All"} if dry_run else {}
    with adaptor.reachable(f"applying {describe(doc)}"):
        try:
            existing = adaptor.to_dict(kind.call("read", name, namespace))
        except adaptor.ApiException as e:
            if e.status != 404:
                raise _fail(doc, e, "reading") from e
            existing = None
        try:
            if existing is None:
                kind.call("create", namespace, doc, **extra)
                return "created"
            if not kind.replaceable:
                return "kept"
            body = _for_replace(doc, existing)
            kind.call("replace", name, namespace, body, **extra)
            return "replaced"
        except adaptor.ApiException as e:
            raise _fail(doc, e, "creating" if existing is None else "replacing") from e


def _for_replace(doc: dict, existing: dict) -> dict:
    """A replace must carry the current resourceVersion, and a Service keeps its allocated addresses."""
    import copy

    body = copy.deepcopy(doc)
    body["metadata"]["resourceVersion"] = existing["metadata"].get("resourceVersion")
    if doc["kind"] == "Service":
        old_spec = existing.get("spec", {})
        for field in ("clusterIP", "clusterIPs"):
            if old_spec.get(field):
                body["spec"][field] = old_spec[field]
        # Keep node ports the cluster allocated, so addresses handed to clients stay valid.
        old_ports = {p.get("name"): p.get("nodePort") for p in old_spec.get("ports", [])}
        if body["spec"].get("type") in ("NodePort", "LoadBalancer"):
            for port in body["spec"].get("ports", []):
                if old_ports.get(port.get("name")):
                    port["nodePort"] = old_ports[port["name"]]
    return body


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


def apply_volcano_job(doc: dict, *, dry_run: bool = False, delete_wait: float = 300.0) -> str:
    """Create the job; an existing one is deleted first (Volcano refuses spec updates)."""
    name, namespace = doc["metadata"]["name"], doc["metadata"]["namespace"]
    existing = read_volcano_job(name, namespace)
    with adaptor.reachable(f"applying {describe(doc)}"):
        try:
            if dry_run:
                if existing is None:
                    adaptor.custom().create_namespaced_custom_object(
                        k.VOLCANO_JOB_GROUP, k.VOLCANO_JOB_VERSION, namespace, k.VOLCANO_JOB_PLURAL, doc, dry_run="All"
                    )
                return "created" if existing is None else "replaced (delete, then create)"
            if existing is not None:
                delete_volcano_job(name, namespace, wait=delete_wait)
            adaptor.custom().create_namespaced_custom_object(
                k.VOLCANO_JOB_GROUP, k.VOLCANO_JOB_VERSION, namespace, k.VOLCANO_JOB_PLURAL, doc
            )
        except adaptor.ApiException as e:
            raise _fail(doc, e, "creating") from e
    return "created" if existing is None else "replaced (deleted, then created)"


def delete_labelled(namespace: str, instance: str) -> list[str]:
    """Delete every object of DELETABLE_KINDS labelled with the instance; returns what was deleted."""
    deleted = []
    selector = f"{k.LABEL_INSTANCE}={instance}"
    for kind_name in DELETABLE_KINDS:
        kind = TYPED_KINDS[kind_name]
        with adaptor.reachable(f"deleting {kind_name}s"):
            for item in getattr(kind.api(), f"list_namespaced_{kind.suffix}")(namespace, label_selector=selector).items:
                try:
                    kind.call("delete", item.metadata.name, namespace)
                    deleted.append(f"{kind_name} {namespace}/{item.metadata.name}")
                except adaptor.ApiException as e:
                    if e.status != 404:
                        raise
    return deleted
