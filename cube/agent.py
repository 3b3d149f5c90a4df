"""cube-agent: fetches shard files for its cube-server, tells it to load and switch, and re-seeds it.

Runs beside one cube-server and shares its data folder. ``POST /v1/prepare``
names a version and the chain of files that builds it (cube/shard_fetch.py):
the agent downloads what the shard lacks (only the delta when the server holds
the parent), checks it in a staging folder, installs it into ``DATA/VERSION/``,
and has the server load it WITHOUT activating it; ``POST /v1/activate {version}``
switches the server. A download that is corrupt or truncated is refused and
the server keeps serving what it served. Both calls need the token.

Re-seeding: at start and then every ``--reseed-interval`` seconds, the agent
reads the file server's ``cube/current.json`` (and ``cube/pins.json``); when
its server does not hold the active version (a restarted pod with an empty
folder, or a server that dropped a damaged file), it prepares and activates
it from ``cube/VERSION/chain.json`` (the base and the deltas since), and loads
the pinned versions it lacks. ``/readyz`` is 200 only when the server can answer
with the version the cluster serves.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import click

from ctr_foundation import env_vars, names
from ctr_foundation.atomic import atomic_write_json
from ctr_foundation.cli_runner import run_cli
from ctr_foundation.errors import ComponentError, ElasticControlError, UsageError
from ctr_foundation.fileserver_client import FileServerClient, NotFound
from ctr_foundation.http_json import JsonRoute, make_json_server, require_str
from cube.control_client import ControlCallError, call_json
from cube.shard_fetch import (
    LocalStore,
    PrepareRefused,
    UrlPolicy,
    VersionConflict,
    chain_from_manifest,
    parse_chain,
    parse_prepare,
)
from cube.shard_format import valid_version_name

DEFAULT_PORT = names.CUBE_AGENT_PORT
PINS_FILE = f"{names.CUBE_PREFIX}/pins.json"
log = logging.getLogger("cube.agent")


class Agent:
    def __init__(
        self,
        *,
        shard: int,
        data_dir: str | os.PathLike,
        server_url: str,
        token: str | None,
        fileserver_url: str | None = None,
        keep: int = 3,
        timeout: float = 120.0,
        reseed_interval: float = 5.0,
    ):
        self.shard, self.data_dir = shard, Path(data_dir)
        self.server_url = server_url.rstrip("/")
        self.token, self.keep, self.timeout = token, keep, timeout
        self.reseed_interval = reseed_interval
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.policy = UrlPolicy(fileserver_url)
        self.fs = (
            FileServerClient(fileserver_url, token=token or "", timeout=min(timeout, 30)) if fileserver_url else None
        )
        self.store = LocalStore(self.data_dir, shard, timeout)
        self.store.clear_staging()  # left over from a crash mid-download
        self._lock = threading.RLock()  # one prepare/activate (or re-seed) at a time
        self._stop = threading.Event()
        self.last: dict = {}
        self.seed = {"state": "not started", "current": None, "at": None, "error": None, "result": None}

    # ---- the server ------------------------------------------------------------------------

    def _server(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        return call_json(method, f"{self.server_url}{path}", body, token=self.token, timeout=timeout or self.timeout)

    def _held(self) -> set[str]:
        """Versions the server has loaded right now (ControlCallError if it does not answer)."""
        return set(self._server("GET", "/v1/status", timeout=10).get("versions") or {})

    # ---- prepare / activate ---------------------------------------------------------------

    def prepare(self, body: dict) -> tuple[int, dict]:
        version, chain, pin = parse_prepare(body, self.shard, self.policy)
        t0 = time.time()
        try:
            with self._lock:
                result = self._prepare(version, chain, pin)
        except VersionConflict as e:
            return 409, {"error": str(e), "refused": True}
        except PrepareRefused as e:
            return 422, {"error": str(e), "refused": True}
        except ControlCallError as e:
            return _server_refusal(e)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            # A full disk or quota: the install cleaned up after itself; say so (507), not "internal error".
            free = shutil.disk_usage(self.data_dir).free
            why = f"no space left on device for {version} in {self.data_dir} ({free} bytes free): {e.strerror}"
            log.error("prepare of %s on shard %d failed: %s", version, self.shard, why)
            return 507, {"error": f"shard {self.shard}: {why}", "refused": False}
        self.last = {"prepared": version, "seconds": round(time.time() - t0, 3), **result}
        return 200, {"version": version, "shard": self.shard, "status": "prepared", **result}

    def _prepare(self, version: str, chain: list, pin: bool) -> dict:
        """Install what the chain needs beyond what the server holds and the disk has; load ``version``."""
        held = self._held()
        needed = []
        for item in reversed(chain):  # newest first: stop at the first version already usable
            state = self.store.state_of(item)
            if item.version in held:
                if state == "different":
                    local = self.store.manifest(item.version) or {}
                    if local.get("kind", "base") == item.kind:
                        raise VersionConflict(
                            f"version {item.version!r} is loaded on shard {self.shard} with other content "
                            "(its sha256 differs); a version never changes, so nothing was downloaded"
                        )
                    break  # another representation (e.g. a compacted base) of what the server holds
                if state != "same":
                    needed.append(item)  # heal a damaged or missing local copy (same content)
                break
            if state != "same":
                needed.append(item)
        downloaded, nbytes = [], 0
        t0 = time.monotonic()
        for item in reversed(needed):  # oldest first
            nbytes += self.store.install(item)
            downloaded.append(item.version)
        t1 = time.monotonic()
        server = self._server("POST", "/v1/load", {"version": version, "pin": pin})
        timings = {"install_s": round(t1 - t0, 3), "load_s": round(time.monotonic() - t1, 3)}
        return {"downloaded": downloaded, "downloaded_bytes": nbytes, "timings": timings, "server": server}

    def activate(self, body: dict) -> tuple[int, dict]:
        return self._switch("activate", require_str(body, "version"), "active")

    def unpin(self, body: dict) -> tuple[int, dict]:
        return self._switch("unpin", require_str(body, "version"), "unpinned")

    def _switch(self, call: str, version: str, status: str) -> tuple[int, dict]:
        try:
            with self._lock:
                server = self._server("POST", f"/v1/{call}", {"version": version})
                self._gc(server)
        except ControlCallError as e:
            return _server_refusal(e)
        return 200, {"version": version, "shard": self.shard, "status": status, "server": server}

    def _gc(self, server: dict) -> None:
        """Keep the newest ``keep`` local versions, everything the server holds, and their ancestors."""
        protect = set(server.get("versions") or {})
        for r in ("active", "prepared", "previous"):
            if server.get(r):
                protect.add(server[r])
        protect.update(server.get("pinned") or ())
        for version in list(protect):
            seen = 0
            parent = self.store.parent_of(version)
            while parent and parent not in protect and seen < 10_000:
                protect.add(parent)
                parent, seen = self.store.parent_of(parent), seen + 1
        local = self.store.versions()
        for name in local[: -self.keep] if self.keep else local:
            if name not in protect:
                self.store.remove(name)

    # ---- re-seeding ---------------------------------------------------------------------------

    def _chain_of(self, version: str) -> list:
        try:
            doc = self.fs.get_json(f"{names.CUBE_PREFIX}/{version}/chain.json")
            raw = doc.get("chain") if isinstance(doc, dict) else None
        except NotFound:
            raw = chain_from_manifest(self.fs.get_json(f"{names.CUBE_PREFIX}/{version}/manifest.json"), version)
        return parse_chain(raw, self.shard, self.policy, version)

    def _published(self) -> tuple[str | None, list[str]]:
        try:
            current = self.fs.get_json(names.REMOTE_CURRENT)
        except NotFound:
            return None, []
        version = current.get("version") if isinstance(current, dict) else None
        if not valid_version_name(version):
            raise ComponentError(f"{names.REMOTE_CURRENT} on the file server names no valid version")
        try:
            pins = self.fs.get_json(PINS_FILE)
            pinned = [v for v in (pins.get("versions") or []) if valid_version_name(v)]
        except NotFound:
            pinned = []
        return version, pinned

    def seed_once(self) -> str:
        """Bring the server to the published active version (and pins) if it lacks them; say what happened."""
        if self.fs is None:
            self.seed.update(state="off", result="no file server configured")
            return "off"
        self.seed["state"] = "checking"
        version, pinned = self._published()
        self.seed["current"] = version
        if version is None:
            self.seed.update(state="idle", result="nothing published yet", error=None, at=time.time())
            return "nothing published"
        with self._lock:
            held = self._held()
            did = []
            if version not in held:
                self.seed["state"] = "seeding"
                t0 = time.time()
                got = self._prepare(version, self._chain_of(version), pin=False)
                server = self._server("POST", "/v1/activate", {"version": version})
                self._gc(server)
                self.last = {
                    "seeded": version,
                    "seconds": round(time.time() - t0, 3),
                    "downloaded": got["downloaded"],
                    "downloaded_bytes": got["downloaded_bytes"],
                }
                did.append(f"activated {version} (downloaded {got['downloaded_bytes']} bytes)")
                log.info(
                    "shard %d re-seeded with %s: downloaded %s", self.shard, version, got["downloaded"] or "nothing"
                )
            for pin in pinned:
                if pin not in held and pin != version:
                    self._prepare(pin, self._chain_of(pin), pin=True)
                    did.append(f"pinned {pin}")
        result = "; ".join(did) or f"server holds {version}"
        self.seed.update(state="idle", result=result, error=None, at=time.time())
        return result

    def seed_forever(self) -> None:
        while not self._stop.is_set():
            try:
                self.seed_once()
            except (ElasticControlError, OSError, ValueError) as e:
                if str(e) != self.seed.get("error"):  # say it once, not every interval
                    log.warning("re-seed of shard %d: %s (retrying every %.0fs)", self.shard, e, self.reseed_interval)
                self.seed.update(state="retrying", error=str(e), at=time.time())
            self._stop.wait(self.reseed_interval)

    def stop(self) -> None:
        self._stop.set()

    # ---- reads ------------------------------------------------------------------------------

    def readiness(self, _body=None) -> tuple[int, dict]:
        """200 when the server answers with the version the cluster serves (or the one it has, before
        anything is published); 503 with the reason otherwise."""
        try:
            server = self._server("GET", "/v1/status", timeout=5)
        except ControlCallError as e:
            return 503, {"ready": False, "reason": f"cube-server unreachable: {e}"}
        current = self.seed.get("current")
        if not server.get("active"):
            return 503, {"ready": False, "reason": "the cube-server has no active version", "seed": self.seed}
        if current and current not in (server.get("versions") or {}):
            return 503, {"ready": False, "reason": f"the cube-server does not hold {current} yet", "seed": self.seed}
        return 200, {"ready": True, "active": server["active"], "current": current}

    def status(self, _body: dict) -> tuple[int, dict]:
        try:
            server = self._server("GET", "/v1/status", timeout=5)
        except ControlCallError as e:
            server = {"error": str(e)}
        return 200, {
            "shard": self.shard,
            "server_url": self.server_url,
            "fileserver": self.policy.base,
            "data": str(self.data_dir),
            "local_versions": self.store.versions(),
            "last": self.last,
            "seed": self.seed,
            "server": server,
        }

    def routes(self) -> dict:
        return {
            ("POST", "/v1/prepare"): JsonRoute(self.prepare, write=True),
            ("POST", "/v1/activate"): JsonRoute(self.activate, write=True),
            ("POST", "/v1/unpin"): JsonRoute(self.unpin, write=True),
            ("GET", "/v1/status"): JsonRoute(self.status),
            ("GET", "/readyz"): JsonRoute(self.readiness),
            ("GET", "/healthz"): JsonRoute(lambda _b: (200, {"status": "ok", "shard": self.shard})),
        }


def _server_refusal(e: ControlCallError) -> tuple[int, dict]:
    """The server's own 4xx (a corrupt file, an unknown version) passed on as it is; else 502."""
    if e.status is not None and 400 <= e.status < 500:
        return e.status, {"error": str(e), "refused": True}
    return 502, {"error": str(e)}


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
@click.option(
    "--fileserver",
    default=lambda: env_vars.FILESERVER_URL.get(),
    help="The file server: the only place shard files are fetched from (its cube/ folder), and where "
    "re-seeding reads cube/current.json [env ELASTIC_CTR_FILESERVER_URL].",
)
@click.option("--keep", type=int, default=3, show_default=True, help="Local versions to keep.")
@click.option("--timeout", type=float, default=120.0, show_default=True, help="Seconds for a download or server call.")
@click.option(
    "--reseed-interval",
    type=float,
    default=5.0,
    show_default=True,
    help="Seconds between checks that the server holds the published version (0: only at start).",
)
@click.option("--ready-file", default=None, help="Write {port, pid} here (JSON) once listening.")
def agent_command(port, host, shard, data, server_url, fileserver, keep, timeout, reseed_interval, ready_file):
    """Download, verify and load shard versions for the cube-server beside this agent."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s cube-agent %(message)s")
    if shard is None or data is None:
        raise UsageError("--shard and --data are required (or ELASTIC_CTR_CUBE_SHARD and ELASTIC_CTR_CUBE_ROOT)")
    if keep < 1:
        raise UsageError(f"--keep {keep} must be >= 1")
    if reseed_interval < 0:
        raise UsageError(f"--reseed-interval {reseed_interval} must be >= 0")
    agent = Agent(
        shard=shard,
        data_dir=data,
        server_url=server_url,
        token=env_vars.TOKEN.get(),
        fileserver_url=fileserver,
        keep=keep,
        timeout=timeout,
        reseed_interval=reseed_interval or 1e9,
    )
    if not fileserver:
        print("cube-agent: warning: no --fileserver: prepares are refused and nothing is re-seeded", flush=True)
    try:
        server = make_json_server(host=host, port=port, routes=agent.routes(), token=agent.token, name="cube-agent")
    except OSError as e:
        raise ComponentError(f"cube-agent cannot listen on {host}:{port}: {e.strerror}") from e
    real_port = server.server_address[1]
    threading.Thread(target=agent.seed_forever, name="cube-agent-seed", daemon=True).start()
    if ready_file:
        atomic_write_json(ready_file, {"port": real_port, "pid": os.getpid()})
    print(f"cube-agent: shard {shard} on http://{host}:{real_port}, server {server_url}", flush=True)
    try:
        server.serve_forever(handle_signals=True)
    finally:
        agent.stop()
        server.server_close()


def main(argv: list[str] | None = None) -> None:
    run_cli(agent_command, "cube-agent", argv)


if __name__ == "__main__":
    main()
