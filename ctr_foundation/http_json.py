"""JSON over the one HTTP layer: the shared body parser, and small JSON services (cube-agent, cube-transfer).

``parse_json(body)`` is what every JSON endpoint uses: the body must be UTF-8,
nested at most ``max_depth`` levels, with no integer literal longer than
``MAX_INT_DIGITS`` digits and no NaN/Infinity; anything else is an HttpError
400 naming the problem (never a hang, a 500 or a dropped connection).

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

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

from ctr_foundation.errors import ElasticControlError, UsageError
from ctr_foundation.http_messages import HttpError, Request, Response
from ctr_foundation.http_protocol import THREAD, Route
from ctr_foundation.http_server import HttpLimits, HttpServer

log = logging.getLogger("ctr_foundation.http")

DEFAULT_MAX_DEPTH = 64
MAX_INT_DIGITS = 40  # a uint64 has 20; longer literals are refused before Python converts them
DEFAULT_MAX_BODY = 1 << 20
# One translation of the body serves both pre-checks: digits become "0", "[" and "{" become "[", all else
# ".". Long digit runs are then a search for MAX_INT_DIGITS + 1 zeros (a regex like [0-9]{41} retries at
# every digit: ~1 ms for a 30 KB predict body, 40x json.loads itself), and the opening brackets a count.
_SHAPE = bytes(48 if 48 <= c <= 57 else 91 if c in (91, 123) else 46 for c in range(256))
_LONG_DIGITS = b"0" * (MAX_INT_DIGITS + 1)


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


# json.loads(text, **kwargs) builds a new decoder (and its C scanner) per call: these are built once.
_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"integer literal of {len(text)} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def nesting_depth(data: bytes) -> int:
    """Deepest nesting of arrays/objects in JSON text ``data`` (brackets inside strings not counted)."""
    import numpy as np

    b = np.frombuffer(data, dtype=np.uint8)
    if not len(b):
        return 0
    backslash = b == 92
    # length of the run of backslashes ending at each byte, to find the quotes that are not escaped
    count = np.cumsum(backslash, dtype=np.int64)
    run = count - np.maximum.accumulate(np.where(backslash, 0, count))
    before = np.concatenate(([0], run[:-1]))
    quote = (b == 34) & (before % 2 == 0)
    outside = (np.cumsum(quote) % 2 == 0) & ~quote
    delta = ((b == 91) | (b == 123)).astype(np.int64) - ((b == 93) | (b == 125))
    return int(np.max(np.cumsum(delta * outside), initial=0))


def parse_json(body: bytes, *, max_depth: int = DEFAULT_MAX_DEPTH, max_bytes: int | None = None):
    """``body`` as JSON; HttpError 400 (413 over ``max_bytes``) naming what is wrong with it."""
    if max_bytes is not None and len(body) > max_bytes:
        raise HttpError(413, f"JSON body of {len(body)} bytes exceeds the limit of {max_bytes}")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HttpError(400, f"malformed JSON: the body is not valid UTF-8 (byte {e.start})") from None
    shape = body.translate(_SHAPE)
    if shape.count(b"[") > max_depth and nesting_depth(body) > max_depth:
        raise HttpError(400, f"JSON nested deeper than {max_depth} levels")
    try:
        if _LONG_DIGITS in shape:  # rare: check every integer literal (slower)
            return json.loads(text, parse_constant=_refuse_constant, parse_int=_bounded_int)
        return _DECODER.decode(text)
    except RecursionError:
        raise HttpError(400, "JSON nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, and int conversion limits
        raise HttpError(400, f"malformed JSON: {e}") from None


def parse_json_object(body: bytes, **kwargs) -> dict:
    """``parse_json`` for endpoints that take a JSON object; an empty body is ``{}``."""
    if not body.strip():
        return {}
    obj = parse_json(body, **kwargs)
    if not isinstance(obj, dict):
        raise HttpError(400, f"the body must be a JSON object, not {type(obj).__name__}")
    return obj


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
