"""`status` on Kubernetes asks the pipeline's own services through the API server's Service proxy.

A fake API server (the real `kubernetes` client against the API paths) proxies
`services/NAME:PORT/proxy/PATH` to real cube-server processes and a real serving
on a pass trained on Criteo lines; cube-transfer has no endpoint, as when its pod
is not ready. `status` must show what those components say: the shards' versions,
serving's model and cube versions, its arms and live monitor, and explain the
missing transfer.
"""

from __future__ import annotations

import json

import pyarrow  # noqa: F401  (before paddle)

import pytest
import requests
from helpers_kube import render_plan
from helpers_kube_api import FakeKubeAPI
from helpers_serving import (  # noqa: F401  (served_fixture: the session's passes, fixture "served")
    cube_servers,
    fileserver_in_thread,
    publish_version,
    served_fixture,
    serving_in_thread,
)

from elastic_control.cli.status_view import print_status, print_status_json
from elastic_control.kube import adaptor
from elastic_control.kube.backend import KubeBackend
from elastic_control.serving.versions import FileServerSource

pytestmark = [pytest.mark.e2e, pytest.mark.needs_criteo]
JOB = "elastic-ctr"


def test_status_shows_what_cube_and_serving_answer_through_the_service_proxy(served, tmp_path, monkeypatch, capsys):
    fs_root = tmp_path / "fs"
    version = publish_version(fs_root, served.a, shards=2)
    with (
        FakeKubeAPI() as api,
        cube_servers(fs_root / "cube", 2, tmp_path) as shard_urls,
        fileserver_in_thread(fs_root) as fs_url,
        serving_in_thread(FileServerSource(fs_url, tmp_path / "cache", shard_urls)) as srv,
    ):
        monkeypatch.setenv("KUBECONFIG", str(api.write_kubeconfig(tmp_path / "kubeconfig")))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        monkeypatch.setenv("ELASTIC_CTR_APPLY_TIMEOUT", "30")
        adaptor.reset()
        try:
            plan, _ = render_plan(tmp_path / "state", cube_shards=2)
            KubeBackend().apply(plan).wait()
            api.service_backends.update(
                {
                    ("default", f"{JOB}-serving", "http"): srv.url,
                    ("default", f"{JOB}-cube-0", "cube"): shard_urls[0],
                    ("default", f"{JOB}-cube-1", "cube"): shard_urls[1],
                }
            )
            line = json.loads((served.a / "golden.jsonl").read_text().splitlines()[0])["line"]
            assert requests.post(f"{srv.url}/v1/predict", json={"instances": [{"line": line}]}).status_code == 200
            capsys.readouterr()
            status = KubeBackend().attach(plan).status()
        finally:
            adaptor.reset()
    direct = srv.app  # what serving itself reports, for comparison
    assert status.serving["version"] == version == status.serving["cube_version"] == direct.active.version
    assert status.serving["answers"] is True and status.serving["live"] is not None
    assert status.serving["arms"], status.serving
    assert [s["active"] for s in status.cube["shards"]] == [version, version] and status.cube["consistent"]
    serving_row = next(c for c in status.components if c.kind == "serving")
    assert serving_row.version == version
    # cube-transfer's Service has no endpoint here: said, not hidden.
    assert any("cube-transfer" in a and "no endpoints available" in a for a in status.alerts), status.alerts
    proxied = [path for method, path, _ in api.requests if "/proxy/" in path]
    assert f"/api/v1/namespaces/default/services/{JOB}-serving:http/proxy/v1/monitor" in proxied
    print_status(status)
    out = capsys.readouterr().out
    assert version in out
    print_status_json(status)
    doc = json.loads(capsys.readouterr().out)
    assert doc["serving"]["version"] == version and doc["cube"]["shards"][1]["active"] == version
