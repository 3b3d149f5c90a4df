"""Serving's HTTP listener: the one HTTP layer (``ctr_foundation.http_server``) in front of ServingApp.

Requests are ``loop`` routes: ServingApp.handle runs on the event loop and
may answer later, which is what merged batches need (the batch worker hands
each answer back to the loop with ``call_soon_threadsafe``). Bodies are taken
only by POST (``max_body``, 413 above); framing, time-outs and the connection
cap are the layer's.
"""

from __future__ import annotations

from ctr_foundation.http_messages import NO_BODY_METHODS, Request
from ctr_foundation.http_protocol import Route
from ctr_foundation.http_server import HttpLimits, HttpServer
from elastic_control.serving.app import DEFAULT_MAX_BODY, ServingApp

# 1,000 idle clients beside the busy ones must not lock anyone out (issue 15's soak).
LIMITS = HttpLimits(max_connections=4096)


class _Routes:
    """Bodies only where the app reads them; ServingApp.handle answers every path (404/405 included)."""

    def __init__(self, app: ServingApp, max_body: int):
        self.with_body = Route(app.handle, max_body=max_body)
        self.without_body = Route(app.handle)

    def route(self, req: Request) -> Route:
        return self.without_body if req.method in NO_BODY_METHODS else self.with_body


class ServingServer:
    def __init__(
        self,
        app: ServingApp,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_body: int = DEFAULT_MAX_BODY,
        limits: HttpLimits | None = None,
    ):
        self.app = app
        self.host = host
        self.max_body = max_body
        self.http = HttpServer(_Routes(app, max_body), host=host, port=port, name="serving", limits=limits or LIMITS)
        self.port = self.http.port

    def _started(self, http: HttpServer) -> None:
        self.app.loop = http.loop
        self.app.start()

    def run_forever(self, on_listening=None) -> None:
        """Serve until SIGTERM/SIGINT (the CLI)."""

        def started(http):
            self._started(http)
            if on_listening:
                on_listening(self)

        try:
            self.http.serve_forever(handle_signals=True, on_started=started)
        finally:
            self.app.stop()
            self.http.server_close()

    def start_in_thread(self) -> ServingServer:
        """Serve from a daemon thread (tests, benchmarks); ``self.port`` is bound when this returns."""
        self.http.start_in_thread(on_started=self._started)
        return self

    def stop(self) -> None:
        self.app.stop()
        self.http.shutdown()
        self.http.server_close()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"
