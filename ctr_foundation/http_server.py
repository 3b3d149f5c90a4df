"""The one HTTP server of ElasticCTR: a listening socket, an event loop, a thread pool, time-outs, a cap.

    server = HttpServer(app, host="127.0.0.1", port=0, token=token, name="file server")
    serve_in_thread(server)          # tests, benchmarks, embedding; or server.serve_forever()
    ...
    server.shutdown(); server.server_close()

``app.route(request) -> Route`` (``ctr_foundation.http_protocol``) decides
per request head; raise ``HttpError`` there for 404/405. The file server,
cube-server, cube-agent, cube-transfer and serving all run on it, so they
share one framing, one set of limits and time-outs and one token check
(docs/contracts.md, "HTTP rules").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ctr_foundation.http_protocol import HttpProtocol

log = logging.getLogger("ctr_foundation.http")


@dataclass(frozen=True)
class HttpLimits:
    """Limits of one server; every server has all of them (values in docs/contracts.md)."""

    max_connections: int = 1024  # beyond: the oldest idle connection is closed, else 503 and closed at once
    header_timeout: float = 10.0  # a request head must be complete this long after it started
    idle_timeout: float = 60.0  # a keep-alive connection with nothing to do is closed
    body_timeout: float = 60.0  # a body that stalls (no byte) this long is abandoned (408)
    max_unfinished_bodies: int = 128  # bodies still arriving after their head, per server; beyond: 503
    body_grace: float = 10.0  # an unfinished body has this long before body_min_rate applies
    body_min_rate: int = 1024  # bytes/s an unfinished body must average after body_grace (408); 0: no minimum
    small_body: int = 64 << 10  # an announced Content-Length up to this is outside max_unfinished_bodies ...
    small_body_timeout: float = 2.0  # ... and must be complete this long after its head (408)
    write_timeout: float = 60.0  # a client that reads none of its answers this long is dropped
    max_header_bytes: int = 16 * 1024  # 431 above
    max_headers: int = 100  # 431 above
    write_high_water: int = 4 << 20  # unsent answer bytes above which the connection stops reading
    read_buffer: int = 256 << 10  # unparsed bytes held while a connection waits for its answers
    stream_buffer: int = 4 << 20  # bytes of a streamed body waiting for its handler
    threads: int = 16  # thread pool for thread/stream routes


class HttpServer:
    """Bound at construction (port 0 picks a free one; bind errors raise OSError); serves until shutdown()."""

    def __init__(
        self,
        app,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        sock: socket.socket | None = None,
        token: str | None = None,
        name: str = "http server",
        limits: HttpLimits | None = None,
        protocol_factory: Callable[[HttpServer], HttpProtocol] = HttpProtocol,
        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
        backlog: int = 1024,
    ):
        self.app = app
        self.token = token or None
        self.name = name
        self.limits = limits or HttpLimits()
        self.protocol_factory = protocol_factory
        self.loop_factory = loop_factory or asyncio.new_event_loop
        self.backlog = backlog
        self.connections: dict[HttpProtocol, None] = {}  # an ordered set: oldest first
        self.unfinished_bodies = 0  # connections whose request body is still arriving
        self.lingering: dict = {}  # connections closing after an error answer, oldest first (evict_one)
        self.arriving: dict = {}  # those connections, oldest first (HttpProtocol._displace_slowest_body)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()
        self._stop: asyncio.Event | None = None
        self._server: asyncio.Server | None = None
        self._stopped = threading.Event()
        self._running = threading.Event()
        self._thread: threading.Thread | None = None
        if sock is None:
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError:
                sock.close()
                raise
        self.socket = sock
        self.server_address = sock.getsockname()[:2]

    # ---- addresses ---------------------------------------------------------------------------
    @property
    def port(self) -> int:
        return self.server_address[1]

    @property
    def url(self) -> str:
        host = self.server_address[0]
        host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    # ---- thread pool -------------------------------------------------------------------------
    def executor(self) -> ThreadPoolExecutor:
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.limits.threads, thread_name_prefix=self.name.replace(" ", "-"))
            return self._executor

    # ---- serving -----------------------------------------------------------------------------
    async def serve(self, on_started: Callable[[HttpServer], None] | None = None) -> None:
        """Serve on the running loop until shutdown() (for callers that own the loop, e.g. cube-server)."""
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self.socket.setblocking(False)
        server = await self.loop.create_server(
            lambda: self.protocol_factory(self), sock=self.socket, backlog=self.backlog
        )
        self._server = server
        sweeper = self.loop.create_task(self._sweep())
        try:
            if on_started is not None:
                on_started(self)
            self._running.set()
            await self._stop.wait()
        finally:
            sweeper.cancel()
            server.close()
            for conn in list(self.connections):
                conn.shutdown()
            with self._executor_lock:
                if self._executor is not None:
                    self._executor.shutdown(wait=False, cancel_futures=True)
            self._stopped.set()

    def serve_forever(self, *, handle_signals: bool = False, on_started=None) -> None:
        """Serve from this thread on a new event loop until shutdown() (or SIGTERM/SIGINT if handle_signals)."""

        async def main():
            if handle_signals:
                loop = asyncio.get_running_loop()
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.add_signal_handler(sig, self._request_stop)
            await self.serve(on_started)

        with asyncio.Runner(loop_factory=self.loop_factory) as runner:
            runner.run(main())

    def start_in_thread(self, on_started=None) -> HttpServer:
        """Serve from a daemon thread; returns once listening (errors of the start are raised here)."""
        errors: list[BaseException] = []

        def run():
            try:
                self.serve_forever(on_started=on_started)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                errors.append(e)
            finally:
                self._running.set()

        self._thread = threading.Thread(target=run, name=self.name, daemon=True)
        self._thread.start()
        self._running.wait()
        if errors:
            raise errors[0]
        return self

    def evict_one(self) -> bool:
        """Close a connection that is between requests, for a new one over the cap; False if there is none
        (``HttpProtocol.evictable``): first one closing after an error answer (nothing more is owed to it),
        then the oldest. A flood of idle or half-sent connections then only ever displaces itself (and idle
        keep-alive connections, which clients reopen), never a request."""
        while self.lingering:
            conn = next(iter(self.lingering))
            if conn.evictable(0.0):
                conn.evict()
                return True
            del self.lingering[conn]  # already closed
        now = self.loop.time()
        fresh = None
        for conn in self.connections:
            if conn.evictable(now):
                conn.evict()
                return True
            if fresh is None and conn.evictable(None):
                fresh = conn
        if fresh is not None:
            fresh.evict()
            return True
        return False

    def stop_accepting(self) -> None:
        """Stop accepting connections, keep serving the open ones (a graceful drain); call on the loop."""
        if self._server is not None:
            self._server.close()

    def _request_stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    def shutdown(self) -> None:
        """Stop serving (from any thread); waits until serving stopped unless called from the loop itself."""
        loop = self.loop
        if loop is None or self._stopped.is_set():
            return
        try:
            in_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            in_loop = False
        if in_loop:
            self._request_stop()
            return
        with contextlib.suppress(RuntimeError):  # the loop already closed
            loop.call_soon_threadsafe(self._request_stop)
        self._stopped.wait(10)
        if self._thread is not None:
            self._thread.join(10)

    def server_close(self) -> None:
        self.socket.close()

    async def _sweep(self) -> None:
        lim = self.limits
        tick = max(
            0.05, min(1.0, lim.header_timeout / 4, lim.idle_timeout / 4, lim.body_timeout / 4, lim.body_grace / 4)
        )
        while True:
            await asyncio.sleep(tick)
            now = self.loop.time()
            for conn in list(self.connections):
                try:
                    conn.sweep(now)
                except Exception:  # noqa: BLE001 - one bad connection must not stop the time-outs of all
                    log.exception("%s: time-out check failed", self.name)


def serve_in_thread(server: HttpServer) -> threading.Thread:
    """Run ``server`` in a daemon thread (tests, benchmarks, embedding); stop with ``server.shutdown()``."""
    server.start_in_thread()
    return server._thread
