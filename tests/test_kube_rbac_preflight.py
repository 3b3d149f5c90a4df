"""-a on a cluster where the user may not create the training job's progress account (the `edit` ClusterRole:
no ServiceAccount/Role/RoleBinding writes): refused before anything is created, with the way out named;
``--no-job-progress`` renders no such object and applies."""

from __future__ import annotations

import pytest
import yaml
from helpers_kube import render_plan
from helpers_kube_api import fake_cluster

from ctr_foundation.errors import ClusterUnavailableError
from elastic_control.kube.backend import KubeBackend

EDIT_ROLE_LACKS = {"roles", "rolebindings"}


def _rendered_kinds(manifests) -> list[str]:
    return [d["kind"] for f in sorted(manifests.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]


def test_apply_without_rights_for_the_progress_account_is_refused_before_creating_anything(tmp_path, monkeypatch):
    with fake_cluster(tmp_path, monkeypatch, may_not_create=EDIT_ROLE_LACKS) as cluster:
        plan, _ = render_plan(tmp_path / "state", trainers=2, pservers=1, cube_shards=1)
        with pytest.raises(ClusterUnavailableError) as refused:
            KubeBackend().apply(plan)
        message = str(refused.value)
        assert "roles.rbac.authorization.k8s.io, rolebindings.rbac.authorization.k8s.io" in message
        assert "--no-job-progress" in message and "serviceaccounts" not in message  # only what is denied
        created = [(m, p) for m, p, _ in cluster.requests if m in ("POST", "PATCH", "PUT")]
        assert all("selfsubjectaccessreviews" in p for _, p in created), created  # nothing applied


def test_no_job_progress_renders_no_account_and_applies_with_the_edit_role(tmp_path, monkeypatch):
    with fake_cluster(tmp_path, monkeypatch, may_not_create=EDIT_ROLE_LACKS, apply_timeout="30") as cluster:
        plan, manifests = render_plan(
            tmp_path / "state", trainers=2, pservers=1, cube_shards=1, kube={"job_progress": False}
        )
        kinds = _rendered_kinds(manifests)
        assert "Role" not in kinds and "RoleBinding" not in kinds and "ServiceAccount" not in kinds
        KubeBackend().apply(plan).wait()
        trainers = [p for p in cluster.items("v1", "pods", "default") if "-trainer-" in p["metadata"]["name"]]
        assert trainers and all(p["spec"].get("automountServiceAccountToken") is False for p in trainers)
        assert all("serviceAccountName" not in p["spec"] for p in trainers)


def test_by_default_the_account_is_rendered_and_allowed_users_apply(tmp_path, monkeypatch):
    with fake_cluster(tmp_path, monkeypatch, apply_timeout="30") as cluster:
        plan, manifests = render_plan(tmp_path / "state", trainers=2, pservers=1, cube_shards=1)
        assert {"Role", "RoleBinding", "ServiceAccount"} <= set(_rendered_kinds(manifests))
        KubeBackend().apply(plan).wait()
        reviews = [p for m, p, _ in cluster.requests if "selfsubjectaccessreviews" in p]
        assert len(reviews) == 3  # serviceaccounts, roles, rolebindings asked before applying
