"""Serving's listeners: HTTP (the foundation's raw asyncio HTTP/1.1 protocol) and gRPC, and the drain.

The HTTP protocol lets a handler answer after the event loop moved on, which is what merged batches
need: batch workers hand answers back to the loop (routes.HttpFrontend). gRPC runs on its own loop
thread (grpc_frontend.py). SIGTERM drains: readiness turns false at once (``/readyz`` 503, gRPC
health NOT_SERVING), after ``drain_delay`` seconds (time for a Service to take the endpoint out) both
listeners stop accepting, every request already accepted is answered (at most ``drain_timeout``
seconds), then the process exits: a serving restart behind a Service loses no request.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading

from ctr_foundation.http_protocol import HttpProtocol
from elastic_control.serving.app import DEFAULT_MAX_BODY, ServingApp
from elastic_control.serving.routes import HttpFrontend, HttpRoutes

log = logging.getLogger("elastic_control.serving")


class ServingServer:
    def __init__(
        self,
        app: ServingApp,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_body: int = DEFAULT_MAX_BODY,
        grpc_port: int | None = None,
        drain_delay: float = 0.0,
        drain_timeout: float = 30.0,
    ):
        self.app = app
        self.host = host
        self.port = port
        self.max_body = max_body
        self.grpc_port = grpc_port
        self.drain_delay = drain_delay
        self.drain_timeout = drain_timeout
        self.frontend = HttpFrontend(app)
        self.routes = HttpRoutes(app, self.frontend)
        self.grpc = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server = None
        self._thread: threading.Thread | None = None
        self._protocols: set[HttpProtocol] = set()

    async def _start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.frontend.loop = self._loop
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self._server = await self._loop.create_server(self._protocol, sock=sock, backlog=512)
        self.port = sock.getsockname()[1]
        self.frontend.address = f"{self.host}:{self.port}"
        self.app.frontends["http"] = self.frontend
        if self.grpc_port is not None:
            from elastic_control.serving.grpc_frontend import GrpcFrontend

            self.grpc = GrpcFrontend(self.app, host=self.host, port=self.grpc_port).start()
            self.grpc_port = self.grpc.port
            self.app.frontends["grpc"] = self.grpc
        self.app.start()

    def _protocol(self) -> HttpProtocol:
        proto = HttpProtocol(self.routes.handle, self.max_body)
        lost = proto.connection_lost
        protocols = self._protocols
        protocols.add(proto)

        def connection_lost(exc, _lost=lost, _proto=proto):
            protocols.discard(_proto)
            _lost(exc)

        proto.connection_lost = connection_lost
        return proto

    async def _drain(self) -> None:
        app = self.app
        app.begin_drain()
        log.info("draining: readiness is false; stop accepting in %.1fs", self.drain_delay)
        if self.drain_delay > 0:
            await asyncio.sleep(self.drain_delay)
        self._server.close()
        grpc_stop = None
        if self.grpc is not None:
            grpc_stop = threading.Thread(target=self.grpc.stop, args=(self.drain_timeout,), daemon=True)
            grpc_stop.start()
        idle = await asyncio.to_thread(app.wait_idle, self.drain_timeout)
        await asyncio.sleep(0.05)  # answers handed to the loop are written before connections close
        for proto in list(self._protocols):
            if proto.transport is not None and not proto.pending:
                proto.transport.close()
        if grpc_stop is not None:
            await asyncio.to_thread(grpc_stop.join, self.drain_timeout + 5)
        log.info("drained (%s): exiting", "every accepted request answered" if idle else "timed out")
        app.stop()

    def run_forever(self, on_listening=None) -> None:
        """Serve until SIGTERM/SIGINT, then drain (the CLI)."""

        async def main():
            await self._start()
            stop = asyncio.Event()
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._loop.add_signal_handler(sig, stop.set)
            if on_listening:
                on_listening(self)
            await stop.wait()
            await self._drain()

        asyncio.run(main())

    def start_in_thread(self) -> ServingServer:
        """Serve from a daemon thread (tests, benchmarks); ``self.port`` is bound when this returns."""
        ready = threading.Event()
        errors: list[BaseException] = []

        def run():
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._start())
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name="serving-http", daemon=True)
        self._thread.start()
        ready.wait()
        if errors:
            raise errors[0]
        return self

    def drain_in_thread(self) -> None:
        """What SIGTERM does, for a server started with ``start_in_thread`` (tests)."""
        asyncio.run_coroutine_threadsafe(self._drain(), self._loop).result(self.drain_timeout + 30)

    def stop(self) -> None:
        self.app.stop()
        if self.grpc is not None:
            self.grpc.stop(0.5)
        if self._loop and self._thread:

            def shutdown():
                self._server.close()
                self._loop.stop()

            self._loop.call_soon_threadsafe(shutdown)
            self._thread.join(5)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def grpc_target(self) -> str | None:
        return f"{self.host}:{self.grpc_port}" if self.grpc is not None else None
