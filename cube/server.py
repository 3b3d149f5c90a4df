"""cube-server: serves one shard of the cube over HTTP, from verified private copies of its shard files.

``cube-server --port P --shard I --data DIR [--workers N]``. DIR is a version
folder (holding manifest.json) or a cube root (the newest complete version
holding shard I is served at start; with an agent, the versions the agent
loads). With N > 1 workers, N processes accept on the same port
(SO_REUSEPORT) under a small supervisor that restarts a crashed worker; all
workers follow the shared state file (see cube/version_store.py).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import socket
import sys
import time
from pathlib import Path

import click

from ctr_foundation import env_vars, names
from ctr_foundation.atomic import atomic_write_json
from ctr_foundation.cli_runner import run_cli
from ctr_foundation.errors import ComponentError, DataError, ElasticControlError, UsageError
from cube.server_app import CubeWorker
from cube.shard_format import MANIFEST, CorruptShardError, complete_versions, read_manifest, shard_file_name
from cube.version_store import ControlState, StateFile, verify_chain

DEFAULT_PORT = names.CUBE_SERVER_PORT
DEFAULT_MAX_BATCH = 1_000_000
READY_TIMEOUT = 300.0
EVENT_LOOPS = ("auto", "uvloop", "asyncio")


def make_listen_socket(host: str, port: int, *, reuse_port: bool, listen: bool = True) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ComponentError(f"cannot listen on {host}:{port}: {e.strerror}") from e
    if listen:
        sock.listen(2048)
    sock.setblocking(False)
    return sock


def initial_state(data_dir: Path, shard: int, workers: int, store: StateFile) -> ControlState:
    """The state to start with: the recorded one after a restart, else what DIR holds (verified)."""
    state = store.read()
    if state is not None:
        if state.shard != shard:
            raise UsageError(f"{store.path} belongs to shard {state.shard}, not {shard}; use another --state-dir")
        state.workers = workers
        return state
    state = ControlState(generation=1, workers=workers, shard=shard)
    name = shard_file_name(shard)
    if (data_dir / MANIFEST).exists():
        candidates = [name]
    else:
        candidates = [f"{v}/{name}" for v in reversed(complete_versions(data_dir))]
    for rel in candidates:
        if not (data_dir / rel).exists():
            continue
        try:
            version = read_manifest((data_dir / rel).parent).get("version")
            if not isinstance(version, str):
                raise CorruptShardError(f"{(data_dir / rel).parent}/{MANIFEST} names no version")
            verify_chain(data_dir, rel, version, shard)
        except ElasticControlError as e:
            _say(f"not serving {rel}: {e}")
            continue
        state.active = version
        state.paths[version] = rel
        break
    return state


def verified_state(data_dir: Path, state: ControlState) -> ControlState:
    """``state`` without the versions whose files (or their ancestors') fail their manifests' checks.

    A damaged non-active version is dropped and the others still load; a damaged active version
    leaves the server without one (not ready) rather than crash-looping: its agent loads it again.
    """
    bad = {}
    for version in sorted(state.held()):
        try:
            rel = state.paths.get(version)
            if rel is None:
                raise DataError("the state file names no shard file for it")
            verify_chain(data_dir, rel, version, state.shard)
        except ElasticControlError as e:
            bad[version] = str(e)
    for version, reason in bad.items():
        _say(f"dropping version {version} (was {', '.join(_roles(state, version))}): {reason}")
    return state.dropping(bad) if bad else state


def _roles(state: ControlState, version: str) -> list[str]:
    roles = [r for r in ("active", "prepared", "previous") if getattr(state, r) == version]
    return roles + (["pinned"] if version in state.pinned else [])


def _say(message: str) -> None:
    print(f"cube-server: {message}", file=sys.stderr, flush=True)


def event_loop_factory(kind: str):
    """The event loop class to serve with: uvloop (libuv, in C) when installed, unless told otherwise.

    At 26 keys per request the event loop's own Python (callbacks, transport
    writes) is a large share of each request's cost; uvloop runs it in C.
    """
    if kind not in EVENT_LOOPS:
        raise UsageError(f"--event-loop {kind!r}: expected one of {', '.join(EVENT_LOOPS)}")
    if kind in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if kind == "uvloop":
                raise UsageError("--event-loop uvloop: the uvloop package is not installed") from None
        else:
            return uvloop.new_event_loop
    return asyncio.new_event_loop


def run_worker(
    *,
    host: str,
    port: int,
    shard: int,
    data_dir: str,
    state_dir: str,
    worker: int,
    workers: int,
    token: str | None,
    max_batch: int,
    ready_file: str | None = None,
    event_loop: str = "auto",
) -> None:
    """Body of one worker process (also the whole server when --workers 1)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    app = CubeWorker(
        data_dir=Path(data_dir),
        state_dir=Path(state_dir),
        shard=shard,
        worker=worker,
        workers=workers,
        token=token,
        max_batch=max_batch,
    )
    app.apply_state_file()
    sock = make_listen_socket(host, port, reuse_port=workers > 1)
    if ready_file:
        atomic_write_json(ready_file, {"port": sock.getsockname()[1], "pid": os.getpid(), "workers": workers})
    try:
        with asyncio.Runner(loop_factory=event_loop_factory(event_loop)) as runner:
            runner.run(app.serve(sock, max_body=max_batch * 8 + 1024))
    except KeyboardInterrupt:
        pass


class Supervisor:
    """Starts N worker processes on one port and restarts any that dies."""

    def __init__(self, workers: int, worker_kwargs: dict):
        self.n = workers
        self.kwargs = worker_kwargs
        self.ctx = multiprocessing.get_context("spawn")
        self.procs: dict[int, multiprocessing.Process] = {}
        self.stopping = False

    def start(self, k: int) -> None:
        p = self.ctx.Process(
            target=run_worker, kwargs={**self.kwargs, "worker": k}, name=f"cube-server-worker-{k}", daemon=True
        )
        p.start()
        self.procs[k] = p

    def run(self, store: StateFile, generation: int, ready_file: str | None, port: int) -> None:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        for k in range(self.n):
            self.start(k)
        self._wait_ready(store, generation)
        if ready_file:
            atomic_write_json(ready_file, {"port": port, "pid": os.getpid(), "workers": self.n})
        print(
            f"cube-server: shard {self.kwargs['shard']} ready on http://{self.kwargs['host']}:{port} "
            f"with {self.n} workers",
            flush=True,
        )
        while not self.stopping:
            time.sleep(0.2)
            for k, p in list(self.procs.items()):
                if not p.is_alive() and not self.stopping:
                    print(
                        f"cube-server: worker {k} (pid {p.pid}) exited with {p.exitcode}; restarting",
                        file=sys.stderr,
                        flush=True,
                    )
                    time.sleep(0.5)
                    self.start(k)
        for p in self.procs.values():
            p.terminate()
        for p in self.procs.values():
            p.join(5)
            if p.is_alive():
                p.kill()

    def _wait_ready(self, store: StateFile, generation: int) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline and not self.stopping:
            acks = store.read_acks(self.n)
            if len(acks) == self.n and all(a.get("generation", 0) >= generation for a in acks.values()):
                for k, a in sorted(acks.items()):  # verified a moment ago, so rare: say so and serve the rest
                    for version, error in sorted(a.get("errors", {}).items()):
                        _say(f"worker {k} could not load {version}: {error}")
                return
            dead = [k for k, p in self.procs.items() if not p.is_alive()]
            if dead:
                self._stop()
                raise ComponentError(
                    f"worker {dead[0]} exited during start-up (exit code {self.procs[dead[0]].exitcode})"
                )
            time.sleep(0.05)

    def _stop(self, *_):
        self.stopping = True
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()


def serve(
    *,
    port: int,
    shard: int,
    data: str,
    workers: int = 1,
    host: str = "0.0.0.0",
    state_dir: str | None = None,
    token: str | None = None,
    max_batch: int = DEFAULT_MAX_BATCH,
    ready_file: str | None = None,
    event_loop: str = "auto",
) -> None:
    """Run a cube-server until SIGTERM (keyword-only API behind the console script)."""
    event_loop_factory(event_loop)  # an unknown or missing loop is a usage error now, not in every worker
    data_dir = Path(data)
    if not data_dir.is_dir():
        raise UsageError(f"--data {data}: not a folder")
    if shard < 0:
        raise UsageError(f"--shard {shard} must be >= 0")
    if not 1 <= workers <= 64:
        raise UsageError(f"--workers {workers} is out of range (1-64)")
    store = StateFile(state_dir or data_dir / f".cube-server-shard-{shard}")
    with store.locked():
        state = verified_state(data_dir, initial_state(data_dir, shard, workers, store))
        store.write(state)
        for f in store.dir.glob("worker-*.json"):
            f.unlink()
    kwargs = dict(
        host=host,
        shard=shard,
        data_dir=str(data_dir),
        state_dir=str(store.dir),
        workers=workers,
        token=token,
        max_batch=max_batch,
        event_loop=event_loop,
    )
    if workers == 1:
        print(f"cube-server: shard {shard} serving {state.active or 'nothing yet'} from {data_dir}", flush=True)
        run_worker(port=port, worker=0, ready_file=ready_file, **kwargs)
        return
    # Reserve the port (bound, not listening) so port 0 resolves once for all workers.
    holder = make_listen_socket(host, port, reuse_port=True, listen=False)
    real_port = holder.getsockname()[1]
    Supervisor(workers, {**kwargs, "port": real_port}).run(store, state.generation, ready_file, real_port)
    holder.close()


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--port",
    type=int,
    default=lambda: env_vars.CUBE_SERVER_PORT.get(),
    show_default=str(DEFAULT_PORT),
    help="TCP port, 0: any free port [env ELASTIC_CTR_CUBE_SERVER_PORT].",
)
@click.option(
    "--shard",
    type=int,
    default=lambda: env_vars.CUBE_SHARD.get(),
    help="The shard index I this server serves [env ELASTIC_CTR_CUBE_SHARD].",
)
@click.option(
    "--data",
    default=lambda: env_vars.CUBE_ROOT.get(),
    help="A version folder (with manifest.json) or a cube root [env ELASTIC_CTR_CUBE_ROOT].",
)
@click.option(
    "--workers",
    type=int,
    default=lambda: env_vars.CUBE_SERVER_WORKERS.get(),
    show_default="1",
    help="Worker processes sharing the port [env ELASTIC_CTR_CUBE_SERVER_WORKERS].",
)
@click.option("--host", default="0.0.0.0", show_default=True, help="Address to bind.")
@click.option("--state-dir", default=None, help="Where the version state lives (default DATA/.cube-server-shard-I).")
@click.option("--max-batch", type=int, default=DEFAULT_MAX_BATCH, show_default=True, help="Most keys per request.")
@click.option("--ready-file", default=None, help="Write {port, pid} here (JSON) once serving.")
@click.option(
    "--event-loop",
    default="auto",
    show_default=True,
    type=click.Choice(EVENT_LOOPS),
    help="auto: uvloop when installed, else asyncio's own loop.",
)
def server_command(port, shard, data, workers, host, state_dir, max_batch, ready_file, event_loop):
    """Serve one cube shard: batched lookups, versioned, switched atomically."""
    if shard is None or data is None:
        raise UsageError("--shard and --data are required (or ELASTIC_CTR_CUBE_SHARD and ELASTIC_CTR_CUBE_ROOT)")
    serve(
        port=port,
        shard=shard,
        data=data,
        workers=workers,
        host=host,
        state_dir=state_dir,
        token=env_vars.TOKEN.get(),
        max_batch=max_batch,
        ready_file=ready_file,
        event_loop=event_loop,
    )


def main(argv: list[str] | None = None) -> None:
    run_cli(server_command, "cube-server", argv)


if __name__ == "__main__":
    main()
