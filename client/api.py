"""The CTR client library: predictions from serving, configs to the file server.

``ServingClient.predict_lines`` sends slot-format lines in batches and yields
one probability per line, in order. A batch is retried on connection errors
and on 502/503/504 (serving restarting, cube briefly unreachable) until
``retry_for`` seconds have passed; predictions are pure, so a retry can never
duplicate a result, and a batch is yielded only once serving answered it, so
no line is reported done without its prediction.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import requests

from ctr_foundation.env_vars import FILESERVER_URL, SERVING_URL, TOKEN
from ctr_foundation.errors import ComponentError, UsageError
from ctr_foundation.names import REMOTE_DATA_CONFIG, REMOTE_SLOT_CONF, StateFolder
from ctr_foundation.records import ClientConfig

RETRYABLE_STATUS = {502, 503, 504}


class PredictionError(ComponentError):
    """Serving refused a batch (bad input) or stayed unavailable past the retry window."""


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
    *, state_dir: str | Path | None = None, serving_url: str | None = None, fileserver_url: str | None = None
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
        serving_grpc=saved.serving_grpc,
    )


def _check_url(url: str | None, what: str) -> str:
    if not url:
        raise UsageError(f"no {what} address: run `elastic-control -c` first, or pass --{what.replace(' ', '')} URL")
    if not url.startswith(("http://", "https://")):
        raise UsageError(f"{what} address {url!r} must start with http:// or https://")
    return url.rstrip("/")


class ServingClient:
    """Talks to serving's ``/v1/predict``; safe to use from one thread."""

    def __init__(self, url: str, *, timeout: float = 30.0, retry_for: float = 60.0):
        self.url = _check_url(url, "serving")
        self.timeout = timeout
        self.retry_for = retry_for
        self._session = requests.Session()
        self.retries = 0  # how many times a batch was re-sent (for logs and tests)

    def predict_instances(self, instances: Sequence[dict]) -> dict:
        """POST one batch; retry while serving is unreachable or 5xx-unavailable; return the answer."""
        body = json.dumps({"instances": list(instances)})
        deadline = time.monotonic() + self.retry_for
        delay = 0.05
        while True:
            reason = None
            try:
                r = self._session.post(
                    self.url + "/v1/predict",
                    data=body,
                    timeout=self.timeout,
                    headers={"Content-Type": "application/json"},
                )
                if r.status_code == 200:
                    answer = r.json()
                    if len(answer.get("predictions", ())) != len(instances):
                        raise PredictionError(
                            f"serving answered {len(answer.get('predictions', ()))} "
                            f"predictions for {len(instances)} instances"
                        )
                    return answer
                if r.status_code not in RETRYABLE_STATUS:
                    raise PredictionError(f"serving refused the batch (HTTP {r.status_code}): {_reason(r)}")
                reason = f"HTTP {r.status_code}: {_reason(r)}"
            except (requests.ConnectionError, requests.Timeout) as e:
                reason = f"{type(e).__name__}: {e}"
                self._session.close()  # drop a half-dead keep-alive connection
                self._session = requests.Session()
            if time.monotonic() + delay > deadline:
                raise PredictionError(f"serving at {self.url} unavailable for {self.retry_for:.0f}s: {reason}")
            self.retries += 1
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def predict_lines(
        self, lines: Iterable[str], *, batch_size: int = 64, first_line_number: int = 1
    ) -> Iterator[float]:
        """One probability per non-blank line, in order; blank lines are skipped."""
        if batch_size < 1:
            raise UsageError(f"--batch-size must be at least 1, got {batch_size}")
        batch: list[str] = []
        start = first_line_number
        number = first_line_number - 1
        for line in lines:
            number += 1
            line = line.strip()
            if not line:
                if not batch:
                    start = number + 1
                continue
            batch.append(line)
            if len(batch) >= batch_size:
                yield from self._predict_batch(batch, start)
                batch, start = [], number + 1
        if batch:
            yield from self._predict_batch(batch, start)

    def _predict_batch(self, batch: list[str], start: int) -> list[float]:
        try:
            answer = self.predict_instances([{"line": ln} for ln in batch])
        except PredictionError as e:
            raise PredictionError(f"batch starting at input line {start}: {e}") from e
        return [float(p) for p in answer["predictions"]]

    def health(self) -> dict:
        return _get_json(self.url + "/healthz", "serving")

    def status(self) -> dict:
        return _get_json(self.url + "/v1/status", "serving")


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
    from ctr_foundation.fileserver_client import FileServerClient
    from elastic_control.config import load_data_config, load_slot_conf

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
    from ctr_foundation.fileserver_client import FileServerClient

    out: dict[str, dict | str] = {}
    for name, url, probe in (
        ("serving", config.serving_url, lambda u: ServingClient(u).status()),
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
