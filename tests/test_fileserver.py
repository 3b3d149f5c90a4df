"""The file server, really listening on loopback: API, atomicity, token, size limit, no path escapes."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time

import pytest
import requests
from helpers_common import PYTHON, fileserver_in_thread, free_port, process, wait_healthy
from helpers_serving import raw_request, status_of

from ctr_foundation.fileserver_client import FileServerClient, FileServerError, NotFound
from elastic_control.fileserver.paths import STAGING_DIR

TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def served(tmp_path):
    root = tmp_path / "root"
    with fileserver_in_thread(root, token=TOKEN, max_bytes=4 << 20) as url:
        yield url, root


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def test_put_get_list_delete_roundtrip(served):
    url, root = served
    body = os.urandom(300_000)
    r = requests.put(f"{url}/files/cube/v1/shard-0.arrow", data=body, headers=AUTH)
    assert r.status_code == 201, r.text
    sha = hashlib.sha256(body).hexdigest()
    assert r.json() == {"path": "cube/v1/shard-0.arrow", "size": len(body), "sha256": sha}
    g = requests.get(f"{url}/files/cube/v1/shard-0.arrow")
    assert g.status_code == 200 and g.content == body
    assert g.headers["X-Content-Sha256"] == sha and int(g.headers["Content-Length"]) == len(body)
    h = requests.head(f"{url}/files/cube/v1/shard-0.arrow")
    assert h.status_code == 200 and h.headers["X-Content-Sha256"] == sha
    listing = requests.get(f"{url}/files/cube/").json()
    assert listing["entries"] == [{"name": "v1", "size": 0, "is_dir": True}]
    assert requests.get(f"{url}/files/cube/v1/").json()["entries"] == [
        {"name": "shard-0.arrow", "size": len(body), "is_dir": False}
    ]
    # The staging folder never shows in the root listing (which, outside cube/, needs the token).
    assert [e["name"] for e in requests.get(f"{url}/files/", headers=AUTH).json()["entries"]] == ["cube"]
    assert requests.delete(f"{url}/files/cube/v1/shard-0.arrow", headers=AUTH).status_code == 200
    assert requests.get(f"{url}/files/cube/v1/shard-0.arrow").status_code == 404
    assert requests.delete(f"{url}/files/cube/", headers=AUTH).status_code == 200
    assert not (root / "cube").exists()
    assert requests.get(f"{url}/healthz").json() == {"status": "ok"}


def test_client_library_roundtrip(served, tmp_path):
    url, _root = served
    c = FileServerClient(url, token=TOKEN)
    src = tmp_path / "src"
    (src / "dense").mkdir(parents=True)
    (src / "dense" / "inference.pdmodel").write_bytes(os.urandom(5000))
    (src / "meta.json").write_text('{"pass": "p"}')
    c.put_tree("cube/p", src)
    got = c.get_tree("cube/p", tmp_path / "dst")
    assert sorted(p.relative_to(tmp_path / "dst").as_posix() for p in got) == ["dense/inference.pdmodel", "meta.json"]
    assert (tmp_path / "dst/dense/inference.pdmodel").read_bytes() == (src / "dense/inference.pdmodel").read_bytes()
    assert c.get_json("cube/p/meta.json") == {"pass": "p"}
    assert c.exists("cube/p/meta.json") and not c.exists("cube/p/nope")
    with pytest.raises(NotFound):
        c.get_bytes("cube/p/nope")
    with pytest.raises(FileServerError, match="401|Bearer"):
        FileServerClient(url, token="").put_bytes("x", b"1")


def test_sha_mismatch_refused_and_previous_file_kept(served):
    url, root = served
    assert requests.put(f"{url}/files/a.txt", data=b"old", headers=AUTH).status_code == 201
    r = requests.put(f"{url}/files/a.txt", data=b"new", headers={**AUTH, "X-Content-Sha256": "0" * 64})
    assert r.status_code == 400 and "sha256 mismatch" in r.json()["error"]
    assert (root / "a.txt").read_bytes() == b"old"
    ok = requests.put(
        f"{url}/files/a.txt", data=b"new", headers={**AUTH, "X-Content-Sha256": hashlib.sha256(b"new").hexdigest()}
    )
    assert ok.status_code == 201 and (root / "a.txt").read_bytes() == b"new"


def test_writes_need_the_token(served, tmp_path):
    url, root = served
    assert requests.put(f"{url}/files/x", data=b"1").status_code == 401
    # A wrong token is a 401 too, on every server (docs/contracts.md, "HTTP rules").
    wrong = requests.put(f"{url}/files/x", data=b"1", headers={"Authorization": "Bearer nope"})
    assert (
        wrong.status_code == 401 and "wrong" in wrong.json()["error"] and "Bearer" in wrong.headers["WWW-Authenticate"]
    )
    assert requests.put(f"{url}/files/x", data=b"1", headers={"Authorization": "Basic dDB"}).status_code == 401
    assert not (root / "x").exists()
    assert requests.put(f"{url}/files/x", data=b"1", headers=AUTH).status_code == 201
    assert requests.delete(f"{url}/files/x").status_code == 401
    assert requests.delete(f"{url}/files/x", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert (root / "x").exists()
    # Reads outside cube/ need the token as well; cube/ is open.
    assert requests.get(f"{url}/files/x").status_code == 401
    assert requests.get(f"{url}/files/x", headers=AUTH).content == b"1"
    assert requests.put(f"{url}/files/cube/y", data=b"2", headers=AUTH).status_code == 201
    assert requests.get(f"{url}/files/cube/y").content == b"2"
    # A server started without a token refuses every write.
    with fileserver_in_thread(tmp_path / "ro", token=None) as ro:
        r = requests.put(f"{ro}/files/x", data=b"1", headers=AUTH)
        assert r.status_code == 403 and "ELASTIC_CTR_TOKEN" in r.json()["error"]


def test_expect_continue_refused_before_the_body(served):
    url, root = served
    reply = raw_request(
        port_of(url), b"PUT /files/big HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\nExpect: 100-continue\r\n\r\n"
    )
    assert status_of(reply) == 401 and not (root / "big").exists()


TRAVERSALS = [
    "/files/../outside.txt",
    "/files/a/../../outside.txt",
    "/files/%2e%2e/outside.txt",
    "/files/%2E%2E/outside.txt",
    "/files/a/%2e%2e/%2e%2e/outside.txt",
    "/files/..%2foutside.txt",
    "/files/a%2F..%2F..%2Foutside.txt",
    "/files/%2e%2e%2foutside.txt",
    "/files//etc/passwd",
    "/files/%2fetc/passwd",
    "/files/..\\outside.txt",
    "/files/a%5c..%5c..%5coutside.txt",
    "/files/a%00b",
    "/files/./a",
    "/files/%2e/a",
    "/files/" + STAGING_DIR + "/x",
    "/files/link_out/outside.txt",
    "/files/link_file",
    "/files/%ff%fe",
    "/files/" + "n" * 256,
    "/files/cube/" + "/".join(["d" * 200] * 6),
]


@pytest.fixture
def escape_setup(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "outside.txt").write_text("secret")
    (tmp_path / "outside.txt").write_text("secret")
    root = tmp_path / "root"
    root.mkdir()
    (root / "a").mkdir()
    os.symlink(outside, root / "link_out")
    os.symlink(outside / "outside.txt", root / "link_file")
    with fileserver_in_thread(root, token=TOKEN) as url:
        yield url, tmp_path


@pytest.mark.parametrize("path", TRAVERSALS)
@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
def test_no_path_escapes_the_root(escape_setup, path, method):
    url, tmp = escape_setup
    body = b"pwned"
    req = (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Length: {len(body) if method == 'PUT' else 0}\r\nConnection: close\r\n\r\n"
    ).encode()
    reply = raw_request(port_of(url), req + (body if method == "PUT" else b""))
    assert status_of(reply) in (400, 404), reply[:300]
    assert b"secret" not in reply
    assert (tmp / "outside.txt").read_text() == "secret"
    assert (tmp / "outside" / "outside.txt").read_text() == "secret"
    assert sorted(p.name for p in (tmp / "outside").iterdir()) == ["outside.txt"]
    assert not (tmp / "etc").exists()


def test_size_limit(served):
    url, root = served
    r = requests.put(f"{url}/files/big", data=b"x" * ((4 << 20) + 1), headers=AUTH)
    assert r.status_code == 413 and "size limit" in r.json()["error"]
    # Chunked bodies have no declared length: the limit applies while streaming.
    r = requests.put(f"{url}/files/big", data=iter([b"y" * (1 << 20)] * 5), headers=AUTH)
    assert r.status_code == 413
    assert not (root / "big").exists()
    r = requests.put(f"{url}/files/ok", data=iter([b"y" * 1000] * 3), headers=AUTH)
    assert r.status_code == 201 and (root / "ok").read_bytes() == b"y" * 3000
    assert requests.get(f"{url}/healthz").status_code == 200


def test_interrupted_upload_leaves_previous_file(served):
    url, root = served
    assert requests.put(f"{url}/files/shard", data=b"previous", headers=AUTH).status_code == 201
    s = socket.create_connection(("127.0.0.1", port_of(url)))
    s.sendall(
        f"PUT /files/shard HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Length: 1000000\r\n\r\n".encode()
        + b"z" * 400_000
    )
    time.sleep(0.2)
    s.close()  # the client dies mid-body
    deadline = time.monotonic() + 10
    while any((root / STAGING_DIR).iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list((root / STAGING_DIR).iterdir()) == []
    assert (root / "shard").read_bytes() == b"previous"
    assert requests.get(f"{url}/files/shard", headers=AUTH).content == b"previous"


def test_concurrent_uploads_of_one_path_end_whole(served):
    url, root = served
    bodies = [bytes([65 + i]) * (1 << 20) + os.urandom(1000) for i in range(8)]
    codes = []

    def upload(b):
        codes.append(requests.put(f"{url}/files/same", data=b, headers=AUTH).status_code)

    threads = [threading.Thread(target=upload, args=(b,)) for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert codes == [201] * 8
    final = (root / "same").read_bytes()
    assert final in bodies
    g = requests.get(f"{url}/files/same", headers=AUTH)
    assert g.headers["X-Content-Sha256"] == hashlib.sha256(final).hexdigest()
    assert list((root / STAGING_DIR).iterdir()) == []


def test_rewrites_of_equal_size_never_serve_an_old_digest(served):
    """Each upload frees the previous file's inode, which the next may reuse within one timestamp tick."""
    url, root = served
    for i in range(60):
        body = os.urandom(4096)
        assert requests.put(f"{url}/files/again", data=body, headers=AUTH).status_code == 201
        g = requests.get(f"{url}/files/again", headers=AUTH)
        assert g.content == body
        assert g.headers["X-Content-Sha256"] == hashlib.sha256(body).hexdigest(), f"upload {i}"
    requests.delete(f"{url}/files/again", headers=AUTH)
    assert requests.put(f"{url}/files/again", data=b"x" * 4096, headers=AUTH).status_code == 201
    g = requests.get(f"{url}/files/again", headers=AUTH)
    assert g.headers["X-Content-Sha256"] == hashlib.sha256(b"x" * 4096).hexdigest()


def test_errors_are_json_and_server_keeps_serving(served):
    url, _ = served
    assert requests.get(f"{url}/nothing").status_code == 404
    assert requests.get(f"{url}/files/missing", headers=AUTH).json()["error"].startswith("no such file")
    assert requests.get(f"{url}/files/cube/missing").json()["error"].startswith("no such file")
    assert requests.put(f"{url}/files/dir/", data=b"1", headers=AUTH).status_code == 400
    assert requests.put(f"{url}/files/d/f", data=b"1", headers=AUTH).status_code == 201
    assert requests.put(f"{url}/files/d", data=b"1", headers=AUTH).status_code == 409
    r = requests.put(f"{url}/files/d/f/g", data=b"1", headers=AUTH)  # d/f is a file
    assert r.status_code == 409 and "conflicts" in r.json()["error"]
    assert requests.delete(f"{url}/files/", headers=AUTH).status_code == 400
    assert requests.get(f"{url}/healthz").status_code == 200


@pytest.mark.e2e
def test_fileserver_command_runs_as_a_process(tmp_path):
    port = free_port()
    with process(
        [
            PYTHON,
            "-m",
            "elastic_control",
            "fileserver",
            "--root",
            str(tmp_path / "r"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        env_extra={"ELASTIC_CTR_TOKEN": TOKEN},
        log_path=tmp_path / "fs.log",
    ) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        assert requests.put(f"{url}/files/slot.conf", data=b"1\n2\n", headers=AUTH).status_code == 201
        assert (tmp_path / "r" / "slot.conf").read_bytes() == b"1\n2\n"


def test_large_files_stream_without_buffering(tmp_path):
    """A 64 MiB upload and download keep Python's allocations far below the file size."""
    import tracemalloc

    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        for _ in range(64):
            f.write(os.urandom(1 << 20))
    with fileserver_in_thread(tmp_path / "root", token=TOKEN) as url:
        c = FileServerClient(url, token=TOKEN)
        tracemalloc.start()
        try:
            c.put_file("cube/v/shard-0.arrow", big)
            c.get_file("cube/v/shard-0.arrow", tmp_path / "back.bin")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < 16 << 20, f"peak Python allocations {peak >> 20} MiB for a 64 MiB file"
    assert (tmp_path / "back.bin").read_bytes() == big.read_bytes()


@pytest.mark.needs_root
def test_a_full_disk_is_507_and_leaves_no_partial_file(tmp_path):
    from helpers_faults import tmpfs

    with tmpfs(tmp_path / "root", "1m") as root, fileserver_in_thread(root, token=TOKEN) as url:
        assert requests.put(f"{url}/files/cube/small.bin", data=b"x" * 1000, headers=AUTH).status_code == 201
        r = requests.put(f"{url}/files/cube/big.bin", data=os.urandom(2 << 20), headers=AUTH)
        assert r.status_code == 507 and "no space left" in r.json()["error"], (r.status_code, r.text)
        assert sorted(p.name for p in root.rglob("*") if p.is_file() and STAGING_DIR not in p.parts) == ["small.bin"]
        assert not any((root / STAGING_DIR).iterdir()) if (root / STAGING_DIR).exists() else True
        assert requests.get(f"{url}/files/cube/small.bin").content == b"x" * 1000


# ---- versions in use, and what the public listing shows ------------------------------------------


def _current(version: str) -> bytes:
    record = {"version": version, "pass": version, "shards": 1, "dim": 8, "slots": [1], "sparse_dim": None}
    return json.dumps({**record, "dense": f"cube/{version}/dense/"}).encode()


def test_a_version_in_use_cannot_be_deleted(served):
    """What cube/current.json names, the versions its chain needs and pinned versions answer 409 naming the
    version; nothing of them is deleted; a version nobody uses still can be."""
    url, root = served
    for v in ("v0", "v1", "v2", "v3"):
        assert requests.put(f"{url}/files/cube/{v}/shard-0.arrow", data=b"s", headers=AUTH).status_code == 201
    chain = {"version": "v2", "chain": [{"version": "v1"}, {"version": "v2"}]}
    puts = {
        "cube/current.json": _current("v2"),
        "cube/v2/chain.json": json.dumps(chain).encode(),
        "cube/pins.json": json.dumps({"versions": ["v0"]}).encode(),
    }
    for path, body in puts.items():
        assert requests.put(f"{url}/files/{path}", data=body, headers=AUTH).status_code == 201
    for path, version, why in (
        ("cube/v2/", "v2", "current.json"),
        ("cube/v2", "v2", "current.json"),
        ("cube/v2/shard-0.arrow", "v2", "current.json"),
        ("cube/", "v", "in use"),
        ("cube/v1/", "v1", "chain"),
        ("cube/v0/", "v0", "pins.json"),
    ):
        r = requests.delete(f"{url}/files/{path}", headers=AUTH)
        assert r.status_code == 409, (path, r.status_code, r.text)
        assert version in r.json()["error"] and why in r.json()["error"], (path, r.text)
    for v in ("v0", "v1", "v2"):
        assert (root / "cube" / v / "shard-0.arrow").read_bytes() == b"s"
    assert requests.delete(f"{url}/files/cube/v3/", headers=AUTH).status_code == 200
    assert not (root / "cube" / "v3").exists()
    # once current.json names another version, the old one may go
    assert requests.put(f"{url}/files/cube/current.json", data=_current("v0"), headers=AUTH).status_code == 201
    assert requests.delete(f"{url}/files/cube/v2/", headers=AUTH).status_code == 200


def test_an_unreadable_current_json_protects_every_version(served):
    url, root = served
    assert requests.put(f"{url}/files/cube/v1/shard-0.arrow", data=b"s", headers=AUTH).status_code == 201
    assert requests.put(f"{url}/files/cube/current.json", data=b"{not json", headers=AUTH).status_code == 201
    r = requests.delete(f"{url}/files/cube/v1/", headers=AUTH)
    assert r.status_code == 409 and "current.json" in r.json()["error"], r.text
    assert (root / "cube" / "v1" / "shard-0.arrow").exists()


def test_the_public_listing_does_not_follow_links_out_of_its_tree(served):
    url, root = served
    assert requests.put(f"{url}/files/cube/v1/shard-0.arrow", data=b"shard", headers=AUTH).status_code == 201
    secret = b'export HDFS_UGI="user,password"\n' * 100
    assert requests.put(f"{url}/files/config/data.config", data=secret, headers=AUTH).status_code == 201
    (root / "cube" / "to-config").symlink_to("../config/data.config")
    (root / "cube" / "to-config-dir").symlink_to("../config")
    (root / "cube" / "to-etc").symlink_to("/etc/hostname")
    (root / "cube" / "alias").symlink_to("v1")  # inside the tree: listed
    listing = requests.get(f"{url}/files/cube/").json()["entries"]
    names = {e["name"] for e in listing}
    assert names == {"alias", "v1"}, listing
    assert all(e["size"] != len(secret) for e in listing)
    assert requests.get(f"{url}/files/cube/to-config").status_code == 401  # reads behind such a link need the token
    private = {e["name"] for e in requests.get(f"{url}/files/", headers=AUTH).json()["entries"]}
    assert private == {"config", "cube"}
