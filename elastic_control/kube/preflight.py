"""Checks before -a touches anything: namespace, Volcano's Job CRD, the queue, the rights to create the
training job's progress account.

Each failure says what is wrong and how to fix it.
"""

from __future__ import annotations

from ctr_foundation.errors import ClusterUnavailableError
from elastic_control.kube import adaptor
from elastic_control.kube import constants as k


def check_namespace(namespace: str) -> None:
    with adaptor.reachable(f"reading namespace {namespace}"):
        try:
            adaptor.core().read_namespace(namespace)
        except adaptor.ApiException as e:
            if e.status == 404:
                raise ClusterUnavailableError(
                    f"namespace {namespace!r} does not exist: create it with `kubectl create namespace {namespace}` "
                    "or pass another --namespace to -r"
                ) from e
            if e.status != 403:  # without rights to read namespaces, creating objects will tell
                raise ClusterUnavailableError(
                    f"reading namespace {namespace!r} failed: HTTP {e.status} {e.reason}"
                ) from e


def check_volcano_crd() -> None:
    with adaptor.reachable(f"reading CRD {k.VOLCANO_JOB_CRD}"):
        try:
            crd = adaptor.apiextensions().read_custom_resource_definition(k.VOLCANO_JOB_CRD)
        except adaptor.ApiException as e:
            if e.status == 404:
                raise ClusterUnavailableError(
                    f"Volcano is not installed: the CRD {k.VOLCANO_JOB_CRD} does not exist; {k.VOLCANO_INSTALL_HINT}"
                ) from e
            if e.status == 403:
                return  # not allowed to read CRDs: the job creation itself will say if Volcano is missing
            raise ClusterUnavailableError(f"reading CRD {k.VOLCANO_JOB_CRD} failed: HTTP {e.status} {e.reason}") from e
    served = [v.name for v in crd.spec.versions if v.served]
    if k.VOLCANO_JOB_VERSION not in served:
        raise ClusterUnavailableError(
            f"the installed Volcano does not serve {k.VOLCANO_JOB_GROUP}/{k.VOLCANO_JOB_VERSION} "
            f"(serves: {', '.join(served) or 'nothing'}); {k.VOLCANO_INSTALL_HINT}"
        )


def check_queue(queue: str) -> None:
    with adaptor.reachable(f"reading Volcano queue {queue}"):
        try:
            obj = adaptor.custom().get_cluster_custom_object(
                k.VOLCANO_QUEUE_GROUP, k.VOLCANO_QUEUE_VERSION, k.VOLCANO_QUEUE_PLURAL, queue
            )
        except adaptor.ApiException as e:
            if e.status == 404:
                raise ClusterUnavailableError(
                    f"Volcano queue {queue!r} does not exist: create it (kind Queue, "
                    f"{k.VOLCANO_QUEUE_GROUP}/{k.VOLCANO_QUEUE_VERSION}) or pass --queue to -r "
                    "(Volcano creates `default`)"
                ) from e
            if e.status == 403:
                return
            raise ClusterUnavailableError(f"reading Volcano queue {queue!r} failed: HTTP {e.status} {e.reason}") from e
    state = (obj.get("status") or {}).get("state", "Open")
    if state != "Open":
        raise ClusterUnavailableError(
            f"Volcano queue {queue!r} is {state}, so it accepts no jobs: open it with "
            f"`vcctl queue operate --name {queue} --action open` or pass another --queue to -r"
        )


# What the training job's progress account needs (templates/training_job.yaml.j2): the `edit` ClusterRole,
# which many teams get in their namespace, may create none of the RBAC objects.
PROGRESS_ACCOUNT_KINDS = (
    ("", "serviceaccounts"),
    ("rbac.authorization.k8s.io", "roles"),
    ("rbac.authorization.k8s.io", "rolebindings"),
)


def may_create(namespace: str, group: str, resource: str) -> bool | None:
    """The API server's answer (SelfSubjectAccessReview) to "may I create ``resource`` in ``namespace``";
    None when it cannot be asked (then the creation itself will say)."""
    with adaptor.reachable(f"asking whether you may create {resource} in {namespace}"):
        try:
            return adaptor.access_allowed(namespace, "create", group, resource)
        except adaptor.ApiException:
            return None


def check_progress_account_rights(namespace: str) -> None:
    denied = [
        f"{resource}.{group}" if group else resource
        for group, resource in PROGRESS_ACCOUNT_KINDS
        if may_create(namespace, group, resource) is False
    ]
    if denied:
        raise ClusterUnavailableError(
            f"you may not create {', '.join(denied)} in namespace {namespace!r}, which trainer 0's progress "
            "annotation needs (a ServiceAccount whose Role may patch the training job; the `edit` ClusterRole "
            "does not grant it): ask a namespace admin to apply, or run -r again with --no-job-progress "
            "(`status` then shows no pass progress on this cluster)"
        )


def preflight(*, namespace: str, queue: str, job_progress: bool = False) -> None:
    """Raise ClusterUnavailableError naming the first missing prerequisite."""
    check_namespace(namespace)
    check_volcano_crd()
    check_queue(queue)
    if job_progress:
        check_progress_account_rights(namespace)
