"""The CTR client library: predictions from serving (HTTP or gRPC), click feedback, configs to the file server.

``ServingClient`` (HTTP, ``/v1/predict``) and ``GrpcServingClient`` (gRPC, ``Prediction.Predict``) have
the same interface: ``predict_instances`` answers ``{"predictions", "request_id", "arm",
"model_version", "cube_version"}``; ``predict_lines`` sends slot-format lines in batches and yields one
probability per line, in order; ``feedback`` sends click outcomes of earlier predictions. A batch is
retried on connection errors and on 502/503/504 (gRPC: UNAVAILABLE, DEADLINE_EXCEEDED) while serving
restarts or cube is briefly unreachable, until ``retry_for`` seconds have passed; predictions are pure,
so a retry can never duplicate a result, and a batch is yielded only once serving answered it, so no
line is reported done without its prediction. ``serving_client(settings, transport)`` picks one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import requests

from ctr_foundation.env_vars import FILESERVER_URL, SERVING_GRPC, SERVING_URL, TOKEN
from ctr_foundation.errors import ComponentError, UsageError
from ctr_foundation.fileserver_client import FileServerClient
from ctr_foundation.names import REMOTE_DATA_CONFIG, REMOTE_SLOT_CONF, StateFolder
from ctr_foundation.records import ClientConfig
from elastic_control.config import load_data_config, load_slot_conf

RETRYABLE_STATUS = {502, 503, 504}


class PredictionError(ComponentError):
    """Serving refused a batch (bad input) or stayed unavailable past the retry window."""


class BatchRefused(PredictionError):
    """Serving refused a batch for what it holds (HTTP 400, gRPC INVALID_ARGUMENT): ``reason`` is serving's."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class ClientSettings:
    """What the client uses: flags, then environment variables, then ``client.json`` and the state's token."""

    serving_url: str | None
    fileserver_url: str | None
    slot_conf: str | None = None
    slots: tuple[int, ...] = ()
    token: str | None = None
    serving_grpc: str | None = None


def resolve_client_settings(
    *,
    state_dir: str | Path | None = None,
    serving_url: str | None = None,
    fileserver_url: str | None = None,
    serving_grpc: str | None = None,
) -> ClientSettings:
    """Flags first, then environment variables, then ``STATE_DIR/client.json`` (written by ``-c``)."""
    saved = None
    token = TOKEN.get()
    if state_dir is not None:
        folder = StateFolder(Path(state_dir))
        saved = ClientConfig.load(folder.client_config)
        if token is None and folder.token_file.exists():
            token = folder.token_file.read_text().strip() or None
    saved = saved or ClientConfig(None, None)
    return ClientSettings(
        serving_url=serving_url or SERVING_URL.get() or saved.serving_url,
        fileserver_url=fileserver_url or FILESERVER_URL.get() or saved.fileserver_url,
        slot_conf=saved.slot_conf,
        slots=saved.slots,
        token=token,
        serving_grpc=serving_grpc or SERVING_GRPC.get() or saved.serving_grpc,
    )


def _check_url(url: str | None, what: str) -> str:
    if not url:
        raise UsageError(f"no {what} address: run `elastic-control -c` first, or pass --{what.replace(' ', '')} URL")
    if not url.startswith(("http://", "https://")):
        raise UsageError(f"{what} address {url!r} must start with http:// or https://")
    return url.rstrip("/")


class _LinePredictor:
    """``predict_lines`` over any transport's ``predict_instances``."""

    def predict_instances(self, instances: Sequence[dict], *, routing_key: str | None = None) -> dict:
        raise NotImplementedError

    def predict_lines(
        self, lines: Iterable[str], *, batch_size: int = 64, first_line_number: int = 1
    ) -> Iterator[float]:
        """One probability per non-blank line, in order; blank lines are skipped. A line serving refuses
        raises PredictionError naming its input line number (``client.lines.predict_file_lines`` goes on
        past bad lines instead)."""
        # function-level: cycle (client.lines imports this module)
        from client.lines import predict_file_lines

        for result in predict_file_lines(
            self, lines, batch_size=batch_size, first_line_number=first_line_number, check_lines=False
        ):
            if not result.ok:
                raise PredictionError(f"input line {result.line}: {result.error}")
            yield result.probability

    def _retrying(self, attempt, what: str):
        """Run ``attempt()`` -> (answer, None) or (None, retryable reason) until it answers or time runs out."""
        deadline = time.monotonic() + self.retry_for
        delay = 0.05
        while True:
            answer, reason = attempt()
            if reason is None:
                return answer
            if time.monotonic() + delay > deadline:
                raise PredictionError(f"serving at {what} unavailable for {self.retry_for:.0f}s: {reason}")
            self.retries += 1
            time.sleep(delay)
            delay = min(delay * 2, 1.0)


class ServingClient(_LinePredictor):
    """Talks to serving's HTTP API (``/v1/predict``, ``/v1/feedback``); safe to use from one thread."""

    def __init__(self, url: str, *, timeout: float = 30.0, retry_for: float = 60.0):
        self.url = _check_url(url, "serving")
        self.timeout = timeout
        self.retry_for = retry_for
        self._session = requests.Session()
        self.retries = 0  # how many times a batch was re-sent (for logs and tests)

    def predict_instances(self, instances: Sequence[dict], *, routing_key: str | None = None) -> dict:
        """POST one batch; retry while serving is unreachable or 5xx-unavailable; return the answer."""
        payload: dict = {"instances": list(instances)}
        if routing_key is not None:
            payload["routing_key"] = routing_key
        body = json.dumps(payload)

        def attempt():
            try:
                r = self._session.post(
                    self.url + "/v1/predict",
                    data=body,
                    timeout=self.timeout,
                    headers={"Content-Type": "application/json"},
                )
            except (requests.ConnectionError, requests.Timeout) as e:
                self._session.close()  # drop a half-dead keep-alive connection
                self._session = requests.Session()
                return None, f"{type(e).__name__}: {e}"
            if r.status_code == 200:
                answer = r.json()
                if len(answer.get("predictions", ())) != len(instances):
                    raise PredictionError(
                        f"serving answered {len(answer.get('predictions', ()))} "
                        f"predictions for {len(instances)} instances"
                    )
                return answer, None
            if r.status_code == 400:
                reason = _reason(r)
                raise BatchRefused(f"serving refused the batch (HTTP 400): {reason}", reason)
            if r.status_code not in RETRYABLE_STATUS:
                raise PredictionError(f"serving refused the batch (HTTP {r.status_code}): {_reason(r)}")
            return None, f"HTTP {r.status_code}: {_reason(r)}"

        return self._retrying(attempt, self.url)

    def feedback(self, events: Sequence[dict]) -> dict:
        """POST click outcomes ``[{"request_id", "index", "click"}, ...]``; returns the join counts."""
        try:
            r = self._session.post(self.url + "/v1/feedback", json={"events": list(events)}, timeout=self.timeout)
        except requests.RequestException as e:
            raise PredictionError(f"serving at {self.url} is unreachable: {e}") from e
        if r.status_code != 200:
            raise PredictionError(f"serving refused the feedback (HTTP {r.status_code}): {_reason(r)}")
        return r.json()

    def health(self) -> dict:
        return _get_json(self.url + "/healthz", "serving")

    def status(self) -> dict:
        return _get_json(self.url + "/v1/status", "serving")

    def monitor(self) -> dict:
        return _get_json(self.url + "/v1/monitor", "serving")


class GrpcServingClient(_LinePredictor):
    """Talks to serving's gRPC API (``elasticctr.serving.v1.Prediction``) at ``HOST:PORT``."""

    RETRYABLE = ("UNAVAILABLE", "DEADLINE_EXCEEDED")

    def __init__(self, target: str, *, timeout: float = 30.0, retry_for: float = 60.0):
        import grpc

        # function-level: serving_pb2_grpc imports grpc (hundreds of ms)
        from ctr_foundation.grpc_api import serving_pb2, serving_pb2_grpc

        self.target = _check_target(target)
        self.timeout = timeout
        self.retry_for = retry_for
        self.retries = 0
        self._grpc, self._pb = grpc, serving_pb2
        self._channel = grpc.insecure_channel(self.target)
        self._stub = serving_pb2_grpc.PredictionStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def _instance(self, inst: dict):
        """A JSON-style instance as a proto Instance: in the ``slots`` form, unsigned integers (or strings of
        digits) are feasigns and any other number is a dense slot's value (``SlotFeatures.dense``); serving
        decides by the model's slot kinds, as for HTTP (an integer in a dense slot is its value too)."""
        pb = self._pb
        if "line" in inst:
            return pb.Instance(line=inst["line"])
        if "slots" in inst:
            slots, dense = {}, {}
            for slot, values in inst["slots"].items():
                try:
                    feasigns, numbers = _feasigns_and_numbers(values if isinstance(values, list) else [values])
                    if len(numbers) > 1:
                        raise ValueError(f"a dense slot takes one number, got {len(numbers)}")
                    if feasigns or not numbers:
                        slots[int(slot)] = pb.FeasignList(feasigns=feasigns)
                    if numbers:
                        dense[int(slot)] = numbers[0]
                except (TypeError, ValueError) as e:
                    raise PredictionError(f"slot {slot!r}: {e}") from e
            return pb.Instance(slots=pb.SlotFeatures(slots=slots, dense=dense))
        raise PredictionError('an instance is {"line": ...} or {"slots": {...}}')

    def predict_instances(self, instances: Sequence[dict], *, routing_key: str | None = None) -> dict:
        request = self._pb.PredictRequest(
            instances=[self._instance(i) for i in instances], routing_key=routing_key or ""
        )
        grpc = self._grpc

        def attempt():
            try:
                a = self._stub.Predict(request, timeout=self.timeout)
            except grpc.RpcError as e:
                code = e.code().name if e.code() else "UNKNOWN"
                if code == "INVALID_ARGUMENT":
                    reason = e.details() or ""
                    raise BatchRefused(f"serving refused the batch (gRPC {code}): {reason}", reason) from e
                if code not in self.RETRYABLE:
                    raise PredictionError(f"serving refused the batch (gRPC {code}): {e.details()}") from e
                return None, f"gRPC {code}: {e.details()}"
            if len(a.probabilities) != len(instances):
                raise PredictionError(f"serving answered {len(a.probabilities)} for {len(instances)} instances")
            return {
                "predictions": list(a.probabilities),
                "request_id": a.request_id,
                "arm": a.arm,
                "model_version": a.model_version,
                "cube_version": a.cube_version,
            }, None

        return self._retrying(attempt, self.target)

    def feedback(self, events: Sequence[dict]) -> dict:
        pb = self._pb
        try:
            request = pb.FeedbackRequest(
                events=[
                    pb.FeedbackEvent(request_id=e["request_id"], index=e["index"], click=e["click"]) for e in events
                ]
            )
            r = self._stub.Feedback(request, timeout=self.timeout)
        except (KeyError, TypeError, ValueError) as e:
            raise PredictionError(f"a feedback event needs request_id, index and click: {e}") from e
        except self._grpc.RpcError as e:
            raise PredictionError(f"serving refused the feedback (gRPC {e.code().name}): {e.details()}") from e
        return {"joined": r.joined, "unknown": r.unknown, "duplicate": r.duplicate, "invalid": r.invalid}

    def health(self) -> str:
        """The standard health service's answer for the prediction service: SERVING or NOT_SERVING."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        # function-level: only the gRPC client needs the gRPC API package; `elastic-control --help` stays free of it
        from ctr_foundation.grpc_api import SERVICE

        try:
            r = health_pb2_grpc.HealthStub(self._channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE), timeout=self.timeout
            )
        except self._grpc.RpcError as e:
            raise ComponentError(f"serving's gRPC at {self.target} is unreachable: {e.details()}") from e
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def _feasigns_and_numbers(values: list) -> tuple[list[int], list[float]]:
    """Split one slot's JSON values: unsigned 64-bit integers (or digit strings) are feasigns, other numbers
    (or decimal strings) a dense slot's value; serving checks what the model makes of them."""
    feasigns, numbers = [], []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float, str)):
            raise TypeError(f"{v!r} is not an integer feasign nor a number")
        if isinstance(v, str) and v.isascii() and v.isdigit():
            v = int(v)
        if isinstance(v, int) and 0 <= v < 1 << 64:
            feasigns.append(v)
        else:
            numbers.append(float(v))
    return feasigns, numbers


def _check_target(target: str | None) -> str:
    if not target:
        raise UsageError("no serving gRPC address: run `elastic-control -c` first, or pass --grpc HOST:PORT")
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or "/" in target:
        raise UsageError(f"serving gRPC address {target!r} must look like HOST:PORT")
    return target


def serving_client(settings: ClientSettings, *, transport: str = "http", retry_for: float = 60.0):
    """The client for ``transport`` (``http`` or ``grpc``) with the addresses ``settings`` resolved."""
    if transport == "grpc":
        return GrpcServingClient(settings.serving_grpc, retry_for=retry_for)
    if transport == "http":
        return ServingClient(settings.serving_url, retry_for=retry_for)
    raise UsageError(f"transport {transport!r}: use http or grpc")


def _reason(r: requests.Response) -> str:
    try:
        return str(r.json().get("error", r.text.strip()))
    except ValueError:
        return r.text.strip()[:300]


def _get_json(url: str, what: str) -> dict:
    try:
        r = requests.get(url, timeout=10)
    except requests.RequestException as e:
        raise ComponentError(f"{what} at {url} is unreachable: {e}") from e
    if r.status_code != 200:
        raise ComponentError(f"{what} at {url} answered HTTP {r.status_code}: {_reason(r)}")
    try:
        return r.json()
    except ValueError as e:
        raise ComponentError(f"{what} at {url} answered non-JSON") from e


def upload_configs(config: ClientConfig, *, slot_conf: str | None = None, data_config: str | None = None) -> list[dict]:
    """Validate then upload slot.conf and/or data.config to the file server (``config/...``)."""
    if not slot_conf and not data_config:
        raise UsageError("nothing to upload: give --slot-conf and/or --data-config")
    fs = FileServerClient(_check_url(config.fileserver_url, "file server"), token=config.token or "")
    done = []
    if slot_conf:
        load_slot_conf(slot_conf)  # refuse a broken file before anyone downloads it
        done.append(fs.put_file(REMOTE_SLOT_CONF, slot_conf))
    if data_config:
        load_data_config(data_config)
        done.append(fs.put_file(REMOTE_DATA_CONFIG, data_config))
    return done


def check_health(config: ClientConfig) -> dict[str, dict | str]:
    """Health of serving and the file server: {"serving": {...} or "error ...", ...}."""
    out: dict[str, dict | str] = {}
    for name, url, probe in (
        ("serving", config.serving_url, lambda u: ServingClient(u).status()),
        ("serving_grpc", getattr(config, "serving_grpc", None), lambda t: {"health": _grpc_health(t)}),
        ("fileserver", config.fileserver_url, lambda u: FileServerClient(u, token=config.token or "").health()),
    ):
        if not url:
            out[name] = "not configured"
            continue
        try:
            out[name] = probe(url)
        except Exception as e:  # noqa: BLE001 - health reports every failure as text
            out[name] = f"error: {e}"
    return out


def _grpc_health(target: str) -> str:
    client = GrpcServingClient(target, timeout=5)
    try:
        status = client.health()
    finally:
        client.close()
    if status != "SERVING":
        raise ComponentError(f"gRPC health says {status}")
    return status
