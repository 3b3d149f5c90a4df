"""The one bearer-token check of every ElasticCTR server (file server, cube-server, cube-agent,
cube-transfer, serving) and the header its clients send.

Rule (docs/contracts.md, "HTTP rules"): a call that needs the token and has
no ``Authorization: Bearer <ELASTIC_CTR_TOKEN>``, or a wrong one, is a 401
(with ``WWW-Authenticate: Bearer``); a server started without a token refuses
every such call with 403 (it is read-only). The comparison takes the same time
whatever the token sent (digests compared with ``hmac.compare_digest``).

Through the Kubernetes API server's Service proxy (how the CLI reaches a
cluster's services: no port-forward), ``Authorization`` carries the user's
credentials for the API server, which removes it before proxying; the same
``Bearer <token>`` then travels in ``X-Elastic-Ctr-Authorization``, which a
server reads only when ``Authorization`` is absent.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

from ctr_foundation.http_messages import HttpError

SCHEME = "bearer"
PROXIED_HEADER = "X-Elastic-Ctr-Authorization"  # the token's header through the API server's Service proxy


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).digest()


def token_matches(headers: Mapping[str, str], token: str | None) -> bool:
    """True if ``headers`` (lower-case names) carry exactly ``Authorization: Bearer <token>`` (or, without
    Authorization, the same in X-Elastic-Ctr-Authorization)."""
    if not token:
        return False
    scheme, _, given = _sent(headers).partition(" ")
    given = given.strip()
    if scheme.lower() != SCHEME or not given:
        return False
    return hmac.compare_digest(_digest(given), _digest(token))


def check_bearer(headers: Mapping[str, str], token: str | None, name: str = "server") -> None:
    """Raise the HttpError (401 or 403) for a call that needs ``token``; return if it may proceed."""
    if not token:
        raise HttpError(
            403, f"{name}: this call needs the token, but the server runs without ELASTIC_CTR_TOKEN (read-only)"
        )
    if token_matches(headers, token):
        return
    sent = _sent(headers)
    if sent.partition(" ")[0].lower() != SCHEME:
        message, challenge = (
            "missing token: send 'Authorization: Bearer $ELASTIC_CTR_TOKEN'",
            'Bearer realm="elastic-ctr"',
        )
    else:
        message, challenge = "wrong bearer token", 'Bearer realm="elastic-ctr", error="invalid_token"'
    raise HttpError(401, f"{name}: {message}", headers={"WWW-Authenticate": challenge})


def _sent(headers: Mapping[str, str]) -> str:
    return (headers.get("authorization") or headers.get(PROXIED_HEADER.lower(), "")).strip()


def proxied_auth_headers(token: str | None) -> dict[str, str]:
    """The header a client sends with ``token`` through the API server's Service proxy."""
    return {PROXIED_HEADER: f"Bearer {token}"} if token else {}


def auth_headers(token: str | None) -> dict[str, str]:
    """The header a client sends with ``token`` (nothing without one)."""
    return {"Authorization": f"Bearer {token}"} if token else {}
