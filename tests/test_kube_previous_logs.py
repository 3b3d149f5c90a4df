"""-l on the Kubernetes backend: a container that restarted shows its previous instance's log (what made it
restart) before the current one, marked as previous."""

from __future__ import annotations

import pytest
from helpers_kube import render_plan
from helpers_kube_api import fake_cluster

from elastic_control.kube.backend import KubeBackend


@pytest.fixture()
def cluster(tmp_path, monkeypatch):
    with fake_cluster(tmp_path, monkeypatch, apply_timeout="30") as api:
        yield api


def _restarted(cluster, pod_prefix: str, previous: list[str] | None) -> str:
    """Mark the pod's container as restarted once; ``previous``: the log its earlier instance left."""
    pod = next(p for p in cluster.items("v1", "pods", "default") if p["metadata"]["name"].startswith(pod_prefix))
    with cluster.lock:
        pod["status"]["containerStatuses"][0]["restartCount"] = 1
        if previous is not None:
            cluster.previous_logs[pod["metadata"]["uid"]] = previous
    return pod["metadata"]["name"]


def _previous_asked(cluster) -> list[str]:
    return [p for m, p, q in cluster.requests if m == "GET" and p.endswith("/log") and q.get("previous") == "true"]


def test_a_restarted_container_shows_its_previous_log_first(cluster, tmp_path, capsys):
    plan, _ = render_plan(tmp_path / "state", cpu=4, mem=20, trainers=2, pservers=1, cube_shards=1)
    KubeBackend().apply(plan).wait()
    name = _restarted(cluster, "elastic-ctr-trainer-0", ["pass-20191221-00 step 10", "MemoryError: out of memory"])
    capsys.readouterr()
    cluster.requests.clear()
    KubeBackend().attach(plan).stream_logs(components=["trainer-0", "fileserver"])
    lines = capsys.readouterr().out.splitlines()
    mine = [line for line in lines if line.startswith(f"[{name}") and not line.startswith(f"[{name} kept]")]
    assert mine[:3] == [
        f"[{name} previous] (container trainer restarted 1x: its previous log)",
        f"[{name} previous] pass-20191221-00 step 10",
        f"[{name} previous] MemoryError: out of memory",
    ]
    assert mine[3:] and all(line.startswith(f"[{name}] ") for line in mine[3:])  # then the current instance
    assert _previous_asked(cluster) == [f"/api/v1/namespaces/default/pods/{name}/log"]  # not the file server's


def test_a_previous_log_the_kubelet_no_longer_has_is_said_so(cluster, tmp_path, capsys):
    plan, _ = render_plan(tmp_path / "state", cpu=4, mem=20, trainers=2, pservers=1, cube_shards=1)
    KubeBackend().apply(plan).wait()
    name = _restarted(cluster, "elastic-ctr-fileserver-", None)
    capsys.readouterr()
    KubeBackend().attach(plan).stream_logs(components=["fileserver"])
    out = capsys.readouterr().out
    assert f"[{name} previous] (log unavailable: HTTP 400 previous terminated container" in out
    assert f"[{name}] " in out.replace(f"[{name} previous]", "")  # the current log still follows


def test_following_a_restarted_container_shows_its_previous_log_before_the_stream(cluster, tmp_path, capsys):
    plan, _ = render_plan(tmp_path / "state", cpu=4, mem=20, trainers=2, pservers=1, cube_shards=1)
    KubeBackend().apply(plan).wait()
    name = _restarted(cluster, "elastic-ctr-trainer-0", ["pass-20191221-00 step 10", "Killed"])
    capsys.readouterr()
    cluster.requests.clear()
    # Trainer 0's followed stream ends with the job Completed (the fake's scenario), so follow returns.
    KubeBackend().attach(plan).stream_logs(components=["trainer-0"], follow=True)
    lines = capsys.readouterr().out.splitlines()
    mine = [line for line in lines if line.startswith(f"[{name}") and not line.startswith(f"[{name} kept]")]
    assert mine[:3] == [
        f"[{name} previous] (container trainer restarted 1x: its previous log)",
        f"[{name} previous] pass-20191221-00 step 10",
        f"[{name} previous] Killed",
    ]
    assert mine[3:] and all(line.startswith(f"[{name}] ") for line in mine[3:])
    assert len(_previous_asked(cluster)) == 1  # once, not at every reattach
