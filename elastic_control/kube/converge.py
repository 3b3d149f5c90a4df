"""`-a` converges the cluster on the rendered manifests, and changes nothing that already matches.

Every rendered object carries the hash of what was rendered
(``elastic-ctr/spec-hash``). For each document:

- absent: created (server-side apply);
- present with the same hash: left alone, no write at all (no restart, no
  resourceVersion change);
- present with another hash: server-side applied (field manager
  ``elastic-control``, forced), so fields other managers own stay theirs. A
  Deployment keeps the replicas the cluster has (an HPA's, `kubectl scale`'s)
  unless the plan's replicas changed since the last -a; a config change reaches
  its pods through the checksum annotation of their template, which rolls them;
- the Volcano Job cannot be updated (its webhook refuses it): with the same
  hash it is left alone, running or finished; with another it is deleted,
  waited for, and created again. Creating it writes the ConfigMap
  JOB-training-record (its hash): a job with that hash that is gone (its
  ttlSecondsAfterFinished removed it once it finished) is not run again;
- claims are created, never changed or deleted (they hold the data).

Then objects of the instance that are no longer rendered (`-b 5` then `-b 2`:
shards 2-4, their Services; a PodDisruptionBudget no longer wanted) are deleted.
Evaluation jobs (``eval submit``) are not part of the plan and are never pruned.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from elastic_control.kube import constants as k
from elastic_control.kube import objects as ob

REPLICAS_ANNOTATION = k.REPLICAS_ANNOTATION
NOT_PRUNED_COMPONENTS = {"eval", "eval-merge", k.TRAINING_RECORD_COMPONENT}


@dataclass(frozen=True)
class Change:
    kind: str
    namespace: str
    name: str
    action: str  # created | unchanged | updated | recreated | kept | pruned (| would be ...)

    def describe(self) -> str:
        return f"{self.kind} {self.namespace}/{self.name} {self.action}"


def _deployment_body(doc: dict, live: dict) -> dict:
    """The Deployment to apply: the cluster's replicas kept unless the plan's replicas changed."""
    body = copy.deepcopy(doc)
    rendered = doc["spec"].get("replicas")
    last = (live.get("metadata", {}).get("annotations") or {}).get(REPLICAS_ANNOTATION)
    live_replicas = (live.get("spec") or {}).get("replicas")
    if last is not None and str(rendered) == last and live_replicas is not None:
        body["spec"]["replicas"] = live_replicas
    return body


def converge_object(doc: dict, *, dry_run: bool = False, job_delete_wait: float = 300.0) -> Change:
    meta = doc["metadata"]
    change = lambda action: Change(doc["kind"], meta["namespace"], meta["name"], action)  # noqa: E731
    want = ob.applied_hash(doc)
    if ob.is_volcano_job(doc):
        live = ob.read_volcano_job(meta["name"], meta["namespace"])
        if live is not None and ob.applied_hash(live) == want:
            return change("unchanged")
        if live is None and _removed_after_its_ttl(doc, want):
            record = f"configmap {meta['name']}{k.TRAINING_RECORD_SUFFIX}"
            return change(
                "kept removed (this plan's job ran and is gone: its TTL removed it once it finished, or it was "
                f"deleted); to run it again: `kubectl delete {record} -n {meta['namespace']}`, then -a"
            )
        if dry_run:
            if live is None:
                ob.create_volcano_job(doc, dry_run=True)
                return change("would be created")
            return change("would be recreated (its spec changed: delete, then create)")
        if live is not None:
            ob.delete_volcano_job(meta["name"], meta["namespace"], wait=job_delete_wait)
        ob.create_volcano_job(doc)
        ob.server_side_apply(ob.training_record_doc(doc))
        return change("created" if live is None else "recreated (its spec changed)")
    kind = ob.typed_kind(doc)
    live = ob.read_typed(doc)
    if live is not None and ob.applied_hash(live) == want:
        return change("unchanged")
    if live is not None and not kind.updatable:
        return change("kept (claims are never changed: delete it yourself to resize or move it)")
    body = _deployment_body(doc, live) if live is not None and doc["kind"] == "Deployment" else doc
    ob.server_side_apply(body, dry_run=dry_run)
    action = "created" if live is None else "updated"
    return change(f"would be {action}" if dry_run else action)


def _removed_after_its_ttl(doc: dict, want: str | None) -> bool:
    """Whether -a created this very job before (its record holds the hash) and it has a TTL to be gone by."""
    if doc["spec"].get("ttlSecondsAfterFinished") is None:
        return False
    record = ob.read_training_record(doc["metadata"]["name"], doc["metadata"]["namespace"])
    return record is not None and record.get("spec-hash") == want


def stale_objects(docs: list[dict], namespace: str, instance: str) -> list[tuple[str, str]]:
    """(kind, name) of the instance's objects that the rendered ``docs`` no longer contain."""
    rendered = {(d["kind"], d["metadata"]["name"]) for d in docs}
    selector = f"{k.LABEL_INSTANCE}={instance},{k.LABEL_MANAGED_BY}={k.MANAGED_BY}"
    stale = []
    for kind_name in ob.DELETABLE_KINDS:
        for item in ob.list_labelled(kind_name, namespace, selector):
            if item.labels.get(k.LABEL_COMPONENT) in NOT_PRUNED_COMPONENTS:
                continue
            if (kind_name, item.name) not in rendered:
                stale.append((kind_name, item.name))
    return stale


def prune(docs: list[dict], namespace: str, instance: str, *, dry_run: bool = False) -> list[Change]:
    changes = []
    for kind_name, name in stale_objects(docs, namespace, instance):
        if dry_run:
            changes.append(Change(kind_name, namespace, name, "would be pruned (no longer rendered)"))
        elif ob.delete_typed(kind_name, name, namespace):
            changes.append(Change(kind_name, namespace, name, "pruned (no longer rendered)"))
    return changes
