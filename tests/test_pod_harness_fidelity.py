"""The pod harness behaves as the cluster it stands for, on small hand-written manifests (seconds each):
Volcano's PodEvicted event, cluster DNS (search list, ndots, names published with readiness) and
NetworkPolicies on direct pod-to-pod connections."""

from __future__ import annotations

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


def volcano_job(name: str, tasks: dict[str, dict], policies: list[dict], max_retry: int = 3) -> dict:
    """A Volcano Job with the svc and env plugins; ``tasks``: name -> pod spec, one replica each."""
    return {
        "apiVersion": "batch.volcano.sh/v1alpha1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "minAvailable": len(tasks),
            "maxRetry": max_retry,
            "plugins": {"svc": [], "env": []},
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
