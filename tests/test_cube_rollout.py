"""cube-agent + cube-transfer against real servers and the real file server: versioned, consistent rollouts."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import requests
from helpers_common import PYTHON, REPO, free_port
from helpers_cube import (
    TOKEN,
    add_done,
    cube_processes,
    fileserver,
    shard_specs,
    write_synthetic_pass,
)

from cube.client import CubeClient
from cube.promotion_gate import GateDecision
from cube.rollout import RetryPolicy
from cube.transfer import Transfer, TransferConfig

pytestmark = pytest.mark.e2e
AUTH = {"Authorization": f"Bearer {TOKEN}"}
KEYS = np.unique(np.random.default_rng(3).integers(1, 2**64 - 1, 3000, dtype=np.uint64))


@dataclass
class Cluster:
    root: Path
    fs_url: str
    servers: list[str]
    agents: list[str]

    def add_pass(self, hour: int, value: float, t: float | None = None) -> str:
        name = f"pass-20240101-{hour:02d}"
        write_synthetic_pass(self.root / "models" / name, KEYS, np.full((len(KEYS), 4), value, np.float32))
        add_done(self.root / "models", name, t)
        return name

    def transfer(self, **kw) -> Transfer:
        cfg = TransferConfig(
            model_path=self.root / "models",
            cube_root=self.root / "built",
            fileserver_url=self.fs_url,
            agents=kw.pop("agents", self.agents),
            token=TOKEN,
            retry=RetryPolicy(attempts=2, backoff=0.1, timeout=10),
            **kw,
        )
        return Transfer(cfg)

    def actives(self) -> list[str | None]:
        return [requests.get(f"{u}/v1/status", timeout=5).json()["active"] for u in self.servers]


@pytest.fixture
def cluster(tmp_path):
    (tmp_path / "models").mkdir()
    with contextlib.ExitStack() as stack:
        fs_url = stack.enter_context(fileserver(tmp_path / "fileserver"))
        started = stack.enter_context(cube_processes(shard_specs(tmp_path, 2, fs_url, workers=(2, 1)), tmp_path))
        yield Cluster(tmp_path, fs_url, [started[0][0], started[2][0]], [started[1][0], started[3][0]])


def test_passes_roll_out_to_every_shard_and_restart_rebuilds_nothing(cluster):
    first = cluster.add_pass(0, 1.0, t=time.time() - 5)
    t = cluster.transfer(keep=2)
    assert t.poll_once() == first
    assert cluster.actives() == [first, first]
    st = t.status()[1]
    timings = st["active"]["timings"]
    assert timings["built"] is True and timings["freshness_s"] >= 5 and timings["prepare_s"] >= 0
    current = requests.get(f"{cluster.fs_url}/files/cube/current.json", timeout=5).json()
    assert current["version"] == first and current["shards"] == 2 and current["dense"] == f"cube/{first}/dense/"
    assert (
        requests.get(f"{cluster.fs_url}/files/cube/{first}/dense/inference.pdmodel", timeout=5).content
        == b"model-" + first.encode()
    )
    with CubeClient(cluster.servers) as c:
        v, f, version = c.lookup(KEYS)
        assert version == first and f.all() and np.all(v == 1.0)

    second = cluster.add_pass(1, 2.0)
    assert t.poll_once() == second
    assert cluster.actives() == [second, second]
    assert t.poll_once() is None  # nothing new

    # A restarted transfer knows everything is done: no rebuild, no rollout.
    again = cluster.transfer(keep=2)
    assert again.poll_once() is None
    assert again.journal.active_version == second

    third = cluster.add_pass(2, 3.0)
    assert again.poll_once() == third
    # keep=2: the oldest build is gone, locally and on the file server; the previous one stays.
    assert sorted(p.name for p in (cluster.root / "built").iterdir() if p.name.startswith("pass-")) == [second, third]
    assert requests.get(f"{cluster.fs_url}/files/cube/{first}/manifest.json", timeout=5).status_code == 404
    st = requests.get(f"{cluster.servers[1]}/v1/status", timeout=5).json()
    assert (st["active"], st["previous"]) == (third, second)


def test_corrupt_or_truncated_downloads_are_refused_and_the_old_version_keeps_serving(cluster):
    first = cluster.add_pass(0, 1.0)
    t = cluster.transfer()
    assert t.poll_once() == first
    second = "pass-20240101-01"
    write_synthetic_pass(cluster.root / "models" / second, KEYS, np.full((len(KEYS), 4), 2.0, np.float32))
    from cube.builder import build_version

    manifest = build_version(pass_dir=cluster.root / "models" / second, shards=2, output=cluster.root / "built")
    entry = manifest["files"]["shard-0.arrow"]
    local = cluster.root / "built" / second / "shard-0.arrow"
    requests.put(
        f"{cluster.fs_url}/files/cube/{second}/shard-0.arrow", data=local.read_bytes(), headers=AUTH, timeout=10
    ).raise_for_status()
    url = f"{cluster.fs_url}/files/cube/{second}/shard-0.arrow"
    bad_sha = {"version": second, "url": url, "sha256": "0" * 64, "size": entry["size"]}
    r = requests.post(f"{cluster.agents[0]}/v1/prepare", json=bad_sha, headers=AUTH, timeout=30)
    assert r.status_code == 422 and "sha256" in r.json()["error"]
    wrong_size = {"version": second, "url": url, "sha256": entry["sha256"], "size": entry["size"] + 10}
    r = requests.post(f"{cluster.agents[0]}/v1/prepare", json=wrong_size, headers=AUTH, timeout=30)
    assert r.status_code == 422 and "truncated" in r.json()["error"]
    # A truncated file whose checksum matches what was sent is still refused (its structure is broken).
    data = local.read_bytes()[:-100]
    requests.put(f"{cluster.fs_url}/files/cube/{second}/cut.arrow", data=data, headers=AUTH, timeout=10)
    import hashlib

    cut = {
        "version": second,
        "url": f"{cluster.fs_url}/files/cube/{second}/cut.arrow",
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    r = requests.post(f"{cluster.agents[0]}/v1/prepare", json=cut, headers=AUTH, timeout=30)
    assert r.status_code == 422, r.text
    assert not (cluster.root / "shard-0" / second / "shard-0.arrow").exists()
    r = requests.post(f"{cluster.agents[0]}/v1/prepare", json=bad_sha, timeout=30)
    assert r.status_code == 401
    st = requests.get(f"{cluster.servers[0]}/v1/status", timeout=5).json()
    assert st["active"] == first and st["prepared"] is None
    with CubeClient(cluster.servers) as c:
        v, f, version = c.lookup(KEYS[:100])
        assert version == first and np.all(v == 1.0)


def test_a_shard_down_during_prepare_aborts_the_rollout_everywhere(cluster):
    first = cluster.add_pass(0, 1.0)
    assert cluster.transfer().poll_once() == first
    second = cluster.add_pass(1, 2.0)
    dead = f"http://127.0.0.1:{free_port()}"
    t = cluster.transfer(agents=[cluster.agents[0], dead])
    t.poll_once()
    assert cluster.actives() == [first, first]
    snap = t.status()[1]
    assert snap["active"]["version"] == first and snap["in_flight"] is None
    assert snap["passes"][second]["status"] == "failed" and "shard 1" in snap["passes"][second]["reason"]
    assert snap["passes"][second]["next_retry_at"] > time.time()
    # Shard 0 prepared the new version but never activated it.
    assert requests.get(f"{cluster.servers[0]}/v1/status", timeout=5).json()["prepared"] == second
    # Once the shard is back, a later poll finishes the pass (after its backoff).
    t2 = cluster.transfer()
    t2.journal.data["passes"][second]["next_retry_at"] = 0
    assert t2.poll_once() == second
    assert cluster.actives() == [second, second]


def _transfer_cli(cluster, env_extra=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "ELASTIC_CTR_TOKEN": TOKEN, **(env_extra or {})}
    return subprocess.run(
        [
            PYTHON,
            "-m",
            "cube.transfer",
            "--once",
            "--model-path",
            str(cluster.root / "models"),
            "--cube-root",
            str(cluster.root / "built"),
            "--fileserver",
            cluster.fs_url,
            "--agents",
            ",".join(cluster.agents),
            "--timeout",
            "10",
            "--retries",
            "2",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_transfer_killed_mid_activation_ends_consistent_after_restart(cluster):
    first = cluster.add_pass(0, 1.0)
    r = _transfer_cli(cluster)
    assert r.returncode == 0, r.stderr
    second = cluster.add_pass(1, 2.0)
    r = _transfer_cli(cluster, {"ELASTIC_CTR_CUBE_TEST_CRASH": "after-first-activate"})
    assert r.returncode == 86, r.stderr
    journal = json.loads((cluster.root / "built" / "transfer-state.json").read_text())
    assert journal["in_flight"]["version"] == second and journal["in_flight"]["phase"] == "activating"
    assert journal["active"]["version"] == first
    assert second in cluster.actives()  # at least one shard switched before the crash
    r = _transfer_cli(cluster)
    assert r.returncode == 0, r.stderr
    assert cluster.actives() == [second, second]
    journal = json.loads((cluster.root / "built" / "transfer-state.json").read_text())
    assert journal["in_flight"] is None and journal["active"]["version"] == second
    assert journal["active"]["timings"].get("recovered") is True
    assert journal["active"]["timings"].get("built") is None  # the recovery did not rebuild


def test_promotion_gate_rejects_and_force_skips_it(cluster):
    first = cluster.add_pass(0, 1.0)
    calls = []

    def gate(candidate, active):
        calls.append((Path(candidate).name, active and Path(active).name))
        passed = len(calls) == 1
        return GateDecision(passed, "ok" if passed else "auc dropped", {"auc": 0.5})

    t = cluster.transfer(gate=gate)
    assert t.poll_once() == first
    second = cluster.add_pass(1, 2.0)
    t.poll_once()
    assert calls == [(first, None), (second, first)]
    snap = t.status()[1]
    assert snap["passes"][second]["status"] == "rejected" and snap["passes"][second]["gate"]["reason"] == "auc dropped"
    assert cluster.actives() == [first, first]
    third = cluster.add_pass(2, 3.0)
    forced = cluster.transfer(gate=gate, force=True)
    assert forced.poll_once() == third and len(calls) == 2
    assert cluster.actives() == [third, third]


def test_transfer_status_endpoint_and_cli_errors(cluster, tmp_path):
    r = subprocess.run(
        [PYTHON, "-m", "cube.transfer", "--once", "--model-path", str(tmp_path)],
        cwd=REPO,
        env={k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_CTR")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "ELASTIC_CTR_FILESERVER_URL" in r.stderr and "Traceback" not in r.stderr
    from ctr_foundation.http_json import make_json_server
    from ctr_foundation.http_server import serve_in_thread

    t = cluster.transfer()
    server = make_json_server(host="127.0.0.1", port=0, routes=t.routes(), token=TOKEN, name="cube-transfer")
    serve_in_thread(server)
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert requests.get(f"{base}/healthz", timeout=5).json()["status"] == "ok"
        assert requests.get(f"{base}/v1/status", timeout=5).json()["active"] is None
        assert requests.post(f"{base}/v1/poll", timeout=5).status_code == 401
        assert requests.post(f"{base}/v1/poll", headers=AUTH, timeout=5).status_code == 202
        shards = requests.get(f"{base}/v1/shards", timeout=5).json()["shards"]
        assert [s["shard"] for s in shards] == [0, 1]
    finally:
        server.shutdown()
        server.server_close()


def test_the_pass_cube_transfer_activates_becomes_champion_in_mlflow(cluster, mlflow_server, monkeypatch):
    """MLflow 3 aliases instead of stages: trainer 0's registration points candidate at each new version,
    cube-transfer points champion at the version of the pass it activated, even when it activates the pass
    before trainer 0 registered it."""
    from mlflow.tracking import MlflowClient

    from ctr_foundation.model_registry import CANDIDATE, CHAMPION, alias_version
    from elastic_control.training.tracking import Tracker

    url, _ = mlflow_server
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    tracker = Tracker(cluster.root / "models", run_name="train", retry_for=30)

    def register(name):
        window = {"start": "20240101/00", "end": "20240101/00"}
        return tracker.register_pass(cluster.root / "models" / name, pass_name=name, window=window, metrics={})

    first = cluster.add_pass(0, 1.0)
    assert register(first) == "1"
    assert alias_version(url, CANDIDATE) == "1" and alias_version(url, CHAMPION) is None
    t = cluster.transfer(mlflow_uri=url)
    assert t.poll_once() == first
    assert t.champion.wait(60) and alias_version(url, CHAMPION) == "1"

    second = cluster.add_pass(1, 2.0)
    assert t.poll_once() == second  # active on every shard before trainer 0 registered it
    time.sleep(0.5)
    assert alias_version(url, CHAMPION) == "1"
    assert register(second) == "2" and alias_version(url, CANDIDATE) == "2"
    assert t.champion.wait(60) and alias_version(url, CHAMPION) == "2"
    assert t.status()[1]["champion"]["last"]["pass"] == second
    client = MlflowClient(tracking_uri=url, registry_uri=url)
    assert (
        client.get_model_version_by_alias("elastic-ctr", "champion").tags["pass"] == second
    )  # models:/elastic-ctr@champion
    tracker.finish()
