"""``--split models:/NAME@challenger``: the alias resolved to its registered version's pass (MLflow REST)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest

from ctr_foundation.model_registry import CHALLENGER, RegistryError, pass_of_model_uri
from elastic_control.serving.arms import SplitError, split_from_flag

VERSIONS = {"7": "pass-20200101-05", "8": "pass-20200101-06"}
ALIASES = {CHALLENGER: "8"}


class _Registry(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        url = urlparse(self.path)
        q = {k: v[0] for k, v in parse_qs(url.query).items()}
        version = None
        if url.path.endswith("/registered-models/alias"):
            version = ALIASES.get(q.get("alias"))
        elif url.path.endswith("/model-versions/get"):
            version = q.get("version") if q.get("version") in VERSIONS else None
        if version is None or q.get("name") != "elastic-ctr":
            body, code = {"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "no such version"}, 404
        else:
            tags = [{"key": "pass", "value": VERSIONS[version]}]
            body, code = {"model_version": {"name": "elastic-ctr", "version": version, "tags": tags}}, 200
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_):
        pass


@pytest.fixture
def registry():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Registry)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_split_accepts_models_uri_of_the_challenger_alias(registry):
    resolve = lambda uri: pass_of_model_uri(registry, uri)  # noqa: E731
    split = split_from_flag("models:/elastic-ctr@challenger", resolve=resolve)
    assert [(a.name, a.weight, a.version) for a in split.arms] == [
        ("control", 90.0, None),
        ("challenger", 10.0, "pass-20200101-06"),
    ]
    split = split_from_flag("models:/elastic-ctr@challenger:25", resolve=resolve)
    assert split.challengers[0].weight == 25.0
    split = split_from_flag("b=models:/elastic-ctr/7:5", resolve=resolve)
    assert [(a.name, a.version) for a in split.challengers] == [("b", "pass-20200101-05")]


def test_a_models_uri_that_resolves_to_nothing_is_a_split_error(registry):
    resolve = lambda uri: pass_of_model_uri(registry, uri)  # noqa: E731
    with pytest.raises(SplitError, match="HTTP 404"):
        split_from_flag("models:/elastic-ctr@nobody", resolve=resolve)
    with pytest.raises(SplitError, match="needs an MLflow tracking server"):
        split_from_flag("models:/elastic-ctr@challenger")
    with pytest.raises(RegistryError, match="tracking server"):
        pass_of_model_uri(None, "models:/elastic-ctr@challenger")
