"""What the pipeline's own services say, asked through the API server's Service proxy.

`status` on Kubernetes reads the objects (kube/status.py) and, when it probes,
asks cube-transfer, every cube shard and serving for their JSON status through
``/api/v1/namespaces/NS/services/NAME:PORT/proxy/PATH``: the same rights and
kubeconfig as the rest of the CLI, no port-forward, and the call reaches one
ready pod of the Service (for serving: one replica's view). A Service without
ready pods, a timeout or an RBAC refusal is an answer too, recorded as the reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import urllib3

from ctr_foundation.http_auth import proxied_auth_headers
from elastic_control.kube import adaptor

TIMEOUT = 5.0


@dataclass(frozen=True)
class ServiceAnswer:
    body: dict | None  # the JSON the component answered, None when it did not
    reason: str = ""  # why there is no body


@dataclass(frozen=True)
class RawAnswer:
    data: bytes | None  # the body of a 2xx answer, None otherwise
    reason: str = ""  # why there is no body
    status: int | None = None  # the HTTP status, when there was an answer
    error_body: bytes = b""  # the body of an error answer (the component's, or the API server's Status)


def fetch(
    namespace: str,
    service: str,
    port: str,
    path: str,
    *,
    token: str | None = None,
    timeout: float = TIMEOUT,
    method: str = "GET",
    body: dict | None = None,
) -> RawAnswer:
    """``method`` ``path`` (with the JSON ``body``) of ``service``'s named ``port`` through the API server;
    ``token``: the pipeline's, sent in the header the API server passes on (it keeps Authorization for itself:
    ctr_foundation/http_auth.py)."""
    api = adaptor.api_client()
    headers = proxied_auth_headers(token)
    if body is not None:
        headers["Content-Type"] = "application/json"
    # The path is written out, not passed as a path parameter: the generated method would send its slashes
    # as %2F; and the answer is read raw: the generated method turns a JSON body into a dict's repr.
    verb, url, headers, payload, _post = api.param_serialize(
        method,
        f"/api/v1/namespaces/{namespace}/services/{service}:{port}/proxy/{path.lstrip('/')}",
        header_params=headers,
        body=body,
        auth_settings=["BearerToken"],
    )
    try:
        answer = api.call_api(verb, url, header_params=headers, body=payload, _request_timeout=timeout)
        answer.read()
    except adaptor.ApiException as e:
        reason = f"HTTP {e.status} through the API server: {adaptor.api_error_message(e)}"
        return RawAnswer(None, reason, e.status, (e.body or "").encode())
    except (urllib3.exceptions.HTTPError, OSError) as e:
        return RawAnswer(None, f"no answer through the API server ({type(e).__name__})")
    data = answer.data or b""
    if answer.status >= 400:
        message = adaptor.status_message(data.decode("utf-8", "replace"), answer.reason)
        return RawAnswer(None, f"HTTP {answer.status} through the API server: {message}", answer.status, data)
    return RawAnswer(data, status=answer.status)


def ask(
    namespace: str, service: str, port: str, path: str, timeout: float = TIMEOUT, *, token: str | None = None
) -> ServiceAnswer:
    """GET ``path`` of ``service``'s named ``port`` through the API server: its JSON object."""
    raw = fetch(namespace, service, port, path, token=token, timeout=timeout)
    if raw.data is None:
        return ServiceAnswer(None, raw.reason)
    text = raw.data.decode("utf-8", "replace")
    try:
        body = json.loads(text)
    except ValueError:
        return ServiceAnswer(None, "answered something that is not JSON")
    if not isinstance(body, dict):
        return ServiceAnswer(None, "answered JSON that is not an object")
    return ServiceAnswer(body)


def probe_pipeline(namespace: str, job: str, shards: int) -> tuple[dict, dict]:
    """(cube, serving) sections of the status document, as the local backend fills them."""
    transfer = ask(namespace, f"{job}-cube-transfer", "http", "/v1/status")
    t = transfer.body or {}
    shard_rows = []
    for i in range(shards):
        answer = ask(namespace, f"{job}-cube-{i}", "cube", "/v1/status")
        s = answer.body or {}
        shard_rows.append(
            {
                "shard": i,
                "name": f"{job}-cube-{i}",
                **{key: s.get(key) for key in ("active", "prepared", "previous")},
                "error": s.get("error") or answer.reason or None,
                "probed": answer.body is not None,
            }
        )
    probed = [s for s in shard_rows if s["probed"]]
    cube = {
        "active": t.get("active"),
        "shards": shard_rows,
        "consistent": len({s["active"] for s in probed}) <= 1 and len(probed) == len(shard_rows),
        "rollout": t.get("in_flight") or None,
        "transfer_error": t.get("last_error") or (transfer.reason or None),
    }
    status, monitor = (ask(namespace, f"{job}-serving", "http", path) for path in ("/v1/status", "/v1/monitor"))
    body = status.body or {}
    version = body.get("model_version")
    serving = {
        "version": version,
        "cube_version": body.get("cube_version"),
        "answers": bool(version) and status.body is not None,
        "reason": status.reason or ("" if version else "no model loaded yet"),
        "arms": body.get("arms") or (monitor.body or {}).get("arms"),
        "live": monitor.body,
        "metrics": body.get("metrics"),
        "last_reload_error": body.get("last_reload_error"),
    }
    return cube, serving


@dataclass(frozen=True)
class ProxiedService:
    """A Service of the pipeline reached through the API server (the CLI's way in: no port-forward), with
    the same ``request`` as a URL reached directly (elastic_control/cli/rollouts.py)."""

    namespace: str
    service: str
    port: str = "http"

    def __str__(self) -> str:
        return f"Service {self.namespace}/{self.service} (through the API server)"

    def request(
        self, method: str, path: str, *, token: str | None = None, body: dict | None = None, timeout: float = TIMEOUT
    ) -> tuple[int | None, dict | None, str]:
        """(HTTP status or None, the answer's JSON object or None, why there is none)."""
        raw = fetch(
            self.namespace, self.service, self.port, path, token=token, timeout=timeout, method=method, body=body
        )
        if raw.status is None:
            return None, None, raw.reason
        try:
            doc = json.loads(raw.data if raw.data is not None else raw.error_body)
        except ValueError:
            doc = None
        if not isinstance(doc, dict) or (raw.data is None and doc.get("kind") == "Status"):
            return raw.status, None, raw.reason or "answered something that is not a JSON object"
        return raw.status, doc, raw.reason
