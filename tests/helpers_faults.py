"""The fault suite's pipeline: every component a real process that a test can kill -9, SIGSTOP and restart.

The file server (`elastic-control fileserver`), N cube-server + cube-agent pairs and cube-transfer,
each started by helpers_cube / helpers_common on a port fixed at first start (a restart comes back on
it, as under the supervisor), fed synthetic passes whose values say which pass they are, so any
answer can be compared with the table exactly.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import requests
from helpers_common import PYTHON, free_port, process, wait_healthy, wait_until
from helpers_cube import TOKEN, add_done, agent_args, cube_process, server_args, write_synthetic_pass

from cube.client import CubeClient, CubeUnavailableError

__all__ = ["AUTH", "Pipeline", "tmpfs"]

AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Component:
    """One restartable process; ``url`` stays the same across restarts."""

    def __init__(self, name: str, start):
        self.name, self._start = name, start
        self.stack: contextlib.ExitStack | None = None
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.restarts = 0

    def start(self) -> Component:
        self.stack = contextlib.ExitStack()
        self.url, self.proc = self._start(self.stack, f"{self.name}-{self.restarts}")
        self.restarts += 1
        return self

    def stop(self) -> None:
        if self.stack:
            self.stack.close()
            self.stack = None

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.stop()

    def restart(self) -> Component:
        self.stop()
        return self.start()

    @contextlib.contextmanager
    def stopped(self):
        """SIGSTOP for the block, then SIGCONT."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.proc.pid, signal.SIGCONT)


class Pipeline:
    """fileserver + ``shards`` x (cube-server, cube-agent) + cube-transfer, as processes under ``root``."""

    def __init__(self, root: Path, keys: np.ndarray, *, shards: int = 2, data_dirs: list[Path] | None = None):
        self.root, self.keys, self.shards = root, keys, shards
        self.models = root / "models"
        self.models.mkdir(parents=True, exist_ok=True)
        self.fs_root = root / "fileserver"
        self.data = data_dirs or [root / f"shard-{i}" for i in range(shards)]
        for d in self.data:
            d.mkdir(parents=True, exist_ok=True)
        self.values: dict[str, float] = {}  # pass -> the value every embedding of it has
        self.hour = 0
        fs_port, transfer_port = free_port(), free_port()
        self.server_ports = [free_port() for _ in range(shards)]
        self.agent_ports = [free_port() for _ in range(shards)]
        self.fileserver = Component("fileserver", self._fileserver(fs_port))
        self.servers = [Component(f"server-{i}", self._cube("server", i)) for i in range(shards)]
        self.agents = [Component(f"agent-{i}", self._cube("agent", i)) for i in range(shards)]
        self.transfer = Component("transfer", self._transfer(transfer_port))
        self.components = [self.fileserver, *self.servers, *self.agents, self.transfer]

    # ---- processes ----
    def _fileserver(self, port: int):
        def start(stack, name):
            argv = [PYTHON, "-m", "elastic_control", "fileserver", "--root", self.fs_root, "--host", "127.0.0.1"]
            env = {"ELASTIC_CTR_TOKEN": TOKEN}
            proc = stack.enter_context(process([*argv, "--port", port], env, self.root / f"{name}.log"))
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, proc)
            return url, proc

        return start

    def _cube(self, kind: str, i: int):
        def start(stack, name):
            if kind == "server":
                args = server_args(self.data[i], i, port=self.server_ports[i])
            else:
                server = f"http://127.0.0.1:{self.server_ports[i]}"
                args = agent_args(self.data[i], i, server, self.fileserver.url, port=self.agent_ports[i])
            return stack.enter_context(cube_process(kind, args, self.root, name))

        return start

    def _transfer(self, port: int):
        def start(stack, name):
            args = ["--model-path", self.models, "--cube-root", self.root / "built", "--fileserver"]
            args += [self.fileserver.url, "--agents", ",".join(f"http://127.0.0.1:{p}" for p in self.agent_ports)]
            args += ["--poll-interval", "0.3", "--timeout", "5", "--retries", "2", "--port", port]
            args += ["--host", "127.0.0.1", "--keep", "3"]
            return stack.enter_context(cube_process("transfer", [str(a) for a in args], self.root, name))

        return start

    def start(self) -> Pipeline:
        for c in self.components:
            c.start()
        return self

    def close(self) -> None:
        for c in reversed(self.components):
            with contextlib.suppress(Exception):
                c.stop()

    # ---- passes and rollouts ----
    def add_pass(self, value: float, *, done: bool = True) -> str:
        name = f"pass-20240101-{self.hour:02d}"
        self.hour += 1
        n = len(self.keys)
        write_synthetic_pass(self.models / name, self.keys, np.full((n, 4), value, np.float32))
        self.values[name] = value
        if done:
            add_done(self.models, name)
            with contextlib.suppress(requests.RequestException):
                requests.post(f"{self.transfer.url}/v1/poll", headers=AUTH, timeout=5)
        return name

    def server_status(self, i: int) -> dict:
        return requests.get(f"{self.servers[i].url}/v1/status", timeout=5).json()

    def actives(self) -> list[str | None]:
        out = []
        for i in range(self.shards):
            try:
                out.append(self.server_status(i)["active"])
            except (requests.RequestException, ValueError):
                out.append("<no answer>")
        return out

    def wait_active(self, version: str, timeout: float = 60) -> None:
        wait_until(lambda: self.actives() == [version] * self.shards, timeout, 0.2, f"every shard on {version}")

    def transfer_status(self) -> dict:
        return requests.get(f"{self.transfer.url}/v1/status", timeout=5).json()

    def roll_out(self, value: float, timeout: float = 60) -> str:
        name = self.add_pass(value)
        self.wait_active(name, timeout)
        return name

    # ---- answers ----
    def check_exact(self, version: str | None = None, *, keys: np.ndarray | None = None) -> str:
        """Look every key up through the product client; they must all be found with their pass's exact value."""
        keys = self.keys if keys is None else keys
        with CubeClient([s.url for s in self.servers], timeout=5) as c:
            values, found, got = c.lookup(keys, version)
        assert found.all(), f"{int((~found).sum())} keys not found in {got}"
        assert np.all(values == self.values[got]), f"{got} answered values other than {self.values[got]}"
        assert version is None or got == version
        return got

    def answer_or_clear_error(self, version: str | None = None, timeout: float = 3) -> str:
        """'exact <version>' or 'error: ...' (a CubeUnavailableError); never anything else."""
        try:
            with CubeClient([s.url for s in self.servers], timeout=timeout) as c:
                values, found, got = c.lookup(self.keys, version)
        except CubeUnavailableError as e:
            return f"error: {e}"
        assert found.all() and np.all(values == self.values[got]), f"corrupt answer from {got}"
        return f"exact {got}"


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A tmpfs of ``size`` mounted at ``path`` (root only), always unmounted at the end."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        for _ in range(20):
            if subprocess.run(["umount", str(path)], capture_output=True).returncode == 0:
                break
            time.sleep(0.25)
        else:
            subprocess.run(["umount", "-l", str(path)], check=False)
