"""Serving's HTTP routes (the listener itself is http_server.py).

- ``POST /v1/predict``: ``{"instances": [...], "routing_key"?, "arm"?}`` -> ``{"predictions",
  "request_id", "arm", "model_version", "cube_version"}``
- ``POST /v1/feedback``: ``{"events": [{"request_id", "index", "click"}]}`` -> ``{"joined", "unknown",
  "duplicate", "invalid"}``
- ``GET /v1/monitor``: live per-arm/version metrics, alerts, feedback and cache counters (JSON)
- ``GET /v1/split``; with the token ``PUT /v1/split``, ``DELETE /v1/split``, ``POST /v1/split/end``
- ``GET /healthz``, ``/readyz`` ("can answer"), ``/metrics`` (Prometheus), ``/v1/status``

Predict bodies are parsed and validated here, one request at a time, before they join a merged
batch (instances.py); answers come back from the batch workers through ``HttpFrontend.deliver``.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from ctr_foundation.http_messages import Request, Response, Slot, ok_json_bytes
from elastic_control.serving.app import ServingApp, SplitConflict
from elastic_control.serving.arms import SplitError, split_from_json
from elastic_control.serving.batcher import Answer, Frontend, Job, Outcome
from elastic_control.serving.instances import InstanceError, PredictRequest, decode_json, predict_body
from elastic_control.serving.monitor import prometheus_lines

MAX_FEEDBACK_EVENTS = 100_000
LARGE_BODY = 64 << 10  # predict bodies above this are decoded off the event loop
SPLIT_PATHS = ("/v1/split", "/v1/split/end")


class HttpFrontend(Frontend):
    """Hands answers from batch workers back to the HTTP event loop, one wake-up per batch."""

    name = "http"

    def __init__(self, app: ServingApp):
        super().__init__(app)
        self.address: str | None = None

    def deliver(self, items: list[tuple[Job, Outcome]]) -> None:
        encoded = [(job.context, _response(outcome, job.context[0])) for job, outcome in items]
        self.loop.call_soon_threadsafe(_deliver_all, encoded)


def _deliver_all(encoded) -> None:
    for (slot, deliver), response in encoded:
        deliver(slot, response)


def _response(outcome: Outcome, slot: Slot) -> Response | bytes:
    """An answer whole, encoded on the batch worker (the event loop only writes it), or a refusal."""
    if isinstance(outcome, Answer):
        return ok_json_bytes(outcome.to_json_bytes(), slot)
    return Response.error(outcome.status, outcome.message)


class HttpRoutes:
    def __init__(self, app: ServingApp, frontend: HttpFrontend):
        self.app = app
        self.frontend = frontend
        self._parser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="serving-parse")

    def handle(self, request: Request, slot: Slot, deliver) -> Response | None:
        path, method = request.path, request.method
        if path == "/v1/predict":
            if method != "POST":
                return Response.error(405, "use POST /v1/predict")
            return self._predict(request, slot, deliver)
        if path == "/v1/feedback":
            if method != "POST":
                return Response.error(405, "use POST /v1/feedback")
            return self._feedback(request)
        if path in SPLIT_PATHS:  # GET here; changes come through change_split (a thread route with the token)
            return self.change_split(request)
        if method not in ("GET", "HEAD"):
            return Response.error(405, f"{method} is not allowed on {path}")
        app = self.app
        if path == "/healthz":
            return Response.json({"status": "ok", "ready": app.readiness()[0], "model_version": app.active_version})
        if path == "/readyz":
            ready, reason = app.readiness()
            body = {"ready": ready, "reason": reason, "model_version": app.active_version}
            return Response.json(body) if ready else Response.json({**body, "error": reason}, 503)
        if path == "/metrics":
            return Response(200, self.metrics_text().encode(), "text/plain; version=0.0.4")
        if path == "/v1/status":
            return Response.json(app.status())
        if path == "/v1/monitor":
            return Response.json(app.monitor_document())
        return Response.error(404, f"unknown path {path}; try POST /v1/predict")

    def metrics_text(self) -> str:
        app = self.app
        summary = app.monitor.summary()
        alerts = app.monitor.alerts(summary)
        lines = prometheus_lines(summary, alerts, {a["name"]: a["weight"] for a in app.arms()})
        return (
            app.metrics.render(
                app.active_version,
                cache=app.cache.snapshot() if app.cache else None,
                feedback=app.prediction_log.counts,
                feedback_ring_bytes=app.prediction_log.ring_bytes,
            )
            + "\n".join(lines)
            + "\n"
        )

    # ---- predictions -------------------------------------------------------------------------------
    def _predict(self, request: Request, slot: Slot, deliver) -> Response | None:
        started = time.perf_counter()
        if len(request.body) > LARGE_BODY:
            # decoding a large body takes the loop's thread for a while (about 0.1 s per MB): on a thread of
            # its own, the loop goes on reading and answering every other connection meanwhile
            batcher = self.app.batcher
            with batcher._inflight_lock:  # accepted: a drain waits for its answer too
                batcher.inflight += 1
            self._parser.submit(self._parse_large, request.body, slot, deliver, started)
            return None
        outcome = self._parsed(request.body, started)
        if isinstance(outcome, Response):
            return outcome
        self.frontend.submit(Job(outcome, self.frontend, (slot, deliver), started))
        return None

    def _parsed(self, body: bytes, started: float) -> PredictRequest | Response:
        app = self.app
        try:
            parsed = predict_body(body)
        except InstanceError as e:
            app.metrics.observe_request(e.status, time.perf_counter() - started)
            return Response.error(e.status, str(e))
        if app.active is None:  # while draining, requests still reaching us are answered
            refusal = app.not_ready()
            app.metrics.observe_request(refusal.status, time.perf_counter() - started)
            return Response.error(refusal.status, refusal.message)
        return parsed

    def _parse_large(self, body: bytes, slot: Slot, deliver, started: float) -> None:
        batcher = self.app.batcher
        try:
            outcome = self._parsed(body, started)
        except Exception as e:  # noqa: BLE001 - answered, whatever happened
            outcome = Response.error(500, f"internal error: {type(e).__name__}: {e}")
        try:
            if isinstance(outcome, Response):
                self.frontend.loop.call_soon_threadsafe(deliver, slot, outcome)
            else:
                batcher.submit_many([Job(outcome, self.frontend, (slot, deliver), started)])
        finally:
            with batcher._inflight_lock:
                batcher.inflight -= 1

    def _feedback(self, request: Request) -> Response:
        try:
            body = decode_json(request.body)
        except InstanceError as e:
            return Response.error(400, str(e))
        if not isinstance(body, dict) or not isinstance(body.get("events"), list):
            return Response.error(400, 'the body must be {"events": [{"request_id", "index", "click"}, ...]}')
        events = body["events"]
        if len(events) > MAX_FEEDBACK_EVENTS:
            return Response.error(413, f"{len(events)} events in one request; at most {MAX_FEEDBACK_EVENTS}")
        triples = [
            (e.get("request_id"), e.get("index"), e.get("click")) if isinstance(e, dict) else (None, None, None)
            for e in events
        ]
        return Response.json(self.app.feedback(triples))

    # ---- the A/B split -----------------------------------------------------------------------------
    def change_split(self, request: Request) -> Response:
        """The split's routes. Changes run on the layer's thread pool (loading a challenger downloads and
        prepares a model: predictions go on meanwhile), after the layer checked the token."""
        app, method, path = self.app, request.method, request.path
        if path == "/v1/split" and method in ("GET", "HEAD"):
            return Response.json({"split": app.split.to_json(), "arms": app.arms()})
        allowed = {"/v1/split": ("GET", "PUT", "DELETE"), "/v1/split/end": ("POST",)}[path]
        if method not in allowed:
            return Response.error(405, f"{method} is not allowed on {path}; use {' or '.join(allowed)}")
        try:
            if method == "PUT":
                body = decode_json(request.body)
                split = app.set_split(split_from_json(body, app.split.generation + 1))
                return Response.json({"split": split.to_json(), "arms": app.arms()})
            if method == "DELETE":
                return Response.json(app.end_split(None))
            body = decode_json(request.body) if request.body.strip() else {}
            winner = body.get("winner") if isinstance(body, dict) else None
            if winner is not None and not isinstance(winner, str):
                return Response.error(400, '"winner" must be an arm name (or null to drop every challenger)')
            return Response.json(app.end_split(winner))
        except SplitConflict as e:
            return Response.error(409, str(e))
        except (SplitError, InstanceError) as e:
            return Response.error(getattr(e, "status", 400), str(e))
