"""Health probes of the local components, for ``status``: alive is not enough, each must answer.

A process can be alive and useless: SIGSTOPped (its port still accepts
connections, nothing answers), deadlocked, or up without the data it serves.
``probe_component`` looks at the process first (stopped or gone), then asks
the component's own endpoints within a short timeout, and says what it saw.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import psutil
import requests

from elastic_control.backends import status as st
from elastic_control.local.ports import LOOPBACK
from elastic_control.local.spec import ComponentSpec

PROBE_TIMEOUT = 2.0

# What each kind answers to (GET), the first one deciding readiness.
ENDPOINTS = {
    "mlflow": ("/health",),
    "fileserver": ("/healthz",),
    "cube-server": ("/healthz", "/v1/status"),
    "cube-agent": ("/healthz",),
    "cube-transfer": ("/healthz", "/v1/status"),
    "serving": ("/readyz", "/v1/status", "/v1/monitor"),
}


@dataclass
class Probe:
    """What one component showed: a state, why, and the JSON its endpoints answered."""

    state: str
    detail: str = ""
    answers: dict = field(default_factory=dict)  # endpoint path -> parsed JSON (dict) of a 2xx answer
    codes: dict = field(default_factory=dict)  # endpoint path -> HTTP status code


def process_state(pid: int | None) -> tuple[str | None, str]:
    """(HUNG or MISSING, why) when the process cannot answer at all; (None, '') when it runs."""
    if not pid:
        return st.MISSING, "no process"
    try:
        status = psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return st.MISSING, f"process {pid} is gone"
    except psutil.AccessDenied:
        return None, ""
    if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
        return st.HUNG, f"process {pid} is stopped (SIGSTOP?): it cannot answer; `kill -CONT {pid}` resumes it"
    if status == psutil.STATUS_ZOMBIE:
        return st.MISSING, f"process {pid} exited (zombie)"
    return None, ""


def _get(session: requests.Session, url: str, timeout: float) -> tuple[int | None, dict | None, str]:
    """(status code, JSON body or None, error) of one GET."""
    try:
        resp = session.get(url, timeout=timeout)
    except requests.Timeout:
        return None, None, f"no answer within {timeout:g}s"
    except requests.ConnectionError as e:
        refused = "refused" in str(e).lower()
        return None, None, "connection refused" if refused else f"cannot connect: {type(e).__name__}"
    except requests.RequestException as e:
        return None, None, str(e)
    try:
        body = resp.json()
    except ValueError:
        body = None
    return resp.status_code, body if isinstance(body, dict) else None, ""


def probe_component(spec: ComponentSpec, pid: int | None, *, timeout: float = PROBE_TIMEOUT) -> Probe:
    """Probe one running component: its process, then its endpoints (readiness first)."""
    dead, why = process_state(pid)
    if dead:
        return Probe(dead, why)
    paths = ENDPOINTS.get(spec.kind)
    if not paths or spec.port is None:
        return Probe(st.RUNNING, "process running")  # pservers and trainers: no endpoint to ask
    probe = Probe(st.RUNNING)
    with requests.Session() as session:
        for i, path in enumerate(paths):
            code, body, error = _get(session, f"http://{LOOPBACK}:{spec.port}{path}", timeout)
            if error:
                if i == 0:
                    # Alive but silent: a deadlock or a stopped worker; refused: not listening (yet).
                    state = st.HUNG if "no answer" in error else st.DEGRADED
                    # A SIGSTOP sent just before the first look takes effect only when the process is next
                    # scheduled: look again after the silence, so the stop and its remedy are named.
                    dead, why = process_state(pid)
                    return Probe(dead, why) if dead else Probe(state, f"{path}: {error}")
                continue
            probe.codes[path] = code
            if body is not None and 200 <= code < 300:
                probe.answers[path] = body
            if i == 0 and not 200 <= code < 300:
                probe.state = st.STARTING
                reason = (body or {}).get("error") or (body or {}).get("reason") or f"HTTP {code}"
                probe.detail = f"{path} answers {code}: {reason}"
    return probe
