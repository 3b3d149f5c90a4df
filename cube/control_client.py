"""JSON control calls between cube services (transfer -> agent -> server), with the token."""

from __future__ import annotations

import requests

from ctr_foundation.errors import ComponentError


class ControlCallError(ComponentError):
    """A control call failed: unreachable, timed out, or answered with an error status."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def call_json(
    method: str, url: str, body: dict | None = None, *, token: str | None = None, timeout: float = 30.0
) -> dict:
    """Send a JSON call and return the answer's JSON; raise ControlCallError naming the URL otherwise."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        r = requests.request(method, url, json=body, headers=headers, timeout=timeout)
    except requests.Timeout as e:
        raise ControlCallError(f"{method} {url} timed out after {timeout}s") from e
    except requests.RequestException as e:
        raise ControlCallError(f"{method} {url}: unreachable ({type(e).__name__})") from e
    try:
        obj = r.json()
    except ValueError:
        obj = {"error": r.text[:300]}
    if r.status_code >= 400:
        raise ControlCallError(f"{method} {url}: HTTP {r.status_code}: {obj.get('error', obj)}", r.status_code)
    return obj
