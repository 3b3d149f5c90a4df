"""cube-agent: fetches shard files for its cube-server and tells it to load and switch.

Runs beside one cube-server and shares its data folder. ``POST /v1/prepare
{version, url, sha256, size?}`` downloads the shard into ``DATA/VERSION/``
(a partial file, verified for size and sha256, then renamed), and has the
server load it WITHOUT activating it; ``POST /v1/activate {version}`` switches
the server. A download that is corrupt or truncated is deleted and refused,
and the server keeps serving what it served. Both calls need the token.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import click
import requests

from ctr_foundation import env_vars, names
from ctr_foundation.atomic import atomic_write_json
from ctr_foundation.cli_runner import run_cli
from ctr_foundation.errors import ComponentError, UsageError
from ctr_foundation.http_json import JsonRoute, make_json_server, require_str
from cube.control_client import ControlCallError, call_json
from cube.shard_format import MANIFEST, CorruptShardError, open_shard, sha256_file, shard_file_name

DEFAULT_PORT = names.CUBE_AGENT_PORT
CHUNK = 1 << 20
log = logging.getLogger("cube.agent")


class Agent:
    def __init__(
        self,
        *,
        shard: int,
        data_dir: str | os.PathLike,
        server_url: str,
        token: str | None,
        keep: int = 3,
        timeout: float = 120.0,
    ):
        self.shard, self.data_dir = shard, Path(data_dir)
        self.server_url = server_url.rstrip("/")
        self.token, self.keep, self.timeout = token, keep, timeout
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # one prepare/activate at a time
        self.last: dict = {}

    def _shard_path(self, version: str) -> Path:
        if not version or "/" in version or version.startswith("."):
            raise UsageError(f"version {version!r} is not a valid name")
        return self.data_dir / version / shard_file_name(self.shard)

    def download(self, url: str, dest: Path, sha256: str, size: int | None) -> None:
        """Stream ``url`` to ``dest`` via a partial file; refuse (and delete) it unless size and sha256 match."""
        part = dest.with_name(f".{dest.name}.part")
        dest.parent.mkdir(parents=True, exist_ok=True)
        h, got = hashlib.sha256(), 0
        try:
            with requests.get(url, stream=True, timeout=self.timeout) as r:
                if r.status_code != 200:
                    raise ComponentError(f"download {url}: HTTP {r.status_code}")
                with open(part, "wb") as f:
                    for chunk in r.iter_content(CHUNK):
                        h.update(chunk)
                        f.write(chunk)
                        got += len(chunk)
                    f.flush()
                    os.fsync(f.fileno())
            if size is not None and got != size:
                raise CorruptShardError(f"download {url}: {got} bytes, expected {size} (truncated?)")
            if h.hexdigest() != sha256:
                raise CorruptShardError(
                    f"download {url}: sha256 {h.hexdigest()[:16]}... does not match the expected {sha256[:16]}..."
                )
            os.replace(part, dest)
        except requests.RequestException as e:
            raise ComponentError(f"download {url} failed: {type(e).__name__}: {e}") from e
        finally:
            part.unlink(missing_ok=True)

    def prepare(self, body: dict) -> tuple[int, dict]:
        version, url, sha = require_str(body, "version"), require_str(body, "url"), require_str(body, "sha256")
        size = body.get("size")
        if size is not None and (not isinstance(size, int) or size < 0):
            raise UsageError("field 'size' must be a non-negative integer")
        dest = self._shard_path(version)
        t0 = time.time()
        with self._lock:
            cached = dest.exists() and (size is None or dest.stat().st_size == size) and sha256_file(dest) == sha
            try:
                if not cached:
                    self.download(url, dest, sha, size)
                mapped = open_shard(dest)  # structure, version and shard checks before the server sees it
                if mapped.version != version or mapped.shard != self.shard:
                    raise CorruptShardError(
                        f"{url} holds version {mapped.version!r} shard {mapped.shard}, "
                        f"expected {version!r} shard {self.shard}"
                    )
            except CorruptShardError as e:
                dest.unlink(missing_ok=True)
                return 422, {"error": str(e), "refused": True}
            atomic_write_json(
                dest.parent / MANIFEST,
                {
                    "version": version,
                    "shards": mapped.shards,
                    "dim": mapped.dim,
                    "rows": mapped.rows,
                    "files": {
                        dest.name: {
                            "shard": self.shard,
                            "rows": mapped.rows,
                            "size": dest.stat().st_size,
                            "sha256": sha,
                        }
                    },
                    "local_copy_of": url,
                },
            )
            del mapped
            server = call_json(
                "POST",
                f"{self.server_url}/v1/load",
                {"version": version, "path": f"{version}/{dest.name}"},
                token=self.token,
                timeout=self.timeout,
            )
        self.last = {"prepared": version, "seconds": round(time.time() - t0, 3), "downloaded": not cached}
        return 200, {
            "version": version,
            "shard": self.shard,
            "status": "prepared",
            "downloaded": not cached,
            "server": server,
        }

    def activate(self, body: dict) -> tuple[int, dict]:
        version = require_str(body, "version")
        with self._lock:
            server = call_json(
                "POST", f"{self.server_url}/v1/activate", {"version": version}, token=self.token, timeout=self.timeout
            )
            self._gc(held={server.get("active"), server.get("prepared"), server.get("previous")})
        return 200, {"version": version, "shard": self.shard, "status": "active", "server": server}

    def _gc(self, held: set) -> None:
        """Keep the newest ``keep`` local versions plus whatever the server holds."""
        versions = sorted(p.name for p in self.data_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
        for name in versions[: -self.keep] if self.keep else versions:
            if name not in held:
                shutil.rmtree(self.data_dir / name, ignore_errors=True)

    def status(self, _body: dict) -> tuple[int, dict]:
        try:
            server = call_json("GET", f"{self.server_url}/v1/status", timeout=5)
        except ControlCallError as e:
            server = {"error": str(e)}
        local = sorted(p.name for p in self.data_dir.iterdir() if (p / shard_file_name(self.shard)).exists())
        return 200, {
            "shard": self.shard,
            "server_url": self.server_url,
            "data": str(self.data_dir),
            "local_versions": local,
            "last": self.last,
            "server": server,
        }

    def routes(self) -> dict:
        return {
            ("POST", "/v1/prepare"): JsonRoute(self.prepare, write=True),
            ("POST", "/v1/activate"): JsonRoute(self.activate, write=True),
            ("GET", "/v1/status"): JsonRoute(self.status),
            ("GET", "/healthz"): JsonRoute(lambda _b: (200, {"status": "ok", "shard": self.shard})),
        }


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--port",
    type=int,
    default=lambda: env_vars.CUBE_AGENT_PORT.get(),
    show_default=str(DEFAULT_PORT),
    help="TCP port, 0: any free port [env ELASTIC_CTR_CUBE_AGENT_PORT].",
)
@click.option("--host", default="0.0.0.0", show_default=True, help="Address to bind.")
@click.option(
    "--shard",
    type=int,
    default=lambda: env_vars.CUBE_SHARD.get(),
    help="The shard index of the server beside this agent [env ELASTIC_CTR_CUBE_SHARD].",
)
@click.option(
    "--data",
    default=lambda: env_vars.CUBE_ROOT.get(),
    help="Local folder for shard files, the server's --data [env ELASTIC_CTR_CUBE_ROOT].",
)
@click.option(
    "--server",
    "server_url",
    default=lambda: env_vars.CUBE_SERVER_URL.get() or f"http://127.0.0.1:{names.CUBE_SERVER_PORT}",
    show_default=f"http://127.0.0.1:{names.CUBE_SERVER_PORT}",
    help="URL of the cube-server beside this agent [env ELASTIC_CTR_CUBE_SERVER_URL].",
)
@click.option("--keep", type=int, default=3, show_default=True, help="Local versions to keep.")
@click.option("--timeout", type=float, default=120.0, show_default=True, help="Seconds for a download or server call.")
@click.option("--ready-file", default=None, help="Write {port, pid} here (JSON) once listening.")
def agent_command(port, host, shard, data, server_url, keep, timeout, ready_file):
    """Download, verify and load shard versions for the cube-server beside this agent."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s cube-agent %(message)s")
    if shard is None or data is None:
        raise UsageError("--shard and --data are required (or ELASTIC_CTR_CUBE_SHARD and ELASTIC_CTR_CUBE_ROOT)")
    if keep < 1:
        raise UsageError(f"--keep {keep} must be >= 1")
    agent = Agent(
        shard=shard, data_dir=data, server_url=server_url, token=env_vars.TOKEN.get(), keep=keep, timeout=timeout
    )
    try:
        server = make_json_server(host=host, port=port, routes=agent.routes(), token=agent.token, name="cube-agent")
    except OSError as e:
        raise ComponentError(f"cube-agent cannot listen on {host}:{port}: {e.strerror}") from e
    real_port = server.server_address[1]
    if ready_file:
        atomic_write_json(ready_file, {"port": real_port, "pid": os.getpid()})
    print(f"cube-agent: shard {shard} on http://{host}:{real_port}, server {server_url}", flush=True)
    try:
        server.serve_forever(handle_signals=True)
    finally:
        server.server_close()


def main(argv: list[str] | None = None) -> None:
    run_cli(agent_command, "cube-agent", argv)


if __name__ == "__main__":
    main()
