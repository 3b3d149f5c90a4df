"""The container image, built once per test run: its tag, podman's environment for this host, and a
`podman run` with the pods' restricted security context (tests/test_image.py, the pod harness's
image runtime through the ``image`` fixture in conftest.py)."""

from __future__ import annotations

import configparser
import fcntl
import os
import shutil
import subprocess
import tempfile
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "scripts" / "build-image.sh"
UID = 10001


def _version() -> str:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    return cfg["metadata"]["version"]


class Image:
    """The built image and a `podman run` with the pods' restricted security context."""

    def __init__(self, tag: str, env: dict):
        self.tag = tag
        self.env = env

    def podman(self, *args: str, timeout: float = 120, check: bool = False) -> subprocess.CompletedProcess:
        # Not in the checkout: conmon writes a file named ``oom`` into its working folder when the kernel
        # OOM-kills a container on a cgroup v1 host.
        res = subprocess.run(
            ["podman", *args], env=self.env, capture_output=True, text=True, timeout=timeout, cwd=tempfile.gettempdir()
        )
        if check and res.returncode != 0:
            raise AssertionError(f"podman {' '.join(args[:3])} ... exited {res.returncode}: {res.stderr[-3000:]}")
        return res

    def run_args(self, *, volumes=(), memory: str | None = None, workdir: str | None = None, env=None) -> list[str]:
        args = [
            "run", "--rm",
            "--user", f"{UID}:{UID}",
            "--read-only", "--read-only-tmpfs=false", "--tmpfs", "/tmp:rw,nosuid,nodev,size=256m,mode=1777",
            "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
            "--network", "none",
        ]  # fmt: skip
        if shutil.which("runc"):
            args += ["--runtime", "runc"]
        for host, target in volumes:
            args += ["--volume", f"{host}:{target}:rw"]
        if memory:
            args += ["--memory", memory, "--memory-swap", memory]
        if workdir:
            args += ["--workdir", workdir]
        for k, v in (env or {}).items():
            args += ["--env", f"{k}={v}"]
        return args

    def run(self, *command: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
        return self.podman(*self.run_args(**kw), self.tag, *command, timeout=timeout)

    def python(self, code: str, *, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
        return self.run("python", "-c", textwrap.dedent(code), timeout=timeout, **kw)


def build_image() -> Image:
    """Build ``elastic-ctr:VERSION`` with scripts/build-image.sh (podman must be there)."""
    env = dict(os.environ)
    conf = subprocess.run(["bash", str(BUILD), "--containers-conf"], capture_output=True, text=True, check=True)
    env["CONTAINERS_CONF"] = conf.stdout.strip()
    tag = f"elastic-ctr:{_version()}"
    # One build at a time on this machine (two test runs in one checkout would both build).
    lock_path = Path(env["CONTAINERS_CONF"]).with_name("build.lock")
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        res = subprocess.run(["bash", str(BUILD), "--tag", tag], env=env, capture_output=True, text=True, timeout=2400)
    assert res.returncode == 0, f"scripts/build-image.sh failed:\n{res.stdout[-2000:]}\n{res.stderr[-6000:]}"
    return Image(tag, env)
