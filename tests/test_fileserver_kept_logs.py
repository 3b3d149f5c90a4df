"""The file server's logs/ tree: the training pods' kept logs (its --kept-logs folder, in a cluster the shared
claim mounted read-only), read with the token only, never written or deleted through it, no way out of it;
and the token as it arrives through the Kubernetes API server's Service proxy (X-Elastic-Ctr-Authorization)."""

from __future__ import annotations

import pytest
import requests
from helpers_common import fileserver_in_thread

TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROXIED = {"X-Elastic-Ctr-Authorization": f"Bearer {TOKEN}"}
LOG = "20261206T101500Z-trainer.log"


@pytest.fixture
def served(tmp_path):
    kept = tmp_path / "claim" / "logs"
    (kept / "job-trainer-0").mkdir(parents=True)
    (kept / "job-trainer-0" / LOG).write_text("pass 1 step 10\nMemoryError\n")
    (tmp_path / "claim" / "models").mkdir()
    (tmp_path / "claim" / "models" / "secret.txt").write_text("not for logs/")
    (kept / "job-trainer-0" / "escape").symlink_to(tmp_path / "claim" / "models")
    with fileserver_in_thread(tmp_path / "root", token=TOKEN, kept_logs=kept) as url:
        yield url, tmp_path


def test_kept_logs_are_listed_and_read_with_the_token(served):
    url, _ = served
    listing = requests.get(f"{url}/files/logs/job-trainer-0/", headers=AUTH)
    assert listing.status_code == 200
    assert [e["name"] for e in listing.json()["entries"]] == [LOG]  # the link out of the tree is not listed
    got = requests.get(f"{url}/files/logs/job-trainer-0/{LOG}", headers=AUTH)
    assert got.status_code == 200 and got.text == "pass 1 step 10\nMemoryError\n"


def test_kept_logs_need_the_token_also_through_the_api_servers_proxy(served):
    url, _ = served
    assert requests.get(f"{url}/files/logs/job-trainer-0/{LOG}").status_code == 401
    assert (
        requests.get(
            f"{url}/files/logs/job-trainer-0/{LOG}", headers={"X-Elastic-Ctr-Authorization": "Bearer no"}
        ).status_code
        == 401
    )
    assert requests.get(f"{url}/files/logs/job-trainer-0/{LOG}", headers=PROXIED).text.endswith("MemoryError\n")
    # Authorization, when present, is the one read (the header through the proxy never overrides it).
    wrong = {"Authorization": "Bearer no", **PROXIED}
    assert requests.get(f"{url}/files/logs/job-trainer-0/{LOG}", headers=wrong).status_code == 401


def test_kept_logs_are_read_only_and_stay_inside_their_folder(served):
    url, tmp_path = served
    for method in ("PUT", "DELETE"):
        r = requests.request(method, f"{url}/files/logs/job-trainer-0/{LOG}", data=b"x", headers=AUTH)
        assert r.status_code == 405 and "read-only" in r.json()["error"], (method, r.text)
    assert (tmp_path / "claim" / "logs" / "job-trainer-0" / LOG).read_text().endswith("MemoryError\n")
    assert requests.get(f"{url}/files/logs/job-trainer-0/escape/secret.txt", headers=AUTH).status_code == 400
    assert requests.get(f"{url}/files/logs/%2e%2e/models/secret.txt", headers=AUTH).status_code == 400


def test_without_kept_logs_the_tree_is_absent(tmp_path):
    with fileserver_in_thread(tmp_path / "root", token=TOKEN) as url:
        r = requests.get(f"{url}/files/logs/job-trainer-0/", headers=AUTH)
        assert r.status_code == 404 and "keeps no logs" in r.json()["error"]
