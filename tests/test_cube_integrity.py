"""Cube under damage, against real processes: damaged, truncated and overwritten shard
files, prepares that must not touch served files, URLs the agent must not fetch, unread answers, bad JSON."""

from __future__ import annotations

import contextlib
import hashlib
import json
import socket
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import requests
from helpers_cube import (
    TOKEN,
    add_done,
    agent_args,
    cube_process,
    fileserver,
    free_port,
    server_args,
    write_synthetic_pass,
)

from cube.client import CubeClient
from cube.rollout import RetryPolicy
from cube.transfer import Transfer, TransferConfig

pytestmark = pytest.mark.e2e
AUTH = {"Authorization": f"Bearer {TOKEN}"}
KEYS = np.unique(np.random.default_rng(11).integers(1, 2**64 - 1, 4000, dtype=np.uint64))
V1, V2 = "pass-20240101-00", "pass-20240101-01"


class OneShard:
    """A file server, one cube-server (restartable on its port) and its agent, fed by a real Transfer."""

    def __init__(self, root: Path, stack: contextlib.ExitStack):
        self.root, self.stack = root, stack
        (root / "models").mkdir()
        self.data = root / "shard-0"
        self.data.mkdir()
        self.fs_url = stack.enter_context(fileserver(root / "fileserver"))
        self.port = free_port()
        self.server_url = f"http://127.0.0.1:{self.port}"
        self._server = None
        self.start_server()
        self.agent_url, _ = stack.enter_context(
            cube_process("agent", agent_args(self.data, 0, self.server_url, self.fs_url), root, "agent-0")
        )

    def start_server(self, name: str = "server-0") -> psutil.Process:
        self._server = contextlib.ExitStack()
        _, proc = self._server.enter_context(
            cube_process("server", server_args(self.data, 0, port=self.port), self.root, name)
        )
        self.stack.callback(self._server.close)
        self.server_proc = psutil.Process(proc.pid)
        return self.server_proc

    def restart_server(self, name: str) -> psutil.Process:
        self._server.close()
        return self.start_server(name)

    def roll_out(self, name: str, value: float) -> None:
        write_synthetic_pass(self.root / "models" / name, KEYS, np.full((len(KEYS), 4), value, np.float32))
        add_done(self.root / "models", name)
        t = Transfer(
            TransferConfig(
                model_path=self.root / "models",
                cube_root=self.root / "built",
                fileserver_url=self.fs_url,
                agents=[self.agent_url],
                token=TOKEN,
                retry=RetryPolicy(attempts=2, backoff=0.1, timeout=20),
            )
        )
        assert t.poll_once() == name, t.last_error

    def status(self) -> dict:
        return requests.get(f"{self.server_url}/v1/status", timeout=5).json()

    def values(self, version: str | None = None) -> np.ndarray:
        with CubeClient([self.server_url]) as c:
            v, found, got = c.lookup(KEYS, version)
        assert found.all() and (version is None or got == version)
        return v


@pytest.fixture
def shard(tmp_path):
    with contextlib.ExitStack() as stack:
        yield OneShard(tmp_path, stack)


def _shard_file(shard: OneShard, version: str) -> Path:
    return shard.data / version / "shard-0.arrow"


def test_a_prepare_with_a_wrong_sha256_never_deletes_a_file_the_server_holds(shard):
    shard.roll_out(V1, 1.0)
    live = _shard_file(shard, V1)
    before = live.read_bytes()
    url = f"{shard.fs_url}/files/cube/{V1}/shard-0.arrow"
    wrong = {"version": V1, "url": url, "sha256": "0" * 64, "size": len(before)}
    r = requests.post(f"{shard.agent_url}/v1/prepare", json=wrong, headers=AUTH, timeout=30)
    assert r.status_code == 409 and r.json()["refused"] is True, r.text
    assert live.read_bytes() == before  # a refused prepare must never unlink a file being served
    # A refused prepare of a new version leaves no folder (and no staging copy) behind.
    r = requests.post(
        f"{shard.agent_url}/v1/prepare", json={**wrong, "version": "pass-20990101-00"}, headers=AUTH, timeout=30
    )
    assert r.status_code == 422 and "sha256" in r.json()["error"]
    assert not (shard.data / "pass-20990101-00").exists()
    assert not any((shard.data / ".agent-staging").iterdir())
    # ... and the next restart still comes back serving the version.
    shard.restart_server("server-again")
    assert shard.status()["active"] == V1 and np.all(shard.values() == 1.0)


def test_a_truncated_previous_version_neither_kills_the_server_nor_takes_the_active_one_down(shard):
    shard.roll_out(V1, 1.0)
    shard.roll_out(V2, 2.0)
    st = shard.status()
    assert (st["active"], st["previous"]) == (V2, V1)
    old = _shard_file(shard, V1)
    with open(old, "r+b") as f:  # truncated in place, under the running server
        f.truncate(old.stat().st_size // 2)
    # A mapped file truncated like this would make the lookup die of SIGBUS; the server serves its own copy.
    r = requests.post(f"{shard.server_url}/v1/lookup?version={V1}", data=KEYS[:100].tobytes(), timeout=5)
    assert r.status_code == 200 and np.all(np.frombuffer(r.content[: 100 * 16], np.float32) == 1.0)
    assert np.all(shard.values(V1) == 1.0)
    proc = shard.restart_server("server-after-truncation")
    st = shard.status()
    assert st["active"] == V2 and st["previous"] is None and V1 in st["dropped"] and "size" in st["dropped"][V1]
    assert np.all(shard.values() == 2.0)
    assert requests.get(f"{shard.server_url}/readyz", timeout=5).status_code == 200
    r = requests.post(f"{shard.server_url}/v1/lookup?version={V1}", data=KEYS[:3].tobytes(), timeout=5)
    assert r.status_code == 404
    assert proc.is_running()


def _overwrite_middle(path: Path) -> None:
    with open(path, "r+b") as f:  # in place: same inode, same size
        f.seek(path.stat().st_size // 2)
        f.write(b"\xff" * 4096)


def test_values_overwritten_in_place_are_never_served_and_a_re_prepare_heals_the_file(shard):
    shard.roll_out(V1, 1.0)
    live = _shard_file(shard, V1)
    _overwrite_middle(live)
    assert np.all(shard.values() == 1.0)  # the running server serves its verified copy
    # Re-preparing the version downloads a good copy (same sha256) and the server reloads it.
    manifest = json.loads((shard.root / "built" / V1 / "manifest.json").read_text())["files"]["shard-0.arrow"]
    good = {"version": V1, "url": f"{shard.fs_url}/files/cube/{V1}/shard-0.arrow", **manifest}
    r = requests.post(f"{shard.agent_url}/v1/prepare", json=good, headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["downloaded"] == [V1], r.text
    assert hashlib.sha256(live.read_bytes()).hexdigest() == manifest["sha256"]
    # Damaged again, then restarted: the load refuses the file (sha256), the server is not ready,
    # and its agent re-seeds the published version from the file server.
    _overwrite_middle(live)
    shard.restart_server("server-after-corruption")
    st = shard.status()
    assert V1 in st["dropped"] and "sha256" in st["dropped"][V1]
    deadline = time.monotonic() + 30
    while requests.get(f"{shard.server_url}/readyz", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, requests.get(f"{shard.agent_url}/v1/status", timeout=5).text
        time.sleep(0.2)
    assert np.all(shard.values() == 1.0)
    assert hashlib.sha256(live.read_bytes()).hexdigest() == manifest["sha256"]


def test_the_agent_fetches_only_under_the_file_servers_cube_folder(shard):
    shard.roll_out(V1, 1.0)
    entry = json.loads((shard.root / "built" / V1 / "manifest.json").read_text())["files"]["shard-0.arrow"]
    fs, new = shard.fs_url, "pass-20240101-05"
    requests.put(f"{fs}/files/config/secret.txt", data=b"password", headers=AUTH, timeout=5).raise_for_status()
    for url in (
        f"{shard.server_url}/v1/status",  # another loopback port
        f"{fs}/files/config/secret.txt",
        f"{fs}/files/cube/../config/secret.txt",
        f"{fs}/files/cube/%2e%2e/config/secret.txt",
        f"{fs}/files/cube/{V1}/shard-0.arrow?x=1",
        f"{fs}/healthz",
        f"{fs.replace('127.0.0.1', 'localhost')}/files/cube/{V1}/shard-0.arrow",
        "file:///etc/passwd",
    ):
        body = {"version": new, "url": url, "sha256": entry["sha256"], "size": entry["size"]}
        r = requests.post(f"{shard.agent_url}/v1/prepare", json=body, headers=AUTH, timeout=10)
        assert r.status_code == 400 and "refused to fetch" in r.json()["error"], (url, r.text)
    # A chain path outside cube/VERSION/ is refused too.
    chain = [{"version": new, "kind": "base", "path": "config/", "files": {"shard-0.arrow": entry}}]
    r = requests.post(f"{shard.agent_url}/v1/prepare", json={"version": new, "chain": chain}, headers=AUTH, timeout=10)
    assert r.status_code == 400 and "'path'" in r.json()["error"]
    # Errors reveal nothing of what was fetched: not even a prefix of its digest.
    r = requests.post(
        f"{shard.agent_url}/v1/prepare",
        json={"version": new, "url": f"{fs}/files/cube/{V1}/shard-0.arrow", "sha256": "1" * 64},
        headers=AUTH,
        timeout=10,
    )
    assert r.status_code == 422 and entry["sha256"][:6] not in r.text and "sha256" in r.json()["error"]
    assert not (shard.data / new).exists()


def test_unread_answers_do_not_pile_up_in_server_memory(shard):
    shard.roll_out(V1, 1.0)
    proc = shard.server_proc
    base = proc.memory_info().rss
    keys = np.random.default_rng(0).integers(0, 2**64 - 1, 1_000_000, dtype=np.uint64).tobytes()
    req = f"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nContent-Length: {len(keys)}\r\n\r\n".encode() + keys
    hog = socket.socket()
    hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)  # before connect: a small window
    hog.connect(("127.0.0.1", shard.port))
    sent = []

    def send_all():  # blocks once the server stops reading
        with contextlib.suppress(OSError):
            for _ in range(12):  # 12 x 1M keys: 12 x 16 MB of answers at dim 4, never read
                hog.sendall(req)
                sent.append(1)

    sender = threading.Thread(target=send_all, daemon=True)
    sender.start()
    peak, deadline = 0, time.monotonic() + 6
    while time.monotonic() < deadline:
        peak = max(peak, proc.memory_info().rss - base)
        time.sleep(0.05)
    assert np.all(shard.values() == 1.0)  # others are served meanwhile
    assert peak < 80 << 20, f"server grew by {peak >> 20} MB with {len(sent)} lookups sent and never read"
    hog.settimeout(10)
    got = 0
    with contextlib.suppress(OSError):
        while got < 2 * 16_000_000 and (chunk := hog.recv(1 << 20)):
            got += len(chunk)  # reading resumes the server, which answers what it took
    hog.close()
    assert got >= 2 * 16_000_000 and proc.is_running()


def test_json_lookup_never_coerces_and_control_calls_always_answer(shard):
    shard.roll_out(V1, 1.0)
    url = shard.server_url
    for bad in (-1, 1.9, True, 2**64, None, [1], {"k": 1}, "-1", "1.9", "0x10", " 7", "\u0661\u0662", str(2**64), ""):
        r = requests.post(f"{url}/v1/lookup", json={"keys": [int(KEYS[0]), bad]}, timeout=5)
        assert r.status_code == 400 and "keys[1]" in r.json()["error"], (bad, r.text)
    for body in ({"keys": "123"}, {"keys": 5}, [1, 2], {}):
        assert requests.post(f"{url}/v1/lookup", json=body, timeout=5).status_code == 400, body
    r = requests.post(f"{url}/v1/lookup", json={"keys": [0, 2**64 - 1, int(KEYS[0]), str(KEYS[0])]}, timeout=5)
    assert r.status_code == 200 and r.json()["found"] == [False, False, True, True]
    deep = b"[" * 100_000 + b"]" * 100_000
    r = requests.post(f"{url}/v1/lookup", data=b'{"keys": ' + deep + b"}", headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    # Control calls: bad bodies get a 400 at once (never a hang); a big one a 413.
    deep = b"[" * 5000 + b"]" * 5000
    for raw in (b"\xff\xfe{", b'{"version": "v", "path": "a\\u0000b"}', deep, b"[]", b'{"version": 5}', b"{"):
        for endpoint in ("load", "activate", "unpin"):
            r = requests.post(f"{url}/v1/{endpoint}", data=raw, headers=AUTH, timeout=5)
            assert r.status_code == 400, (endpoint, raw[:20], r.status_code, r.text)
    for raw in (b"\xff\xfe{", deep, b"[]", b'{"version": 5}', b"{"):  # the agent's control calls too
        for endpoint in ("prepare", "activate", "unpin"):
            r = requests.post(f"{shard.agent_url}/v1/{endpoint}", data=raw, headers=AUTH, timeout=5)
            assert r.status_code == 400, (endpoint, raw[:20], r.status_code, r.text)
    r = requests.post(f"{url}/v1/load", data=b"[" * 100_000, headers=AUTH, timeout=5)
    assert r.status_code == 413
    r = requests.post(f"{url}/v1/load", data=b"\xff", timeout=5)
    assert r.status_code == 401  # the token first
    r = requests.post(f"{url}/v1/load", json={"version": V1, "path": f"{V1}/missing.arrow"}, headers=AUTH, timeout=5)
    assert r.status_code == 422
    assert np.all(shard.values() == 1.0)


def test_readiness_means_an_active_version_is_loaded(tmp_path):
    data = tmp_path / "empty"
    data.mkdir()
    with contextlib.ExitStack() as stack:
        fs_url = stack.enter_context(fileserver(tmp_path / "fs"))
        url, _ = stack.enter_context(cube_process("server", server_args(data, 0), tmp_path, "server-empty"))
        agent_url, _ = stack.enter_context(
            cube_process("agent", agent_args(data, 0, url, fs_url), tmp_path, "agent-empty")
        )
        assert requests.get(f"{url}/healthz", timeout=5).status_code == 200  # alive...
        r = requests.get(f"{url}/readyz", timeout=5)
        assert r.status_code == 503 and "no active version" in r.json()["reason"]  # ... but cannot answer
        st = requests.get(f"{url}/v1/status", timeout=5).json()
        assert st["ready"] is False and st["active"] is None
        r = requests.get(f"{agent_url}/readyz", timeout=5)
        assert r.status_code == 503 and "no active version" in r.json()["reason"]
        assert requests.get(f"{agent_url}/healthz", timeout=5).status_code == 200
