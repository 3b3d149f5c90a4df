"""-l on the Kubernetes backend shows what earlier training pods left on the shared claim: the kept logs
(ctr_foundation/log_keeper.py), read from the real file server through the API server's Service proxy, which
passes the token in X-Elastic-Ctr-Authorization (it removes Authorization). The live pod's own copy is not
shown twice; with no pod left, every kept log is what -l shows."""

from __future__ import annotations

import pytest
from helpers_common import fileserver_in_thread
from helpers_kube import FIXED_TOKEN, render_plan
from helpers_kube_api import fake_cluster

from ctr_foundation.log_keeper import kept_log_path
from elastic_control.kube.logs import KEPT_SHOWN, stream_logs

POD = "elastic-ctr-trainer-0"


@pytest.fixture()
def deployed(tmp_path, monkeypatch):
    with fake_cluster(tmp_path, monkeypatch, apply_timeout="30") as cluster:
        from elastic_control.kube.backend import KubeBackend

        plan, _ = render_plan(tmp_path / "state", cpu=4, mem=20, trainers=1, pservers=1, cube_shards=1)
        KubeBackend().apply(plan).wait()
        kept = tmp_path / "claim" / "logs"
        with fileserver_in_thread(tmp_path / "files", token=FIXED_TOKEN, kept_logs=kept) as url:
            cluster.service_backends[("default", "elastic-ctr-fileserver", "http")] = url
            yield cluster, plan, kept


def _keep(kept, when: float, lines: list[str]) -> str:
    path = kept_log_path(kept, POD, "trainer", when)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{line}\n" for line in lines))
    return path.name[: -len("-trainer.log")]


def test_the_log_of_a_pod_volcano_deleted_is_shown_before_the_live_one(deployed, capsys):
    cluster, plan, kept = deployed
    gone = _keep(kept, 1_700_000_000, ["pass-20191221-00 step 10", "Traceback (most recent call last):", "OSError"])
    _keep(kept, 4_000_000_000, ["the live pod's own copy"])  # started after the live container: not earlier
    stream_logs(plan, components=["trainer-0"], tail=2)
    lines = capsys.readouterr().out.splitlines()
    prefix = f"[{POD} kept {gone}]"
    assert lines[:3] == [
        f"{prefix} (an earlier {POD}, started {gone}: its log as kept on the shared claim)",
        f"{prefix} Traceback (most recent call last):",  # --tail 2 applies to kept logs too
        f"{prefix} OSError",
    ]
    assert all(line.startswith(f"[{POD}] ") for line in lines[3:]) and lines[3:]  # then the live pod's log
    assert not any("the live pod's own copy" in line for line in lines)
    # The token went through the proxy in the header the API server passes on.
    assert any(p.endswith(f"/proxy/files/logs/{POD}/") for m, p, _ in cluster.requests if m == "GET")


def test_with_no_pod_left_every_kept_log_is_shown_newest_last_and_older_ones_counted(deployed, capsys):
    cluster, plan, kept = deployed
    stamps = [_keep(kept, 1_700_000_000 + 3600 * i, [f"run {i}"]) for i in range(KEPT_SHOWN + 2)]
    with cluster.lock:  # the job and its pods removed after their TTL
        for pod in cluster.items("v1", "pods", "default"):
            if pod["metadata"]["name"] == POD:
                cluster.store.pop(("v1", "pods", "default", POD))
    stream_logs(plan, components=["trainer-0"])
    out = capsys.readouterr().out
    assert f"[{POD} kept] (2 older kept logs not shown: /files/logs/{POD}/)" in out
    shown = [s for s in stamps if f"[{POD} kept {s}] run" in out]
    assert shown == stamps[-KEPT_SHOWN:]
    assert out.index(f"run {KEPT_SHOWN - 1}") < out.index(f"run {KEPT_SHOWN + 1}")
    assert "(no pod yet for selector" in out


def test_nothing_kept_yet_prints_nothing_extra_and_a_refusing_file_server_is_said(deployed, capsys):
    cluster, plan, _ = deployed
    stream_logs(plan, components=["trainer-0"])
    assert " kept" not in capsys.readouterr().out  # 404: nothing kept under that pod name
    cluster.service_backends.pop(("default", "elastic-ctr-fileserver", "http"))
    stream_logs(plan, components=["trainer-0"])
    out = capsys.readouterr().out
    assert f"[{POD} kept] (kept logs unavailable: HTTP 503 through the API server" in out
    assert f"[{POD}] " in out  # the live log still follows


def test_the_deployment_handle_shows_the_kept_logs_too(deployed, capsys):
    """The Python handle (what the demo and scripts use) reads logs through the same owner as -l."""
    from elastic_control.kube.backend import KubeBackend

    _, plan, kept = deployed
    gone = _keep(kept, 1_700_000_000, ["pass-20191221-00 step 10", "OSError"])
    KubeBackend().attach(plan).stream_logs(components=["trainer-0"])
    out = capsys.readouterr().out
    assert f"[{POD} kept {gone}] OSError" in out
    assert out.index("OSError") < out.index(f"[{POD}] ")  # before the live pod's log
