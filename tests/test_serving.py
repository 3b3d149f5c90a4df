"""Serving against passes the product trainer wrote, real cube servers and a real file server."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time

import pyarrow  # noqa: F401  (before paddle)

import numpy as np
import pytest
import requests
from helpers_common import CRITEO_FILE, CRITEO_SLOTS, PYTHON, fileserver_in_thread, free_port, process, wait_healthy
from helpers_passes import criteo_slot_lines
from helpers_serving import (
    cube_servers,
    golden,
    predict_through_switch,
    publish_version,
    serving_in_thread,
)

from elastic_control.inference.scoring import InMemoryTable, batch_from_lines, pool
from elastic_control.serving.instances import InstanceError, build_key_batch
from elastic_control.serving.versions import CubeRootSource, FileServerSource, ModelDirSource

TOL = 1e-5


@pytest.fixture(scope="module")
def models(synth_world):
    """MODEL_PATH with two passes of `elastic-control train` (full 64-bit feasigns, no SPARSE_DIM); read-only."""
    return synth_world.models


@pytest.fixture(scope="module")
def pass_a(synth_world):
    """The newest complete pass: the one a model-dir source serves."""
    return synth_world.latest


# ---- request parsing ------------------------------------------------------------------


@pytest.mark.needs_criteo
def test_key_batch_pools_like_the_shared_scoring_path():
    lines = criteo_slot_lines(0, 200) + ["1 0", "1 1 5:1 6:1 7:99"]  # an all-padding line; extra slot 99 ignored
    slots = list(range(1, 40))
    rng = np.random.default_rng(0)
    for sparse_dim in (None, 1000003):
        ref = batch_from_lines(lines, slots, sparse_dim)
        keys = np.unique(ref.keys)
        table = InMemoryTable(keys, rng.normal(size=(len(keys), 9)).astype(np.float32))
        mine = build_key_batch([{"line": ln} for ln in lines], slots, sparse_dim)
        want = pool(ref, table.lookup(ref.keys)[0])
        got = pool(mine, table.lookup(mine.keys)[0])
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_slots_form_equals_line_form():
    slots = [0, 1, 2]
    big = (1 << 64) - 5
    a = build_key_batch([{"line": f"1 0 {big}:0 7:1 8:1"}], slots, None)
    b = build_key_batch([{"slots": {"0": [str(big)], "1": [7, 8]}}], slots, None)
    assert sorted(zip(a.slot_pos, a.keys, strict=True)) == sorted(zip(b.slot_pos, b.keys, strict=True))


@pytest.mark.parametrize(
    "instances, match",
    [
        ([{}], "is empty"),
        ([{"slots": {}}], "non-empty"),
        ([{"slots": {"77": [1]}}], "unknown slot '77'"),
        ([{"slots": {"x": [1]}}], "unknown slot 'x'"),
        ([{"slots": {"0": [1.5]}}], "not an integer"),
        ([{"slots": {"0": ["12a"]}}], "not an unsigned integer"),
        ([{"slots": {"0": [True]}}], "not an integer"),
        ([{"slots": {"0": [1 << 64]}}], "outside the unsigned 64-bit range"),
        ([{"line": "1 0 abc:0"}], "integer:integer"),
        ([{"line": 5}], "must be a string"),
        (["1 0 1:0"], "expected an object"),
    ],
)
def test_bad_instances_are_named(instances, match):
    with pytest.raises(InstanceError, match=match):
        build_key_batch(instances, [0, 1], None)


# ---- no train/serve skew ------------------------------------------------------------


def test_no_skew_model_dir(models, pass_a):
    lines, probs = golden(pass_a)
    with serving_in_thread(ModelDirSource(models)) as srv:
        r = requests.post(srv.url + "/v1/predict", json={"instances": [{"line": ln} for ln in lines]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model_version"] == body["cube_version"] == pass_a.name
        np.testing.assert_allclose(body["predictions"], probs, rtol=0, atol=TOL)
        assert requests.get(srv.url + "/v1/status").json()["dense_slots"] == []  # a pass without dense slots


def test_bad_requests_get_4xx_and_serving_keeps_serving(models, pass_a):
    lines, probs = golden(pass_a)
    good = {"instances": [{"line": lines[0]}]}
    bad = [
        (b"{not json", 400, "malformed JSON"),
        (b"\xff\xfe", 400, "malformed JSON"),
        (json.dumps([1, 2]).encode(), 400, "instances"),
        (json.dumps({"instances": []}).encode(), 400, "empty"),
        (json.dumps({"instances": [{}]}).encode(), 400, "empty"),
        (json.dumps({"instances": [{"slots": {"12345": [1]}}]}).encode(), 400, "unknown slot"),
        (json.dumps({"instances": [{"slots": {"1": ["x1"]}}]}).encode(), 400, "unsigned integer"),
        (json.dumps({"instances": [{"line": "1 0 1.5.5:1"}]}).encode(), 400, "integer:integer"),
        (b'{"instances": [' + b'{"line": "1 0 1:1"},' * 500_000 + b'{"line": "1 0 1:1"}]}', 413, "exceeds"),
    ]
    with serving_in_thread(ModelDirSource(models)) as srv:
        for body, status, words in bad:
            r = requests.post(srv.url + "/v1/predict", data=body, headers={"Content-Type": "application/json"})
            assert r.status_code == status, (body[:60], r.text)
            assert words in r.json()["error"]
            ok = requests.post(srv.url + "/v1/predict", json=good)
            assert ok.status_code == 200 and abs(ok.json()["predictions"][0] - probs[0]) < TOL
        assert requests.get(srv.url + "/v1/predict").status_code == 405
        assert requests.get(srv.url + "/nope").status_code == 404
        metrics = requests.get(srv.url + "/metrics").text
        assert 'serving_requests_total{code="400"} 8' in metrics
        assert "serving_request_seconds_bucket" in metrics


def test_concurrent_requests_are_merged_and_each_gets_its_own_rows(models, pass_a):
    lines, probs = golden(pass_a)
    results = {}

    def client(i):
        s = requests.Session()
        for k in range(10):
            j = (i * 10 + k) % (len(lines) - 4)
            r = s.post(srv.url + "/v1/predict", json={"instances": [{"line": ln} for ln in lines[j : j + 4]]})
            results[(i, k)] = (j, r.status_code, r.json())

    with serving_in_thread(ModelDirSource(models), workers=1) as srv:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = requests.get(srv.url + "/v1/status").json()["metrics"]
    assert len(results) == 80
    for j, status, body in results.values():
        assert status == 200
        np.testing.assert_allclose(body["predictions"], probs[j : j + 4], rtol=0, atol=TOL)
    assert stats["batches"] < stats["requests"]["200"]  # concurrent requests were merged


def test_requests_read_in_one_pass_of_the_loop_are_one_batch(models, pass_a):
    """The requests the event loop reads in one pass are queued together (one lock, one wake-up),
    so an idle worker wakes to all of them instead of to the first one (a batch per request, and a wake-up
    per request that cost more than decoding its JSON)."""
    lines, probs = golden(pass_a)
    n = 12
    bodies = [json.dumps({"instances": [{"line": ln} for ln in lines[2 * i : 2 * i + 2]]}).encode() for i in range(n)]
    with serving_in_thread(ModelDirSource(models), workers=2) as srv:
        before = requests.get(srv.url + "/v1/status").json()["metrics"]["batches"]
        queued = []  # the sizes of what the HTTP frontend hands the batcher
        submit_many = srv.app.batcher.submit_many
        srv.app.batcher.submit_many = lambda jobs: (queued.append(len(jobs)), submit_many(jobs))[1]
        socks = [socket.create_connection(("127.0.0.1", srv.port), timeout=30) for _ in range(n)]
        time.sleep(0.3)  # every connection accepted, idle
        paused = threading.Event()
        srv.http.loop.call_soon_threadsafe(lambda: (paused.set(), time.sleep(0.5)))  # the loop is busy meanwhile
        assert paused.wait(10)
        for s, body in zip(socks, bodies, strict=True):
            s.sendall(
                b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
        replies = []
        for s in socks:
            with s:
                replies.append(b"".join(iter(lambda s=s: s.recv(65536), b"")))
        after = requests.get(srv.url + "/v1/status").json()["metrics"]["batches"]
    for i, reply in enumerate(replies):
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), reply[:200]
        np.testing.assert_allclose(json.loads(body)["predictions"], probs[2 * i : 2 * i + 2], rtol=0, atol=TOL)
    assert queued == [n], queued
    assert after - before == 1, f"{n} requests read in one pass of the loop took {after - before} batches"


def test_after_response_hook_sees_each_scored_batch(models, pass_a):
    """The shadow-scoring hook: called after the answer with the batch, its version and probabilities."""
    lines, probs = golden(pass_a)
    seen = []
    with serving_in_thread(ModelDirSource(models)) as srv:
        srv.app.add_after_response_hook(seen.append)
        srv.app.add_after_response_hook(lambda scored: 1 / 0)  # a failing hook never reaches the client
        r = requests.post(srv.url + "/v1/predict", json={"instances": [{"line": ln} for ln in lines[:5]]})
        assert r.status_code == 200
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
    (scored,) = seen
    assert scored.version == pass_a.name and scored.batch.n == 5
    assert [i["line"] for i in scored.instances] == lines[:5]
    np.testing.assert_allclose(scored.probabilities, probs[:5], rtol=0, atol=TOL)


def test_a_version_that_cannot_load_is_reported(tmp_path, pass_a):
    fs_root = tmp_path / "fs"
    publish_version(fs_root, pass_a, shards=2)  # two shards, but serving is told of one cube server
    with serving_in_thread(
        CubeRootSource(fs_root / "cube", [f"http://127.0.0.1:{free_port()}"]), wait_ready=False
    ) as srv:
        deadline = time.monotonic() + 30
        while srv.app.last_reload_error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        r = requests.post(srv.url + "/v1/predict", json={"instances": [{"line": "1 0 1:1"}]})
        assert r.status_code == 503 and "2 shards but serving knows 1 cube servers" in r.json()["error"]
        assert requests.get(srv.url + "/v1/status").json()["metrics"]["reload_failures"] >= 1


def test_not_ready_is_503_with_a_reason(tmp_path):
    with serving_in_thread(ModelDirSource(tmp_path), wait_ready=False) as srv:
        r = requests.post(srv.url + "/v1/predict", json={"instances": [{"line": "1 0 1:1"}]})
        assert r.status_code == 503 and "no model version is active yet" in r.json()["error"]
        assert requests.get(srv.url + "/healthz").json()["ready"] is False
        assert requests.get(srv.url + "/readyz").status_code == 503


def test_cube_unreachable_is_a_quick_503(tmp_path, pass_a):
    fs_root = tmp_path / "fs"
    publish_version(fs_root, pass_a, shards=2)
    dead = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    lines, _ = golden(pass_a)
    # Not ready (readiness asks cube, which is down): wait for the model alone, not the 60 s readiness limit.
    with serving_in_thread(CubeRootSource(fs_root / "cube", dead, lookup_timeout=1.0), wait_ready=False) as srv:
        deadline = time.monotonic() + 60
        while srv.app.active is None and time.monotonic() < deadline:
            time.sleep(0.05)
        t0 = time.monotonic()
        r = requests.post(srv.url + "/v1/predict", json={"instances": [{"line": lines[0]}]}, timeout=30)
        assert r.status_code == 503 and "cube unavailable" in r.json()["error"]
        assert time.monotonic() - t0 < 10
        assert requests.get(srv.url + "/healthz").status_code == 200
        assert "serving_cube_errors_total 1" in requests.get(srv.url + "/metrics").text


@pytest.mark.e2e
@pytest.mark.needs_criteo
def test_no_skew_through_cube_servers_file_server_and_client(tmp_path, criteo_world):
    """The whole serving path as processes: file server -> serving process -> 2 cube-server processes, on a pass
    the product trainer wrote from real Criteo lines (39 slots, keys through SPARSE_DIM)."""
    pass_a = criteo_world.latest
    assert json.loads((pass_a / "meta.json").read_text())["sparse_dim"] == criteo_world.sparse_dim
    fs_root = tmp_path / "fs"
    publish_version(fs_root, pass_a, shards=2)
    lines, probs = golden(pass_a)
    (tmp_path / "golden.txt").write_text("\n".join(lines) + "\n")
    with cube_servers(fs_root / "cube", 2, tmp_path) as urls, fileserver_in_thread(fs_root) as fs_url:
        port = free_port()
        with process(
            [
                PYTHON,
                "-m",
                "elastic_control",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--fileserver",
                fs_url,
                "--cube-servers",
                ",".join(urls),
                "--cache-dir",
                str(tmp_path / "cache"),
                "--grpc-port",
                "0",  # never the fixed default 8011: the machine is shared
            ],
            log_path=tmp_path / "serving.log",
        ) as proc:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, proc)
            deadline = time.monotonic() + 60
            while not requests.get(url + "/healthz").json()["ready"]:
                assert time.monotonic() < deadline, (tmp_path / "serving.log").read_text()[-2000:]
                time.sleep(0.1)
            out = subprocess.run(
                [
                    PYTHON,
                    "-m",
                    "client",
                    "predict",
                    str(tmp_path / "golden.txt"),
                    "--serving",
                    url,
                    "--batch-size",
                    "32",
                ],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert out.returncode == 0, out.stderr
            got = [float(x) for x in out.stdout.split()]
            assert len(got) == len(lines)
            np.testing.assert_allclose(got, probs, rtol=0, atol=TOL)
            status = requests.get(url + "/v1/status").json()
            assert status["model_version"] == status["cube_version"] == pass_a.name


@pytest.mark.e2e
def test_version_switch_under_continuous_requests(tmp_path, synth_world):
    """Roll out the next hour's pass (differently trained weights) while 4 clients keep predicting."""
    first, second = synth_world.passes[:2]
    _switch_under_load(tmp_path, first, second)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.needs_criteo
def test_version_switch_to_other_slots_and_sparse_dim_under_continuous_requests(tmp_path, synth_world, criteo_world):
    """Roll out a pass with other slots and SPARSE_DIM (Criteo, 39 slots) over a synthetic one (4 slots)."""
    _switch_under_load(tmp_path, synth_world.latest, criteo_world.latest)


def _switch_under_load(tmp_path, pass_a, pass_b):
    """No error, each answer's model and cube versions match, and B's answers equal B's golden probabilities."""
    fs_root = tmp_path / "fs"
    va = publish_version(fs_root, pass_a, shards=2)
    lines_a, probs_a = golden(pass_a)
    lines_b, probs_b = golden(pass_b)
    with cube_servers(fs_root / "cube", 2, tmp_path) as urls, fileserver_in_thread(fs_root) as fs_url:
        source = FileServerSource(fs_url, tmp_path / "cache", urls)
        with serving_in_thread(source, poll_interval=0.1) as srv:
            assert srv.app.active.version == va
            vb, answers, errors = predict_through_switch(srv, lines_b, fs_root, urls, pass_b, start=lambda i, k: i)
    assert errors == []
    seen = {a["model_version"] for _, a in answers}
    assert seen == {va, vb}
    for i, a in answers:
        assert a["model_version"] == a["cube_version"]
        if a["model_version"] == vb:  # B's golden lines scored by B: B's training-time probabilities
            np.testing.assert_allclose(a["predictions"], probs_b[i : i + 8], rtol=0, atol=TOL)


@pytest.mark.e2e
def test_client_survives_serving_restart_without_losing_lines(tmp_path, models, pass_a):
    """Kill serving mid-stream and start it again: every line gets exactly one prediction, in order."""
    lines, probs = golden(pass_a)
    lines, probs = lines[:100] * 10, probs[:100] * 10  # 1000 lines, 125 requests: enough to span a restart
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    port = free_port()
    serve = [
        PYTHON,
        "-m",
        "elastic_control",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model-dir",
        str(models),
        "--grpc-port",
        "0",  # never the fixed default 8011: the machine is shared
    ]
    url = f"http://127.0.0.1:{port}"
    with process(serve, log_path=tmp_path / "s1.log") as first:
        wait_healthy(url, first)
        with open(tmp_path / "out.txt", "w") as out:
            client = subprocess.Popen(
                [
                    PYTHON,
                    "-m",
                    "client",
                    "predict",
                    str(tmp_path / "in.txt"),
                    "--serving",
                    url,
                    "--batch-size",
                    "8",
                    "--retry-for",
                    "120",
                    # the world's lines carry a slot the pass was not trained on (training ignores it): this
                    # test is about the restart, not about refusing such lines
                    "--unknown-slots",
                    "warn",
                ],
                stdout=out,
                stderr=subprocess.PIPE,
                text=True,
            )
            deadline = time.monotonic() + 60
            while (tmp_path / "out.txt").stat().st_size == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            first.kill()
            first.wait()
    time.sleep(0.5)
    with process(serve, log_path=tmp_path / "s2.log") as second:
        wait_healthy(url, second)
        _, err = client.communicate(timeout=180)
    assert client.returncode == 0, err
    got = [float(x) for x in (tmp_path / "out.txt").read_text().split()]
    assert len(got) == len(lines)
    np.testing.assert_allclose(got, probs, rtol=0, atol=TOL)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.needs_criteo
def test_no_skew_on_a_pass_from_the_product_pipeline(tmp_path):
    """`elastic-control data criteo` + `elastic-control train` (1 pserver, 1 trainer) on 20k real Criteo lines,
    then cube servers + file server + serving: serving reproduces golden.jsonl within 1e-5."""
    with open(CRITEO_FILE, encoding="utf-8") as f:
        (tmp_path / "raw.txt").write_text("".join(next(f) for _ in range(20000)))
    (tmp_path / "slot.conf").write_text("\n".join(map(str, CRITEO_SLOTS)) + "\n")
    (tmp_path / "data.config").write_text(
        f"export START_DATE_HR=20200101/00\nexport END_DATE_HR=20200101/00\n"
        f'export DATASET_PATH="{tmp_path / "data"}"\nexport MODEL_PATH="{tmp_path / "models"}"\n'
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL_PATH", "MLFLOW_TRACKING_URI")}
    for cmd in (
        [
            "data",
            "criteo",
            "--input",
            str(tmp_path / "raw.txt"),
            "--output",
            str(tmp_path / "data"),
            "--hours",
            "1",
            "--start",
            "20200101/00",
        ],
        [
            "train",
            "-f",
            str(tmp_path / "data.config"),
            "-s",
            str(tmp_path / "slot.conf"),
            "-t",
            "1",
            "-p",
            "1",
            "--timeout",
            "600",
        ],
    ):
        out = subprocess.run(
            [PYTHON, "-m", "elastic_control", *cmd], capture_output=True, text=True, env=env, timeout=900
        )
        assert out.returncode == 0, out.stderr[-3000:]
    pass_dir = tmp_path / "models" / "pass-20200101-00"
    lines, probs = golden(pass_dir)
    assert np.std(probs) > 1e-4, "the pass must not be a constant predictor, or the comparison proves nothing"
    fs_root = tmp_path / "fs"
    publish_version(fs_root, pass_dir, shards=2)
    with cube_servers(fs_root / "cube", 2, tmp_path) as urls, fileserver_in_thread(fs_root) as fs_url:
        with serving_in_thread(FileServerSource(fs_url, tmp_path / "cache", urls)) as srv:
            r = requests.post(srv.url + "/v1/predict", json={"instances": [{"line": ln} for ln in lines]})
            assert r.status_code == 200, r.text
            np.testing.assert_allclose(r.json()["predictions"], probs, rtol=0, atol=TOL)
