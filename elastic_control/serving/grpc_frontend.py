"""Serving's gRPC API (ctr_foundation/grpc_api/serving.proto) beside HTTP, on its own port.

``Predict`` takes the instances ``/v1/predict`` takes (a slot-format line, or slot -> feasigns and
dense slot -> number), validated the same way (instances.py), and goes through the same batcher: the
same merged batches, arms, versions and answers. ``Feedback`` is ``/v1/feedback``. Errors are gRPC
status codes with the HTTP route's message: 400 -> INVALID_ARGUMENT, 413 -> RESOURCE_EXHAUSTED,
503 -> UNAVAILABLE, 500 -> INTERNAL. Bytes that do not decode as the method's request message are
INVALID_ARGUMENT too, naming the message type (grpc would answer UNKNOWN for a deserializer's exception).
The standard ``grpc.health.v1.Health`` service answers SERVING
(for "" and for ``elasticctr.serving.v1.Prediction``) only while serving is ready, and server
reflection lists the services. The server is grpc.aio on its own event loop thread; the calls it takes
in one pass of the loop reach the batch workers together (``Frontend.submit``), and answers come back
from batch workers with one ``call_soon_threadsafe`` per batch.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from ctr_foundation.grpc_api import SERVICE, serving_pb2, serving_pb2_grpc
from ctr_foundation.slot_grammar import SLOT_LIMIT, slot_too_long
from elastic_control.serving.app import ServingApp
from elastic_control.serving.batcher import Answer, Frontend, Job, Outcome
from elastic_control.serving.grpc_reply import predict_reply
from elastic_control.serving.instances import (
    InstanceColumns,
    InstanceError,
    ParsedInstances,
    PredictRequest,
    UnparsedLines,
    arm_of,
    check_count,
    routing_key_of,
)

log = logging.getLogger("elastic_control.serving")

STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.FAILED_PRECONDITION,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
MAX_MESSAGE_BYTES = 8 << 20
MAX_FEEDBACK_EVENTS = 100_000


class _Malformed:
    """What a request deserializes to when its bytes are not the message: the handler refuses it."""

    __slots__ = ("message",)

    def __init__(self, message: str):
        self.message = message


def _lenient(message_class):
    """``message_class.FromString`` that returns a _Malformed instead of raising: an exception raised in a
    deserializer never reaches a handler, and grpc answers it UNKNOWN instead of INVALID_ARGUMENT."""
    parse = message_class.FromString
    name = message_class.DESCRIPTOR.full_name

    def deserialize(data: bytes):
        try:
            return parse(data)
        except DecodeError as e:
            return _Malformed(f"malformed {name} message ({len(data)} bytes): {e}")

    return deserialize


def _add_prediction_service(servicer, server) -> None:
    """As serving_pb2_grpc.add_PredictionServicer_to_server, with deserializers that never raise."""
    handlers = {
        "Predict": grpc.unary_unary_rpc_method_handler(
            servicer.Predict,
            request_deserializer=_lenient(serving_pb2.PredictRequest),
            response_serializer=predict_reply,  # Predict returns the batcher's Answer itself
        ),
        "Feedback": grpc.unary_unary_rpc_method_handler(
            servicer.Feedback,
            request_deserializer=_lenient(serving_pb2.FeedbackRequest),
            response_serializer=serving_pb2.FeedbackResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


def parse_proto_instances(instances, *, defer_lines: bool = False) -> ParsedInstances | UnparsedLines:
    """Proto instances -> feature columns, with the HTTP route's rules (instances.py); with ``defer_lines``,
    instances that are all lines stay unparsed for the batch worker."""
    check_count(len(instances))
    if defer_lines:
        # A non-empty line is the oneof's line member: 7.7 us for 32 lines against 11.4 us for a pass with
        # HasField, which decides only when some line is empty (a "slots" instance, no member, or a line set
        # to "", which stays a line for the batch worker, as in JSON).
        lines = [inst.line for inst in instances]
        if all(lines) or all(inst.HasField("line") for inst in instances):
            return UnparsedLines(lines)
    columns = InstanceColumns(len(instances))
    for r, inst in enumerate(instances):
        kind = inst.WhichOneof("features")
        if kind == "line":
            columns.add_line(r, inst.line)
        elif kind == "slots":
            if not inst.slots.slots and not inst.slots.dense:
                raise InstanceError(f'instance {r}: "slots" must name at least one slot')
            # Map keys are uint32 here, any decimal string in JSON: both end at the grammar's slot bound.
            for slot in (*inst.slots.slots, *inst.slots.dense):
                if slot >= SLOT_LIMIT:
                    raise InstanceError(f"instance {r}: unknown slot {str(slot)!r}; {slot_too_long(str(slot))}")
            for slot, values in sorted(inst.slots.slots.items()):
                columns.add_slot(r, slot, list(values.feasigns))  # uint64 already: nothing else to check
            for slot, value in sorted(inst.slots.dense.items()):
                if not math.isfinite(value):  # a double may be NaN or infinite; JSON cannot say either
                    raise InstanceError(f"instance {r} slot {slot}: dense value {value!r} is not a finite number")
                columns.add_slot(r, slot, [], [value])
        else:
            raise InstanceError(f'instance {r} is empty: give "line" or "slots"')
    return columns.build()


class GrpcFrontend(Frontend):
    name = "grpc"

    def __init__(self, app: ServingApp, *, host: str, port: int):
        super().__init__(app)
        self.host, self.port = host, port
        self._server: grpc.aio.Server | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._grace = 5.0
        self.health = _Health(app)
        self.address: str | None = None

    # answers from batch workers -> this loop
    def deliver(self, items: list[tuple[Job, Outcome]]) -> None:
        self.loop.call_soon_threadsafe(_resolve_all, items)

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> GrpcFrontend:
        ready = threading.Event()
        errors: list[BaseException] = []

        def run():
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self.loop = loop
            try:
                loop.run_until_complete(self._start())
            except BaseException as e:  # noqa: BLE001 - reported to start()
                errors.append(e)
                ready.set()
                return
            ready.set()
            loop.run_until_complete(self._serve_until_stopped())
            loop.close()

        self._thread = threading.Thread(target=run, name="serving-grpc", daemon=True)
        self._thread.start()
        ready.wait()
        if errors:
            raise errors[0]
        return self

    async def _start(self) -> None:
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
            ]
        )
        _add_prediction_service(_PredictionServicer(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
        )
        bound = server.add_insecure_port(f"{self.host}:{self.port}")
        if bound == 0:
            raise OSError(f"gRPC cannot listen on {self.host}:{self.port}")
        self.port = bound
        self.address = f"{self.host}:{bound}"
        await self._update_health()
        await server.start()
        self._server = server

    async def _update_health(self) -> None:
        ready, _ = self.app.readiness()
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", SERVICE):
            await self.health.set(service, status)

    async def _serve_until_stopped(self) -> None:
        while not self._stopped.is_set():
            await self._update_health()
            await asyncio.sleep(0.2)
        await self.health.enter_graceful_shutdown()
        await self._server.stop(self._grace)

    def stop(self, grace: float = 5.0) -> None:
        """Stop taking calls; answer the ones in flight (up to ``grace`` seconds), then close."""
        self._grace = grace
        self._stopped.set()
        if self._thread:
            self._thread.join(grace + 5)


class _Health(HealthServicer):
    """grpc.health.v1.Health: Check answers from serving's readiness at the moment of the call; Watch
    streams the changes (the status is refreshed every 0.2 s)."""

    def __init__(self, app: ServingApp):
        super().__init__()
        self.app = app

    async def Check(self, request, context):
        if request.service not in ("", SERVICE):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        ready, _ = self.app.readiness()
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)


def _resolve_all(items) -> None:
    for job, outcome in items:
        fut = job.context
        if not fut.done():
            fut.set_result(outcome)


class _PredictionServicer(serving_pb2_grpc.PredictionServicer):
    def __init__(self, frontend: GrpcFrontend):
        self.frontend = frontend
        self.app = frontend.app

    async def Predict(self, request, context):
        started = time.perf_counter()
        app = self.app
        if request.__class__ is _Malformed:
            app.metrics.observe_request(400, time.perf_counter() - started)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            parsed = PredictRequest(
                parse_proto_instances(request.instances, defer_lines=True),
                routing_key_of(request.routing_key),
                arm_of(request.arm),
            )
        except InstanceError as e:
            app.metrics.observe_request(e.status, time.perf_counter() - started)
            await context.abort(STATUS_CODES[e.status], str(e))
        if app.active is None:  # while draining, calls still reaching us are answered
            refusal = app.not_ready()
            app.metrics.observe_request(refusal.status, time.perf_counter() - started)
            await context.abort(grpc.StatusCode.UNAVAILABLE, refusal.message)
        fut = asyncio.get_running_loop().create_future()
        self.frontend.submit(Job(parsed, self.frontend, fut, started))
        outcome = await fut
        if isinstance(outcome, Answer):
            return outcome  # written as a PredictResponse by the method's serializer (grpc_reply.py)
        await context.abort(STATUS_CODES.get(outcome.status, grpc.StatusCode.INTERNAL), outcome.message)

    async def Feedback(self, request, context):
        if request.__class__ is _Malformed:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        if len(request.events) > MAX_FEEDBACK_EVENTS:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"{len(request.events)} events; at most {MAX_FEEDBACK_EVENTS}"
            )
        result = self.app.feedback([(e.request_id, e.index, e.click) for e in request.events])
        return serving_pb2.FeedbackResponse(**result)
