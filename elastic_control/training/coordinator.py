"""A tiny barrier service so trainers can stop together at the end of every pass.

Paddle 2.6.2's parameter-server mode has no barrier without Gloo (and Gloo
wants a shared filesystem or an extra HTTP store), so pserver 0 hosts this
service on its port + 1: pservers are the one address every trainer already
knows (PADDLE_PSERVERS_IP_PORT_LIST), in a pod as on a laptop.

Protocol: one JSON object per line over TCP, one request per connection.
- ``{"op": "hello"}`` -> ``{"resume_after": "YYYYMMDD/HH" | null, "last_pass": name | null}``
- ``{"op": "barrier", "name": N, "rank": r, "size": n, "data": {...}}`` -> ``{"ok": true, "data": {rank: data}}``
  once n ranks arrived (``data`` lets trainer 0 sum up every trainer's counts)
- ``{"op": "status"}`` -> ``{"finished": bool}`` (all trainers finished), for the other pservers
- ``{"op": "finish", "rank": r}`` -> ``{"ok": true}``; when all trainers finished the service says so
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
import time
from collections.abc import Callable

from ctr_foundation.errors import ComponentError
from ctr_foundation.names import COORDINATOR_PORT_OFFSET  # the local plans reserve that port too


def coordinator_endpoint(pserver_endpoints: str) -> tuple[str, int]:
    """(host, port) of the coordinator: pserver 0's host, its port + 1."""
    first = pserver_endpoints.split(",")[0].strip()
    host, _, port = first.rpartition(":")
    if not host or not port.isdigit():
        raise ComponentError(f"PADDLE_PSERVERS_IP_PORT_LIST entry {first!r} is not host:port")
    return host, int(port) + COORDINATOR_PORT_OFFSET


class _Handler(socketserver.StreamRequestHandler):
    def handle(self):
        try:
            request = json.loads(self.rfile.readline().decode("utf-8") or "{}")
        except json.JSONDecodeError:
            self._reply({"error": "bad request"})
            return
        self._reply(self.server.coordinator.handle(request))

    def _reply(self, obj):
        self.wfile.write((json.dumps(obj) + "\n").encode("utf-8"))


class _Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True


class Coordinator:
    """The service side: barriers by name, the resume point, and who has finished."""

    def __init__(self, trainers: int, hello: Callable[[], dict]):
        self.trainers = trainers
        self._hello = hello
        self._cond = threading.Condition()
        self._arrived: dict[str, dict[int, object]] = {}
        self._released: set[str] = set()
        self.finished: set[int] = set()
        self._server: _Server | None = None

    def handle(self, request: dict) -> dict:
        op = request.get("op")
        if op == "hello":
            return self._hello()
        if op == "barrier":
            name, rank, size = str(request["name"]), int(request["rank"]), int(request["size"])
            with self._cond:
                self._arrived.setdefault(name, {})[rank] = request.get("data")
                if len(self._arrived[name]) >= size:
                    self._released.add(name)
                    self._cond.notify_all()
                while name not in self._released:
                    self._cond.wait()
                data = {str(r): d for r, d in self._arrived[name].items()}
            return {"ok": True, "data": data}
        if op == "status":
            with self._cond:
                return {"finished": len(self.finished) >= self.trainers}
        if op == "finish":
            with self._cond:
                self.finished.add(int(request["rank"]))
                self._cond.notify_all()
            return {"ok": True}
        return {"error": f"unknown op {op!r}"}

    def wait_all_finished(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: len(self.finished) >= self.trainers, timeout)

    def serve_in_thread(self, host: str, port: int) -> None:
        self._server = _Server((host, port), _Handler)
        self._server.coordinator = self
        threading.Thread(target=self._server.serve_forever, name="coordinator", daemon=True).start()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


class CoordinatorClient:
    """The trainer side; retries while pserver 0 is still starting."""

    def __init__(self, host: str, port: int, *, connect_timeout: float = 300.0):
        self.host, self.port, self.connect_timeout = host, port, connect_timeout

    def call(self, request: dict, *, timeout: float | None = None) -> dict:
        deadline = time.monotonic() + self.connect_timeout
        while True:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=10)
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise ComponentError(
                        f"cannot reach the training coordinator at {self.host}:{self.port} (pserver 0's port + 1): {e}"
                    ) from e
                time.sleep(0.5)
        with sock:
            sock.settimeout(timeout)
            sock.sendall((json.dumps(request) + "\n").encode("utf-8"))
            data = b""
            while not data.endswith(b"\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    raise ComponentError(
                        f"the training coordinator at {self.host}:{self.port} closed the "
                        f"connection during {request.get('op')} (did pserver 0 die?)"
                    )
                data += chunk
        reply = json.loads(data)
        if "error" in reply:
            raise ComponentError(f"training coordinator: {reply['error']}")
        return reply

    def hello(self) -> dict:
        return self.call({"op": "hello"}, timeout=60)

    def barrier(self, name: str, rank: int, size: int, data=None) -> dict:
        """Wait until ``size`` ranks reached barrier ``name``; return every rank's ``data`` by rank."""
        return self.call({"op": "barrier", "name": name, "rank": rank, "size": size, "data": data})["data"]

    def status(self) -> dict:
        return self.call({"op": "status"}, timeout=30)

    def finish(self, rank: int) -> None:
        self.call({"op": "finish", "rank": rank}, timeout=60)
