"""Serving's HTTP listener: cube's raw asyncio HTTP/1.1 protocol (keep-alive, answers delivered later).

The protocol lets a handler answer after the event loop moved on, which is
what merged batches need: the batch worker hands each answer back to the
loop with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import threading

from ctr_foundation.http_protocol import HttpProtocol
from elastic_control.serving.app import DEFAULT_MAX_BODY, ServingApp


class ServingServer:
    def __init__(self, app: ServingApp, *, host: str = "127.0.0.1", port: int = 0, max_body: int = DEFAULT_MAX_BODY):
        self.app = app
        self.host = host
        self.port = port
        self.max_body = max_body
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server = None
        self._thread: threading.Thread | None = None

    async def _start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.app.loop = self._loop
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self._server = await self._loop.create_server(
            lambda: HttpProtocol(self.app.handle, self.max_body), sock=sock, backlog=512
        )
        self.port = sock.getsockname()[1]
        self.app.start()

    def run_forever(self, on_listening=None) -> None:
        """Serve until SIGTERM/SIGINT (the CLI)."""

        async def main():
            await self._start()
            stop = asyncio.Event()
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._loop.add_signal_handler(sig, stop.set)
            if on_listening:
                on_listening(self)
            await stop.wait()
            self._server.close()
            self.app.stop()

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

    def stop(self) -> None:
        self.app.stop()
        if self._loop and self._thread:

            def shutdown():
                self._server.close()
                self._loop.stop()

            self._loop.call_soon_threadsafe(shutdown)
            self._thread.join(5)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"
