"""Pass progress as the Volcano job's annotation: trainer 0 patches it through its own narrow account
(elastic_control/training/job_progress.py), `status` on the Kubernetes backend shows it."""

from __future__ import annotations

import json
import re

import pytest
from helpers_kube import render_plan
from helpers_kube_api import VOLCANO, fake_cluster

from ctr_foundation.progress import PassProgress
from ctr_foundation.records import DonefileEntry
from elastic_control.cli.status_view import print_status
from elastic_control.kube import adaptor
from elastic_control.kube import constants as k
from elastic_control.kube.backend import KubeBackend
from elastic_control.kube.render import load_manifests
from elastic_control.training import job_progress as jp


@pytest.fixture()
def cluster(tmp_path, monkeypatch):
    with fake_cluster(tmp_path, monkeypatch, apply_timeout="30") as api:
        yield api


def _plan(tmp_path):
    return render_plan(tmp_path / "state", cpu=4, mem=20, trainers=2, pservers=1, cube_shards=1)


def _allows(role: dict, verb: str, path: str) -> bool:
    """Kubernetes RBAC for one namespaced request path: does some rule of ``role`` grant it?"""
    m = re.fullmatch(r"/apis/(?P<group>[^/]+)/[^/]+/namespaces/[^/]+/(?P<resource>[^/]+)/(?P<name>[^/]+)", path)
    assert m, path
    return any(
        m["group"] in rule["apiGroups"]
        and m["resource"] in rule["resources"]
        and (not rule.get("resourceNames") or m["name"] in rule["resourceNames"])
        and verb in rule["verbs"]
        for rule in role["rules"]
    )


def test_only_the_trainers_carry_a_token_and_it_may_patch_their_job_only(tmp_path):
    _, manifests = _plan(tmp_path)
    docs = load_manifests(manifests)
    account = f"elastic-ctr{k.PROGRESS_ACCOUNT_SUFFIX}"
    (role,) = [d for d in docs if d["kind"] == "Role"]
    (binding,) = [d for d in docs if d["kind"] == "RoleBinding"]
    (sa,) = [d for d in docs if d["kind"] == "ServiceAccount"]
    assert sa["metadata"]["name"] == account and sa["automountServiceAccountToken"] is False
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": "default"}]
    job_path = f"/apis/{VOLCANO}/namespaces/default/jobs/elastic-ctr"
    assert _allows(role, "patch", job_path) and _allows(role, "get", job_path)
    assert not _allows(role, "delete", job_path)
    assert not _allows(role, "patch", f"/apis/{VOLCANO}/namespaces/default/jobs/elastic-ctr-eval")
    # The account comes before the job (-a applies in order: the job's pods name an existing account).
    kinds = [d["kind"] for d in docs]
    assert kinds.index("ServiceAccount") < kinds.index("Job")
    pod_specs = {}
    for doc in docs:
        if doc["kind"] == "Job":
            pod_specs.update({t["name"]: t["template"]["spec"] for t in doc["spec"]["tasks"]})
        elif doc["kind"] == "Deployment":
            pod_specs[doc["metadata"]["name"]] = doc["spec"]["template"]["spec"]
    assert pod_specs["trainer"]["serviceAccountName"] == account
    assert pod_specs["trainer"]["automountServiceAccountToken"] is True
    others = {name: spec for name, spec in pod_specs.items() if name != "trainer"}
    assert len(others) >= 5 and all(s["automountServiceAccountToken"] is False for s in others.values())
    assert not any("serviceAccountName" in s for s in others.values())


def test_trainer_0_patches_the_job_and_status_shows_it(cluster, tmp_path, capsys):
    plan, manifests = _plan(tmp_path)
    KubeBackend().apply(plan).wait()
    role = next(d for d in load_manifests(manifests) if d["kind"] == "Role")
    annotator = jp.JobProgressAnnotator(adaptor.custom(), "default", "elastic-ctr", every=3600)
    progress = PassProgress(None, "20260101-00", write=True, epochs=2, sink=annotator)
    progress.expect(share_lines=1000, batch_size=10)
    cluster.requests.clear()
    progress.start_epoch(1)  # forced: sent at once
    progress.step(40, 400)  # within `every`: not sent
    patches = [(m, p) for m, p, _ in cluster.requests if m == "PATCH"]
    assert len(patches) == 1 and _allows(role, "patch", patches[0][1])  # what the Role lets the trainer do
    job = cluster.get(VOLCANO, "jobs", "default", "elastic-ctr")
    published = json.loads(job["metadata"]["annotations"][k.PROGRESS_ANNOTATION])
    assert published["pass"] == "20260101-00" and published["steps"] == 0 and published["steps_planned"] == 200
    assert job["metadata"]["annotations"][k.SPEC_HASH_ANNOTATION]  # -a's annotation is kept beside it
    progress.finish(2)  # forced again: the pass's last word
    status = KubeBackend().attach(plan).status(probe=False)
    assert status.training["progress"]["steps"] == 40 and status.training["progress"]["steps_planned"] == 40
    assert status.training["state"] == "running"  # the view shows progress of a running job only
    capsys.readouterr()
    print_status(status)
    assert "progress: pass 20260101-00: epoch 1/2, step 40/40" in capsys.readouterr().out


def test_a_refused_patch_leaves_training_alone_and_waits_before_trying_again(cluster, tmp_path, capsys):
    """No job of that name (or a Role that does not allow it): a line on stderr, no exception, a quiet minute."""
    annotator = jp.JobProgressAnnotator(adaptor.custom(), "default", "no-such-job", every=0)
    annotator({"pass": "p"}, force=True)
    assert "progress annotation on job default/no-such-job not written" in capsys.readouterr().err
    cluster.requests.clear()
    annotator({"pass": "p"}, force=True)
    assert not cluster.requests


def test_status_ignores_a_progress_annotation_that_is_not_a_document():
    from elastic_control.kube.status import job_progress

    assert job_progress({"metadata": {"annotations": {k.PROGRESS_ANNOTATION: "{not json"}}}) is None
    assert job_progress({"metadata": {"annotations": {k.PROGRESS_ANNOTATION: "[1]"}}}) is None
    assert job_progress({"metadata": {}}) is None
    assert job_progress({"metadata": {"annotations": {k.PROGRESS_ANNOTATION: '{"pass": "p"}'}}}) == {"pass": "p"}


def test_only_a_trainer_pod_with_a_token_publishes(tmp_path, monkeypatch):
    assert jp.job_of_host("elastic-ctr-trainer-0") == "elastic-ctr"
    assert jp.job_of_host("my-trainer-job-trainer-12") == "my-trainer-job"
    assert jp.job_of_host("elastic-ctr-pserver-0") is None and jp.job_of_host("laptop") is None
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    # the pod harness's pods and local processes: no service-account mount
    assert jp.JobProgressAnnotator.in_pod("elastic-ctr-trainer-0", account_dir=tmp_path) is None
    (tmp_path / "token").write_text("t")
    assert jp.JobProgressAnnotator.in_pod("elastic-ctr-pserver-0", account_dir=tmp_path) is None
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    assert jp.JobProgressAnnotator.in_pod("elastic-ctr-trainer-0", account_dir=tmp_path) is None


def _entries(n: int) -> list[DonefileEntry]:
    return [
        DonefileEntry(
            f"pass-20260101-{h:02d}",
            f"/shared/m/pass-20260101-{h:02d}",
            {"start": f"20260101/{h:02d}", "end": f"20260101/{h:02d}"},
            "2026-01-01T00:00:00Z",
            {"logloss": 0.5 - h / 100},
            {},
        )  # fmt: skip
        for h in range(n)
    ]


def test_the_annotation_lists_the_complete_passes_and_sends_them_at_once(cluster, tmp_path):
    """What `tune` on Kubernetes prunes on: each complete pass's window end and held-out log loss, sent as soon
    as the donefile has it (not after `every`), the last MAX_PASSES of them."""
    plan, _ = _plan(tmp_path)
    KubeBackend().apply(plan).wait()
    annotator = jp.JobProgressAnnotator(adaptor.custom(), "default", "elastic-ctr", every=3600)
    annotator.passes_done(_entries(2))  # a restarted trainer 0: nothing of its own to send yet
    assert (
        k.PROGRESS_ANNOTATION not in cluster.get(VOLCANO, "jobs", "default", "elastic-ctr")["metadata"]["annotations"]
    )
    annotator({"pass": "20260101-02", "steps": 5}, force=True)
    annotator.passes_done(_entries(3))  # within `every`, yet sent

    def published():
        job = cluster.get(VOLCANO, "jobs", "default", "elastic-ctr")
        return json.loads(job["metadata"]["annotations"][k.PROGRESS_ANNOTATION])

    doc = published()
    assert doc["pass"] == "20260101-02" and doc["steps"] == 5
    assert doc["passes"][-1] == {"pass": "pass-20260101-02", "end": "20260101/02", "logloss": 0.48}
    assert len(doc["passes"]) == 3
    annotator.passes_done(_entries(jp.MAX_PASSES + 5))
    passes = published()["passes"]
    assert len(passes) == jp.MAX_PASSES and passes[0]["pass"] == "pass-20260101-05"


def test_a_trainer_pod_whose_cluster_configuration_cannot_load_trains_without_progress(tmp_path, monkeypatch, capsys):
    """The annotator's client is the project's one adaptor (in-cluster in a pod); a configuration it cannot load
    (no CA file beside the token here) is a line on stderr and no annotator, never a failed trainer."""
    from elastic_control.kube import adaptor as kube_adaptor

    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    (tmp_path / "token").write_text("t")
    (tmp_path / "namespace").write_text("team-a\n")
    kube_adaptor.reset()
    try:
        assert jp.JobProgressAnnotator.in_pod("elastic-ctr-trainer-0", account_dir=tmp_path) is None
    finally:
        kube_adaptor.reset()
    assert "no progress annotation on job team-a/elastic-ctr" in capsys.readouterr().err
