"""A small threaded JSON-over-HTTP service base for cube-agent and cube-transfer.

These services take a few calls a minute, so the standard library's
ThreadingHTTPServer is enough (the hot path, lookups, is cube-server's own
asyncio protocol). Routes map ``(METHOD, PATH)`` to ``fn(body) -> (status, obj)``;
calls marked ``write`` need ``Authorization: Bearer $ELASTIC_CTR_TOKEN``.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from ctr_foundation.errors import ElasticControlError, UsageError

log = logging.getLogger("cube")


@dataclass(frozen=True)
class Route:
    fn: Callable[[dict], tuple[int, object]]
    write: bool = False


def make_json_server(
    *, host: str, port: int, routes: dict[tuple[str, str], Route], token: str | None, name: str
) -> ThreadingHTTPServer:
    """A ThreadingHTTPServer answering JSON on ``routes``; bind errors surface as OSError."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = name

        def log_message(self, fmt, *args):
            log.debug("%s %s", name, fmt % args)

        def _send(self, status: int, obj) -> None:
            if isinstance(obj, str):
                body, ctype = obj.encode(), "text/plain; version=0.0.4"
            else:
                body, ctype = (json.dumps(obj, indent=1, default=str) + "\n").encode(), "application/json"
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _handle(self, method: str) -> None:
            path = urlsplit(self.path).path
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            route = routes.get((method, path))
            if route is None:
                known = sorted({p for _, p in routes})
                status = 405 if path in known else 404
                return self._send(status, {"error": f"no {method} {path}; endpoints: {known}"})
            if route.write:
                got = self.headers.get("Authorization", "")
                if not token:
                    return self._send(403, {"error": f"{name}: writes are disabled (ELASTIC_CTR_TOKEN is not set)"})
                if not got.startswith("Bearer ") or not hmac.compare_digest(got[7:].encode(), token.encode()):
                    return self._send(401, {"error": "missing or wrong bearer token"})
            try:
                body = json.loads(raw) if raw else {}
                if not isinstance(body, dict):
                    raise ValueError("expected a JSON object")
            except (ValueError, RecursionError) as e:  # bad JSON, invalid UTF-8, too deeply nested
                return self._send(400, {"error": f"body must be a JSON object: {str(e)[:200]}"})
            try:
                status, obj = route.fn(body)
            except UsageError as e:
                status, obj = 400, {"error": str(e)}
            except ElasticControlError as e:
                status, obj = 502, {"error": str(e)}
            except Exception as e:  # report, keep serving
                log.exception("%s %s failed", method, path)
                status, obj = 500, {"error": f"internal error: {type(e).__name__}: {e}"}
            self._send(status, obj)

        def do_GET(self):
            self._handle("GET")

        def do_POST(self):
            self._handle("POST")

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        allow_reuse_address = True

    return Server((host, port), Handler)


def serve_in_thread(server: ThreadingHTTPServer) -> threading.Thread:
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    t.start()
    return t


def require_str(body: dict, key: str) -> str:
    v = body.get(key)
    if not isinstance(v, str) or not v:
        raise UsageError(f"field {key!r} must be a non-empty string")
    return v
