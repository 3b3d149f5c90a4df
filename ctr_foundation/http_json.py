"""Small JSON services over the one HTTP layer (cube-agent, cube-transfer).

Bodies are read with the shared parser, ``http_messages.parse_json``.
``make_json_server(routes=...)``: routes map ``(METHOD, PATH)`` to
``JsonRoute(fn)`` with ``fn(body: dict) -> (status, obj)``, run in the
server's thread pool (these services take a few calls a minute and may block
on downloads). ``write=True`` routes need the token (checked before the body
is read). Errors keep their meaning: UsageError -> 400; an error carrying the
HTTP status of a downstream call (``.status``) keeps a 4xx as it was (a 409
from cube-server stays a 409), except 401/403 (the caller's token was fine:
ours was refused), which like every other downstream failure become 502.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from ctr_foundation.errors import ElasticControlError, UsageError
from ctr_foundation.http_messages import HttpError, Request, Response, parse_json_object
from ctr_foundation.http_protocol import THREAD, Route
from ctr_foundation.http_server import HttpLimits, HttpServer

log = logging.getLogger("ctr_foundation.http")

DEFAULT_MAX_BODY = 1 << 20


def require_str(body: dict, key: str) -> str:
    v = body.get(key)
    if not isinstance(v, str) or not v:
        raise UsageError(f"field {key!r} must be a non-empty string")
    return v


def downstream_status(e: BaseException) -> int:
    """The status to answer for a failed downstream call (see the module docstring)."""
    status = getattr(e, "status", None)
    if isinstance(status, int) and 400 <= status < 500 and status not in (401, 403):
        return status
    return 504 if isinstance(e, TimeoutError) else 502


@dataclass(frozen=True)
class JsonRoute:
    fn: Callable[[dict], tuple[int, object]]
    write: bool = False  # needs the token
    max_body: int = DEFAULT_MAX_BODY


class JsonApp:
    """Routes ``(METHOD, PATH)`` -> JsonRoute, answered in the thread pool; 404/405 for the rest."""

    def __init__(self, routes: dict[tuple[str, str], JsonRoute], name: str):
        self.name = name
        self.paths = sorted({p for _, p in routes})
        self.routes = {key: self._route(key, r) for key, r in routes.items()}

    def _route(self, key: tuple[str, str], r: JsonRoute) -> Route:
        method, path = key

        def call(req: Request) -> Response:
            body = parse_json_object(req.body, max_bytes=r.max_body)
            try:
                status, obj = r.fn(body)
            except UsageError as e:
                status, obj = 400, {"error": str(e)}
            except ElasticControlError as e:
                status, obj = downstream_status(e), {"error": str(e)}
            if isinstance(obj, str):
                return Response(status, obj.encode(), "text/plain; version=0.0.4")
            return Response.json(obj, status, indent=1)

        return Route(call, mode=THREAD, token=r.write, max_body=r.max_body if method not in ("GET", "HEAD") else 0)

    def route(self, req: Request) -> Route:
        key = (req.method, req.path)
        found = self.routes.get(key)
        if found is None and req.method == "HEAD":
            found = self.routes.get(("GET", req.path))
        if found is not None:
            return found
        allowed = sorted(m for m, p in self.routes if p == req.path)
        if allowed:
            raise HttpError(
                405,
                f"{req.method} is not allowed on {req.path}; use {', '.join(allowed)}",
                headers={"Allow": ", ".join(allowed)},
            )
        raise HttpError(404, f"no endpoint {req.path}; endpoints: {self.paths}")


def make_json_server(
    *,
    host: str,
    port: int,
    routes: dict[tuple[str, str], JsonRoute],
    token: str | None,
    name: str,
    limits: HttpLimits | None = None,
) -> HttpServer:
    """An HttpServer answering JSON on ``routes``; bind errors surface as OSError."""
    return HttpServer(
        JsonApp(routes, name),
        host=host,
        port=port,
        token=token,
        name=name,
        limits=limits or HttpLimits(max_connections=256, threads=8),
    )
