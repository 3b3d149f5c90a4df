"""Serving with real cube-server processes and a real file server: version switches under load with the
hot-key cache, readiness that means "can answer", and the pins that keep an A/B challenger's version."""

from __future__ import annotations

import json
import time

import pyarrow  # noqa: F401  (before paddle)

import numpy as np
import pytest
import requests
from helpers_serving import (  # noqa: F401  (served_fixture: the session's passes, fixture "served")
    copy_pass,
    cube_servers,
    fileserver_in_thread,
    golden,
    predict_through_switch,
    publish_version,
    scale_embeddings,
    served_fixture,
    serving_in_thread,
    set_current,
    switch_cube_version,
)

from elastic_control.serving.versions import FileServerSource

pytestmark = pytest.mark.needs_criteo  # the session's passes are trained on real Criteo lines
TOL = 1e-5
TOKEN = "t0ken"  # the file server's and cube's write token in helpers_serving
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def scaled(served, tmp_path_factory):
    """Pass A with every embedding x1.7 (own golden.jsonl): a version whose cube rows all differ from A's."""
    root = tmp_path_factory.mktemp("scaled-models")
    s = copy_pass(served.a, root, "pass-20200101-05", donefile=False)
    scale_embeddings(s, 1.7)
    return s


def _load_everywhere(urls, version):
    for url in urls:
        r = requests.post(f"{url}/v1/load", json={"version": version}, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text


def test_switch_under_load_with_the_cache_never_mixes_versions(served, scaled, tmp_path):
    """4 clients predict while cube and current.json move from A to S: no failed request, and every answer
    equals the golden probabilities of the version it names (cached rows of A never reach S's batches)."""
    fs_root = tmp_path / "fs"
    va = publish_version(fs_root, served.a, shards=2)
    lines, probs_a = golden(served.a)
    _, probs_s = golden(scaled)
    assert np.max(np.abs(np.array(probs_a) - np.array(probs_s))) > 1e-3  # the versions really differ
    with cube_servers(fs_root / "cube", 2, tmp_path) as urls, fileserver_in_thread(fs_root) as fs_url:
        source = FileServerSource(fs_url, tmp_path / "cache", urls)
        with serving_in_thread(source, poll_interval=0.1, cache_entries=1 << 16) as srv:
            assert srv.app.active.version == va
            n = len(lines) - 8
            vs, answers, errors = predict_through_switch(
                srv, lines, fs_root, urls, scaled, start=lambda i, k: ((i + k) * 17) % n
            )
            hit_rate = srv.app.cache.snapshot()["hit_rate"]
    assert errors == []
    assert {a["model_version"] for _, a in answers} == {va, vs}
    assert hit_rate > 0.5, hit_rate  # the cache was doing the work on both sides of the switch
    for j, a in answers:
        assert a["model_version"] == a["cube_version"]
        want = probs_a if a["model_version"] == va else probs_s
        np.testing.assert_allclose(a["predictions"], want[j : j + 8], rtol=0, atol=TOL)


def test_readiness_means_cube_answers(served, tmp_path):
    fs_root = tmp_path / "fs"
    publish_version(fs_root, served.a, shards=2)
    lines, _ = golden(served.a)
    with cube_servers(fs_root / "cube", 2, tmp_path) as urls, fileserver_in_thread(fs_root) as fs_url:
        source = FileServerSource(fs_url, tmp_path / "cache", urls, lookup_timeout=1.0)
        with serving_in_thread(source, probe_interval=0.2, cache_entries=0) as srv:
            deadline = time.monotonic() + 20
            while requests.get(srv.url + "/readyz").status_code != 200:
                assert time.monotonic() < deadline, requests.get(srv.url + "/readyz").text
                time.sleep(0.1)
            # shard 1 goes away: the model is loaded, but serving cannot answer -> not ready, with the reason
            procs = _cube_server_processes(fs_root / "cube", 2)
            procs[1].kill()
            procs[1].wait()
            deadline = time.monotonic() + 20
            while (r := requests.get(srv.url + "/readyz")).status_code == 200:
                assert time.monotonic() < deadline, "readiness stayed 200 with a cube shard down"
                time.sleep(0.1)
            assert r.status_code == 503 and "cube does not answer" in r.json()["reason"], r.text
            assert requests.get(srv.url + "/healthz").status_code == 200  # alive, not ready
            p = requests.post(srv.url + "/v1/predict", json={"instances": [{"line": lines[0]}]}, timeout=30)
            assert p.status_code == 503 and "cube unavailable" in p.json()["error"]


def _cube_server_processes(cube_root, shards):
    """The cube-server processes serving ``cube_root`` (started by helpers_serving.cube_servers on port 0),
    in shard order."""
    import psutil

    found = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            cmd = proc.cmdline()
        except psutil.Error:
            continue
        if "cube.server" in cmd and "--data" in cmd and cmd[cmd.index("--data") + 1] == str(cube_root):
            found[int(cmd[cmd.index("--shard") + 1])] = proc
    return [found[i] for i in range(shards)]


def test_a_challenger_is_pinned_while_its_arm_exists(served, scaled, tmp_path):
    """The split's challenger version is written to cube/pins.json (what cube-transfer's GC honours) before
    it takes traffic and removed when the split ends; a version cube does not hold is refused (409)."""
    fs_root = tmp_path / "fs"
    va = publish_version(fs_root, served.a, shards=2)
    lines, probs_s = golden(scaled)
    with cube_servers(fs_root / "cube", 2, tmp_path) as urls, fileserver_in_thread(fs_root) as fs_url:
        vs = publish_version(fs_root, scaled, shards=2, make_current=False)  # after start: A stays active
        source = FileServerSource(fs_url, tmp_path / "cache", urls, token=TOKEN)
        with serving_in_thread(source, token="split-token", pin_wait=1.0) as srv:
            auth = {"Authorization": "Bearer split-token"}
            arms = [{"name": "control", "weight": 50}, {"name": "challenger", "version": vs, "weight": 50}]
            r = requests.put(srv.url + "/v1/split", json={"arms": arms}, headers=auth, timeout=60)
            assert r.status_code == 409 and "cube does not answer" in r.json()["error"], r.text  # not loaded yet
            assert _serving_pins(fs_root) == []  # a refused split leaves no pin behind
            _load_everywhere(urls, vs)  # cube holds it (prepared on every shard)
            r = requests.put(srv.url + "/v1/split", json={"arms": arms}, headers=auth, timeout=60)
            assert r.status_code == 200, r.text
            assert _serving_pins(fs_root) == [vs]
            for i in range(40):
                a = requests.post(
                    srv.url + "/v1/predict", json={"instances": [{"line": lines[i]}], "routing_key": f"k{i}"}
                ).json()
                assert (a["arm"], a["model_version"]) in {("control", va), ("challenger", vs)}
                if a["arm"] == "challenger":
                    assert abs(a["predictions"][0] - probs_s[i]) < TOL
            assert requests.delete(srv.url + "/v1/split", headers=auth).status_code == 200
            assert _serving_pins(fs_root) == []


def _serving_pins(fs_root) -> list[str]:
    """The versions cube-transfer pins (``versions``), checked against serving's own entries (``pins``)."""
    path = fs_root / "cube" / "pins.json"
    if not path.exists():
        return []
    doc = json.loads(path.read_text())
    assert doc["versions"] == sorted(p["version"] for p in doc["pins"] if p["owner"] == "serving")
    return doc["versions"]


def test_a_request_whose_version_cube_dropped_is_answered_by_the_next_one_at_once(served, scaled, tmp_path):
    """Cube rolls on past serving's active version before serving's next poll: a request pinned to the dropped
    version waits for the reload thread to switch and is answered by the new version, at once. (A batch
    worker used to reload by itself; a reload waits for every worker's predictor, its own included, so the
    request took 120 s and the load failed.)"""
    fs_root = tmp_path / "fs"
    va = publish_version(fs_root, served.a, shards=2)
    lines, probs_a = golden(served.a)
    p = np.array(probs_a[:1], np.float64)
    probs_b = 1 / (1 + np.exp(-(np.log(p / (1 - p)) + 1.5)))  # M is A with its output logit shifted by +1.5
    with cube_servers(fs_root / "cube", 2, tmp_path) as urls, fileserver_in_thread(fs_root) as fs_url:
        source = FileServerSource(fs_url, tmp_path / "cache", urls)
        with serving_in_thread(source, poll_interval=120, cache_entries=0) as srv:
            assert srv.app.active.version == va
            lookup = srv.app.active.lookup
            switch_cube_version(urls, publish_version(fs_root, scaled, shards=2, make_current=False))
            vb = publish_version(fs_root, served.miscalibrated, shards=2, make_current=False)
            switch_cube_version(urls, vb)  # cube holds the scaled version and B: A is gone
            set_current(fs_root, served.miscalibrated, vb, 2)
            t0 = time.monotonic()
            r = requests.post(srv.url + "/v1/predict", json={"instances": [{"line": lines[0]}]}, timeout=300)
            took = time.monotonic() - t0
            assert srv.app.active.version == vb
            assert srv.app.active.lookup is lookup  # one lookup (threads, connections) for every version
    assert r.status_code == 200, r.text
    assert r.json()["model_version"] == vb
    np.testing.assert_allclose(r.json()["predictions"], probs_b, rtol=0, atol=TOL)
    assert took < 10, took
