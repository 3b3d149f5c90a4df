"""Readiness means "can answer": started with their manifests' commands and probed as the manifests
say, a cube shard and serving with nothing loaded are not ready (their Services route nothing to
them), while their liveness probes pass (they are not restarted for it)."""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers_common import free_port
from helpers_kube import render_plan

from elastic_control.kube.render import load_manifests

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def containers(tmp_path_factory):
    _, manifests = render_plan(tmp_path_factory.mktemp("readiness") / "state", cube_shards=1)
    out = {}
    for doc in load_manifests(manifests):
        if doc["kind"] == "Deployment":
            for c in doc["spec"]["template"]["spec"]["containers"]:
                out[c["name"]] = c
    return out


def probe(container: dict, kind: str, port: int) -> int:
    """The status of ``container``'s ``kind`` probe (its path, on the port it names) against a local process."""
    spec = container[kind]["httpGet"]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert spec["port"] in named  # the probe names a port the container declares
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("GET", spec["path"], headers={"User-Agent": "kube-probe/1.33"})
    return conn.getresponse().status


def run(argv: list[str], env: dict, port: int) -> subprocess.Popen:
    proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 90
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"{argv[0]} did not listen on {port}") from None
            time.sleep(0.2)


def replaced(command: list[str], **flags) -> list[str]:
    argv = [str(Path(sys.executable).parent / command[0]), *command[1:]]
    for flag, value in flags.items():
        flag = "--" + flag.replace("_", "-")
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    return argv


def test_a_cube_shard_with_nothing_loaded_is_not_ready(containers, tmp_path):
    server, agent = containers["cube-server"], containers["cube-agent"]
    server_port, agent_port = free_port(), free_port()
    data = tmp_path / "cube"
    data.mkdir()
    env = {"ELASTIC_CTR_TOKEN": "t"}
    procs = [
        run(replaced(server["command"], port=str(server_port), data=str(data), host="127.0.0.1"), env, server_port)
    ]
    try:
        agent_env = {
            **env,
            "ELASTIC_CTR_CUBE_SHARD": "0",
            "ELASTIC_CTR_CUBE_ROOT": str(data),
            "ELASTIC_CTR_CUBE_SERVER_URL": f"http://127.0.0.1:{server_port}",
            "ELASTIC_CTR_FILESERVER_URL": f"http://127.0.0.1:{free_port()}",  # nothing there: nothing to re-seed
        }
        argv = replaced(agent["command"], port=str(agent_port), host="127.0.0.1")
        procs.append(run(argv, agent_env, agent_port))
        assert probe(server, "livenessProbe", server_port) == 200  # alive: not restarted for being empty
        assert probe(server, "readinessProbe", server_port) == 503  # but not ready: nothing loaded
        assert probe(agent, "readinessProbe", agent_port) == 503
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(20)


def test_serving_without_a_model_is_not_ready(containers):
    serving = containers["serving"]
    port = free_port()
    env = {
        "ELASTIC_CTR_CUBE_SERVERS": f"http://127.0.0.1:{free_port()}",
        "ELASTIC_CTR_FILESERVER_URL": f"http://127.0.0.1:{free_port()}",
    }
    proc = run(replaced(serving["command"], port=str(port), host="127.0.0.1"), env, port)
    try:
        assert probe(serving, "livenessProbe", port) == 200
        assert probe(serving, "readinessProbe", port) == 503
    finally:
        proc.terminate()
        proc.wait(30)
