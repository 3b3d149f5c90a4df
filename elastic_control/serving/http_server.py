"""Serving's listeners: HTTP (the one HTTP layer, ``ctr_foundation.http_server``) and gRPC, and the drain.

Predictions are ``loop`` routes: routes.HttpRoutes.handle runs on the event loop and answers later,
which is what merged batches need (batch workers hand answers back to the loop, routes.HttpFrontend).
Split changes are ``thread`` routes that need the token (checked by the layer, before any body is
read): loading a challenger downloads and prepares a model, off the event loop. Framing, time-outs
and the connection cap are the layer's. gRPC runs on its own loop thread (grpc_frontend.py).

SIGTERM drains: readiness turns false at once (``/readyz`` 503, gRPC health NOT_SERVING), after
``drain_delay`` seconds (time for a Service to take the endpoint out) both listeners stop accepting,
every request already accepted is answered (at most ``drain_timeout`` seconds), idle keep-alive
connections are closed, then the process exits: a serving restart behind a Service loses no request.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from ctr_foundation.http_messages import NO_BODY_METHODS, Request
from ctr_foundation.http_protocol import THREAD, Route
from ctr_foundation.http_server import HttpLimits, HttpServer
from elastic_control.serving.app import DEFAULT_MAX_BODY, ServingApp
from elastic_control.serving.routes import SPLIT_PATHS, HttpFrontend, HttpRoutes

log = logging.getLogger("elastic_control.serving")

# 1,000 idle clients beside the busy ones must not lock anyone out (the soak holds it).
LIMITS = HttpLimits(max_connections=4096)
SPLIT_MAX_BODY = 1 << 20


class _Routes:
    """Which Route serves a request: bodies only where the routes read them, the token for split changes."""

    def __init__(self, routes: HttpRoutes, max_body: int):
        self.with_body = Route(routes.handle, max_body=max_body)
        self.without_body = Route(routes.handle)
        self.split_change = Route(routes.change_split, mode=THREAD, token=True, max_body=SPLIT_MAX_BODY)

    def route(self, req: Request) -> Route:
        if req.path in SPLIT_PATHS and req.method not in ("GET", "HEAD"):
            return self.split_change
        return self.without_body if req.method in NO_BODY_METHODS else self.with_body


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
        limits: HttpLimits | None = None,
    ):
        self.app = app
        self.host = host
        self.max_body = max_body
        self.grpc_port = grpc_port
        self.drain_delay = drain_delay
        self.drain_timeout = drain_timeout
        self.frontend = HttpFrontend(app)
        self.routes = HttpRoutes(app, self.frontend)
        self.http = HttpServer(
            _Routes(self.routes, max_body),
            host=host,
            port=port,
            token=app.token,
            name="serving",
            limits=limits or LIMITS,
        )
        self.port = self.http.port
        self.grpc = None
        self._drained = threading.Event()

    def _started(self, http: HttpServer) -> None:
        self.frontend.loop = http.loop
        self.frontend.address = f"{self.host}:{self.port}"
        self.app.frontends["http"] = self.frontend
        if self.grpc_port is not None:
            # function-level: grpc_frontend imports grpc; --no-grpc and `elastic-control --help` stay free of it
            from elastic_control.serving.grpc_frontend import GrpcFrontend

            self.grpc = GrpcFrontend(self.app, host=self.host, port=self.grpc_port).start()
            self.grpc_port = self.grpc.port
            self.app.frontends["grpc"] = self.grpc
        self.app.start()

    async def _drain(self) -> None:
        app = self.app
        app.begin_drain()
        log.info("draining: readiness is false; stop accepting in %.1fs", self.drain_delay)
        if self.drain_delay > 0:
            await asyncio.sleep(self.drain_delay)
        self.http.stop_accepting()
        grpc_stop = None
        if self.grpc is not None:
            grpc_stop = threading.Thread(target=self.grpc.stop, args=(self.drain_timeout,), daemon=True)
            grpc_stop.start()
        self.frontend.flush()  # requests parsed in this pass of the loop count as accepted
        idle = await asyncio.to_thread(app.wait_idle, self.drain_timeout)
        await asyncio.sleep(0.05)  # answers handed to the loop are written before connections close
        for conn in list(self.http.connections):
            if conn.transport is not None and not conn.pending:
                conn.transport.close()  # idle keep-alive connections: a clean close, nothing is lost
        if grpc_stop is not None:
            await asyncio.to_thread(grpc_stop.join, self.drain_timeout + 5)
        log.info("drained (%s): exiting", "every accepted request answered" if idle else "timed out")
        self._drained.set()

    def run_forever(self, on_listening=None) -> None:
        """Serve until SIGTERM/SIGINT, then drain (the CLI)."""
        import signal

        def started(http):
            self._started(http)
            loop = http.loop
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, lambda: loop.create_task(self._drain_then_stop()))
            if on_listening:
                on_listening(self)

        try:
            self.http.serve_forever(on_started=started)
        finally:
            self.app.stop()
            self.http.server_close()

    async def _drain_then_stop(self) -> None:
        if self._drained.is_set() or self.app.draining:
            return
        try:
            await self._drain()
        finally:
            self.http.shutdown()

    def start_in_thread(self) -> ServingServer:
        """Serve from a daemon thread (tests, benchmarks); ``self.port`` is bound when this returns."""
        self.http.start_in_thread(on_started=self._started)
        return self

    def drain_in_thread(self) -> None:
        """What SIGTERM does, for a server started with ``start_in_thread`` (tests)."""
        asyncio.run_coroutine_threadsafe(self._drain(), self.http.loop).result(self.drain_timeout + 30)

    def stop(self) -> None:
        self.app.stop()
        if self.grpc is not None:
            self.grpc.stop(0.5)
        self.http.shutdown()
        self.http.server_close()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def grpc_target(self) -> str | None:
        return f"{self.host}:{self.grpc_port}" if self.grpc is not None else None
