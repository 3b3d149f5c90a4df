"""Why pods are missing or pending, from the objects that know: PodGroups, ReplicaSets, claims.

The common failures on a new cluster create no pod at all: Volcano keeps the
job's PodGroup Pending (queue capacity, a gang that does not fit), a
ResourceQuota or the Pod Security admission refuses the ReplicaSet's pods, a
claim stays unbound (no default StorageClass, an access mode the class does
not offer). Pod events say nothing there; these functions read the events and
conditions of the objects involved and say what to change.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic_control.kube import adaptor
from elastic_control.kube import constants as k

PODGROUP_GROUP, PODGROUP_VERSION, PODGROUP_PLURAL = "scheduling.volcano.sh", "v1beta1", "podgroups"


@dataclass(frozen=True)
class Finding:
    message: str
    fatal: bool = False  # waiting longer will not help


def events_of(namespace: str, kind: str, name: str) -> list:
    with adaptor.reachable(f"reading the events of {kind} {name}"):
        events = (
            adaptor.core()
            .list_namespaced_event(namespace, field_selector=f"involvedObject.kind={kind},involvedObject.name={name}")
            .items
        )
    return sorted(events, key=lambda e: str(e.last_timestamp or e.event_time or ""))


def _warning(events: list, *reasons: str):
    found = [e for e in events if e.type == "Warning" and (not reasons or e.reason in reasons)]
    return found[-1] if found else None


def _admission_hint(message: str) -> tuple[str, bool]:
    lower = message.lower()
    if "exceeded quota" in lower or "must specify limits" in lower or "must specify requests" in lower:
        return "a ResourceQuota refuses it: lower -u/-m, or ask for more quota (`kubectl describe quota`)", True
    if "podsecurity" in lower or "violates podsecurity" in lower:
        return "the namespace's Pod Security admission refuses it", True
    if "forbidden" in lower:
        return "an admission policy refuses it", True
    return "", False


def replica_set_findings(namespace: str, instance: str) -> list[Finding]:
    """FailedCreate of the instance's ReplicaSets (quotas, Pod Security, webhooks)."""
    with adaptor.reachable("listing replica sets"):
        sets = adaptor.apps().list_namespaced_replica_set(namespace, label_selector=f"{k.LABEL_INSTANCE}={instance}")
    findings = []
    for rs in sets.items:
        desired = rs.spec.replicas or 0
        if (rs.status.replicas or 0) >= desired:
            continue
        event = _warning(events_of(namespace, "ReplicaSet", rs.metadata.name), "FailedCreate")
        if event is None:
            continue
        hint, fatal = _admission_hint(event.message or "")
        owner = (rs.metadata.owner_references or [None])[0]
        what = f"Deployment {owner.name}" if owner is not None else f"ReplicaSet {rs.metadata.name}"
        findings.append(
            Finding(
                f"{what} cannot create its pods: {(event.message or '').strip()}" + (f"; {hint}" if hint else ""), fatal
            )  # fmt: skip
        )
    return findings


def job_findings(namespace: str, job: str) -> list[Finding]:
    """The Volcano job's PodGroup (pending: queue capacity, gang), and the job's own warnings."""
    findings = []
    with adaptor.reachable(f"listing the PodGroups of job {job}"):
        try:
            groups = adaptor.custom().list_namespaced_custom_object(
                PODGROUP_GROUP, PODGROUP_VERSION, namespace, PODGROUP_PLURAL
            )["items"]
        except adaptor.ApiException as e:
            if e.status not in (403, 404):
                raise
            groups = []
    mine = [
        g
        for g in groups
        if g["metadata"]["name"] == job
        or g["metadata"]["name"].startswith(f"{job}-")
        and any(o.get("name") == job for o in g["metadata"].get("ownerReferences") or [])
    ]
    for group in mine:
        status = group.get("status") or {}
        phase = status.get("phase", "Pending")
        if phase not in ("Pending", "Inqueue"):
            continue
        reasons = [
            c.get("message") or c.get("reason")
            for c in status.get("conditions") or []
            if c.get("type") == "Unschedulable" and c.get("status", "True") == "True"
        ]
        event = _warning(events_of(namespace, "PodGroup", group["metadata"]["name"]))
        if event is not None:
            reasons.append(event.message)
        reason = next((r for r in reversed(reasons) if r), "no reason given yet")
        minimum = (group.get("spec") or {}).get("minMember")
        hint = (
            f"Volcano admits the job only when all {minimum} pods fit at once (gang scheduling): lower -t/-p or "
            "-u/-m, add nodes, or give the queue more capacity (`kubectl get queue -o yaml`)"
        )
        findings.append(Finding(f"PodGroup {group['metadata']['name']} is {phase}: {reason.strip()}; {hint}"))
    event = _warning(events_of(namespace, "Job", job))
    if event is not None:
        hint, fatal = _admission_hint(event.message or "")
        findings.append(Finding(f"Volcano job {job}: {event.reason}: {(event.message or '').strip()}"
                                + (f"; {hint}" if hint else ""), fatal))  # fmt: skip
    return findings


def claim_findings(namespace: str, instance: str) -> list[Finding]:
    """Claims that stay Pending, with the provisioner's reason and the option that fixes it."""
    with adaptor.reachable("listing persistent volume claims"):
        claims = adaptor.core().list_namespaced_persistent_volume_claim(
            namespace, label_selector=f"{k.LABEL_INSTANCE}={instance}"
        )
    findings = []
    for claim in claims.items:
        if claim.status is None or claim.status.phase != "Pending":
            continue
        events = events_of(namespace, "PersistentVolumeClaim", claim.metadata.name)
        if any(e.reason == "WaitForFirstConsumer" for e in events[-1:]):
            continue  # normal until a pod that mounts it is scheduled
        event = _warning(events) or (events[-1] if events else None)
        message = (event.message or event.reason) if event else "no events yet"
        modes = ",".join(claim.spec.access_modes or [])
        cls = claim.spec.storage_class_name
        hints = []
        if not cls and "storage class" in message.lower():
            hints.append("pass --storage-class NAME to -r (`kubectl get storageclass`)")
        if "ReadWriteMany" in modes:
            hints.append("if the class offers no ReadWriteMany, pass --access-mode ReadWriteOnce to -r")
        if not hints:
            hints.append("check `kubectl get storageclass` and --storage-class/--access-mode of -r")
        findings.append(
            Finding(
                f"claim {claim.metadata.name} ({modes}, class {cls or 'default'}) is Pending: {message.strip()}; "
                + " or ".join(hints)
            )
        )
    return findings


def missing_pod_findings(namespace: str, instance: str, job: str) -> list[Finding]:
    """Every reason the cluster gives for pods of the plan that were not created or not scheduled."""
    return (
        replica_set_findings(namespace, instance) + job_findings(namespace, job) + claim_findings(namespace, instance)
    )
