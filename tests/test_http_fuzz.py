"""Fuzz every server (file server, cube-server, cube-agent, cube-transfer, serving) as a real process.

Seeded and bounded (tests/helpers_http_fuzz.py): a few seconds per server in
the default run, a minute each with ``-m slow``. Every answer must be a
well-formed HTTP/1.1 response with no 5xx, the server must keep answering a
good request, and its resident memory must stay bounded.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import requests
from helpers_cube import TOKEN, agent_args, cube_process, server_args, write_synthetic_pass
from helpers_http import chunked, request
from helpers_http_fuzz import Target, fuzz
from helpers_serving import PYTHON, free_port, process, wait_healthy

from cube.builder import build_version

pytestmark = pytest.mark.e2e
AUTH = {"Authorization": f"Bearer {TOKEN}"}
VERSION = "pass-20240101-00"
DIM = 4
SECONDS = [pytest.param(4.0, id="quick"), pytest.param(60.0, id="long", marks=pytest.mark.slow)]


def _alive(proc):
    return lambda: proc.poll() is None


@pytest.fixture(scope="module")
def cube_stack(tmp_path_factory):
    """cube-server (one version), its agent, cube-transfer, and the file server they use."""
    tmp = tmp_path_factory.mktemp("http-fuzz-cube")
    keys = np.arange(1, 3001, dtype=np.uint64) * np.uint64(104729)
    values = (np.arange(len(keys) * DIM, dtype=np.float32) / 7).reshape(-1, DIM)
    p = write_synthetic_pass(tmp / "passes" / VERSION, keys, values)
    build_version(pass_dir=p, shards=1, output=tmp / "cube")
    (tmp / "files" / "cube").mkdir(parents=True)
    (tmp / "files" / "cube" / "good.bin").write_bytes(b"good" * 1000)
    (tmp / "files" / "config").mkdir()
    (tmp / "files" / "config" / "slot.conf").write_text("1\n2\n")
    (tmp / "models").mkdir()
    fs_port = free_port()
    fs_args = ["--root", str(tmp / "files"), "--host", "127.0.0.1", "--port", str(fs_port), "--max-bytes", str(2 << 20)]
    with (
        process(
            [PYTHON, "-m", "elastic_control", "fileserver", *fs_args], {"ELASTIC_CTR_TOKEN": TOKEN}, tmp / "fs.log"
        ) as fs,
        cube_process("server", server_args(tmp / "cube", 0, extra=["--max-batch", "20000"]), tmp, "server") as server,
    ):
        fs_url = f"http://127.0.0.1:{fs_port}"
        with cube_process("agent", agent_args(tmp / "agent-data", 0, server[0]), tmp, "agent") as agent:
            transfer_args = [
                *("--model-path", str(tmp / "models"), "--cube-root", str(tmp / "transfer-cube")),
                *("--fileserver", fs_url, "--agents", agent[0], "--port", "0", "--host", "127.0.0.1"),
                *("--poll-interval", "60", "--timeout", "5", "--retries", "1"),
            ]
            with cube_process("transfer", transfer_args, tmp, "transfer") as transfer:
                wait_healthy(fs_url, fs)
                yield {
                    "tmp": tmp,
                    "keys": keys,
                    "values": values,
                    "fileserver": (fs_url, fs),
                    "cube": server,
                    "agent": agent,
                    "transfer": transfer,
                }


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@pytest.mark.parametrize("seconds", SECONDS)
def test_fuzz_fileserver(cube_stack, seconds):
    url, proc = cube_stack["fileserver"]
    good = b"good" * 1000

    def check_good():
        r = requests.get(f"{url}/files/cube/good.bin", timeout=10)
        assert r.status_code == 200 and r.content == good, r.status_code
        assert requests.put(f"{url}/files/fuzz/ok.bin", data=b"ok", headers=AUTH, timeout=10).status_code == 201
        assert requests.get(f"{url}/files/fuzz/ok.bin", headers=AUTH, timeout=10).content == b"ok"

    body = bytes(range(256)) * 40
    seeds = [
        request("GET", "/files/cube/good.bin"),
        request("HEAD", "/files/cube/good.bin"),
        request("GET", "/files/cube/"),
        request("GET", "/files/config/slot.conf", AUTH),
        request("GET", "/files/", AUTH),
        request("GET", "/healthz"),
        request("PUT", "/files/fuzz/a.bin", AUTH, body),
        request("PUT", "/files/fuzz/b.bin", {**AUTH, "Transfer-Encoding": "chunked"}, chunked(body, 999), length=False),
        request("PUT", "/files/fuzz/c.bin", {**AUTH, "Expect": "100-continue"}, body),
        request("PUT", "/files/fuzz/d.bin", {**AUTH, "X-Content-Sha256": "0" * 64}, b"x"),
        request("DELETE", "/files/fuzz/a.bin", AUTH),
        request("DELETE", "/files/fuzz/nothing", AUTH),
        request("PUT", "/files/fuzz/e.bin", {}, body),
    ]
    target = Target("file server", _port(url), proc.pid, seeds, check_good, TOKEN, alive=_alive(proc))
    report = fuzz(target, seed=1501, seconds=seconds)
    print(report.summary())
    assert (cube_stack["tmp"] / "files" / "cube" / "good.bin").read_bytes() == good
    assert list((cube_stack["tmp"] / "files" / ".fileserver-staging").iterdir()) == []


@pytest.mark.parametrize("seconds", SECONDS)
def test_fuzz_cube_server(cube_stack, seconds):
    url, proc = cube_stack["cube"]
    keys, values = cube_stack["keys"], cube_stack["values"]
    probe = np.array([keys[0], keys[-1], 5], dtype="<u8")

    def check_good():
        r = requests.post(f"{url}/v1/lookup", data=probe.tobytes(), timeout=10)
        assert r.status_code == 200 and r.headers["X-Cube-Version"] == VERSION, r.status_code
        got = np.frombuffer(r.content, "<f4", count=3 * DIM).reshape(3, DIM)
        np.testing.assert_array_equal(got[:2], values[[0, -1]])
        assert not got[2].any() and r.content[-1] == 0b011

    lookup = np.resize(keys, 200).astype("<u8").tobytes()
    seeds = [
        request("POST", "/v1/lookup", {"Content-Type": "application/octet-stream"}, lookup),
        request("POST", "/v1/lookup", {}, lookup[:80]) * 3,
        request("POST", f"/v1/lookup?version={VERSION}", {}, lookup[:16]),
        request("POST", "/v1/lookup", {"Transfer-Encoding": "chunked"}, chunked(lookup, 100), length=False),
        request("POST", "/v1/lookup", {"Content-Type": "application/json"}, json.dumps({"keys": [1, "2"]}).encode()),
        request("GET", "/healthz"),
        request("GET", "/v1/status"),
        request("GET", "/metrics"),
        request("POST", "/v1/activate", {**AUTH, "Content-Type": "application/json"}, b'{"version": "ghost"}'),
        request("POST", "/v1/load", {**AUTH, "Content-Type": "application/json"}, b'{"version": "ghost"}'),
        request("POST", "/v1/activate", {}, b'{"version": "ghost"}'),
    ]
    target = Target("cube-server", _port(url), proc.pid, seeds, check_good, TOKEN, alive=_alive(proc))
    print(fuzz(target, seed=1502, seconds=seconds).summary())


@pytest.mark.parametrize("seconds", SECONDS)
def test_fuzz_cube_agent(cube_stack, seconds):
    url, proc = cube_stack["agent"]

    def check_good():
        assert requests.get(f"{url}/healthz", timeout=10).json()["shard"] == 0
        assert requests.get(f"{url}/v1/status", timeout=10).json()["server"]["active"] == VERSION

    closed = f"http://127.0.0.1:{free_port()}/files/cube/{VERSION}/shard-0.arrow"
    prepare = json.dumps({"version": "pass-20990101-00", "url": closed, "sha256": "0" * 64}).encode()
    seeds = [
        request("GET", "/healthz"),
        request("GET", "/v1/status"),
        request("POST", "/v1/prepare", {**AUTH, "Content-Type": "application/json"}, prepare),
        request("POST", "/v1/prepare", {"Content-Type": "application/json"}, prepare),
        request("POST", "/v1/activate", {**AUTH, "Content-Type": "application/json"}, b'{"version": "ghost"}'),
        request("POST", "/v1/activate", AUTH, b'{"version": 5}'),
    ]
    # 502: a prepare whose download cannot be fetched (a downstream failure, not the caller's mistake)
    target = Target("cube-agent", _port(url), proc.pid, seeds, check_good, TOKEN, frozenset({502}), alive=_alive(proc))
    print(fuzz(target, seed=1503, seconds=seconds).summary())
    assert requests.get(f"{url}/v1/status", timeout=10).json()["server"]["active"] == VERSION


@pytest.mark.parametrize("seconds", SECONDS)
def test_fuzz_cube_transfer(cube_stack, seconds):
    url, proc = cube_stack["transfer"]

    def check_good():
        assert requests.get(f"{url}/healthz", timeout=10).json()["status"] == "ok"
        assert requests.get(f"{url}/v1/status", timeout=10).json()["active"] is None

    seeds = [
        request("GET", "/healthz"),
        request("GET", "/v1/status"),
        request("GET", "/v1/shards"),
        request("POST", "/v1/poll", AUTH),
        request("POST", "/v1/poll", {**AUTH, "Content-Type": "application/json"}, b"{}"),
        request("POST", "/v1/poll", {}, b"{}"),
    ]
    target = Target("cube-transfer", _port(url), proc.pid, seeds, check_good, TOKEN, alive=_alive(proc))
    print(fuzz(target, seed=1504, seconds=seconds).summary())


@pytest.fixture(scope="module")
def serving(tmp_path_factory, synth_world):
    """serving on the session's passes of the product trainer, from their (read-only) model folder."""
    from helpers_serving import golden

    tmp = tmp_path_factory.mktemp("http-fuzz-serving")
    port = free_port()
    args = [PYTHON, "-m", "elastic_control", "serve", "--model-dir", str(synth_world.models), "--host", "127.0.0.1"]
    with process([*args, "--port", str(port)], {}, tmp / "serving.log") as proc:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        yield url, proc, golden(synth_world.latest)[0][:5]


@pytest.mark.parametrize("seconds", SECONDS)
def test_fuzz_serving(serving, seconds):
    url, proc, lines = serving
    body = json.dumps({"instances": [{"line": ln} for ln in lines]}).encode()

    def check_good():
        r = requests.post(f"{url}/v1/predict", data=body, timeout=30)
        assert r.status_code == 200, r.text
        p = r.json()["predictions"]
        assert len(p) == len(lines) and all(0 < x < 1 for x in p)

    check_good_ready = check_good
    for _ in range(100):  # the model loads after start-up
        try:
            check_good_ready()
            break
        except AssertionError:
            import time

            time.sleep(0.3)
    slots = json.dumps({"instances": [{"slots": {"1": [1, "2"], "4": [18446744073709551615]}}]}).encode()
    seeds = [
        request("POST", "/v1/predict", {"Content-Type": "application/json"}, body),
        request("POST", "/v1/predict", {}, slots),
        request("POST", "/v1/predict", {"Transfer-Encoding": "chunked"}, chunked(body, 300), length=False),
        request("GET", "/healthz"),
        request("GET", "/readyz"),
        request("GET", "/metrics"),
        request("GET", "/v1/status"),
    ]
    target = Target("serving", _port(url), proc.pid, seeds, check_good, None, alive=_alive(proc), rss_growth_mb=96)
    print(fuzz(target, seed=1505, seconds=seconds).summary())
