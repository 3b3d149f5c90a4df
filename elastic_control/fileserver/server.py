"""The file server process: a threaded HTTP/1.1 server that streams bodies to and from disk.

Uploads are written to a staging file while their sha256 is computed, fsynced,
checked against ``X-Content-Sha256`` when the client sent one, and only then
renamed over the target: a reader sees the old file or the new one, never a
part, and an upload cut off mid-body leaves the previous file intact. Two
concurrent uploads of one path each stage their own file; the last rename wins
whole.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

from ctr_foundation import names
from elastic_control.fileserver.paths import STAGING_DIR, UnsafePath, resolve_under_root, split_request_path

log = logging.getLogger("elastic_control.fileserver")

FILES_PREFIX = "/files/"
SHA_HEADER = "X-Content-Sha256"
CHUNK = 1 << 20
DEFAULT_MAX_BYTES = 8 << 30  # shards of a large table fit; a runaway upload does not fill the disk
DEFAULT_PORT = names.FILESERVER_PORT
# An upload that stalls this long is abandoned (its staging file removed).
SOCKET_TIMEOUT_S = 120


class _RequestError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class FileServerConfig:
    root: Path
    token: str | None
    max_bytes: int = DEFAULT_MAX_BYTES
    # sha256 of files by (inode, size, mtime_ns): GETs of large shards hash each file once.
    sha_cache: dict = field(default_factory=dict)
    sha_lock: threading.Lock = field(default_factory=threading.Lock)


def _file_sha256(cfg: FileServerConfig, f, st: os.stat_result) -> str:
    """sha256 of the open file ``f``; files are only ever replaced, never edited, so the key is safe."""
    key = (st.st_ino, st.st_size, st.st_mtime_ns)
    with cfg.sha_lock:
        known = cfg.sha_cache.get(key)
    if known:
        return known
    h = hashlib.sha256()
    f.seek(0)
    for chunk in iter(lambda: f.read(CHUNK), b""):
        h.update(chunk)
    digest = h.hexdigest()
    with cfg.sha_lock:
        cfg.sha_cache[key] = digest
    return digest


class FileRequestHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "elastic-ctr-fileserver"
    timeout = SOCKET_TIMEOUT_S
    cfg: FileServerConfig  # set on the subclass made by make_server

    # ---- plumbing -------------------------------------------------------
    def log_message(self, fmt, *args):  # route through logging instead of raw stderr
        log.info("%s %s", self.address_string(), fmt % args)

    def log_request(self, code="-", size="-"):
        # Serving and the agents poll reads (cube/current.json twice a second):
        # keep routine reads out of the log; writes, deletes and errors stay.
        if self.command in ("GET", "HEAD") and str(getattr(code, "value", code)) in ("200", "304", "404"):
            log.debug('%s "%s" %s %s', self.address_string(), self.requestline, code, size)
            return
        super().log_request(code, size)

    def _send_json(self, status: int, obj: dict, *, close: bool = False) -> None:
        body = (json.dumps(obj) + "\n").encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, message: str, *, close: bool = False) -> None:
        self._send_json(status, {"error": message}, close=close)

    def _dispatch(self, method) -> None:
        try:
            method()
        except _RequestError as e:
            # A refused write whose body was never read cannot keep the connection.
            self._error(e.status, str(e), close=self.command in ("PUT", "POST"))
        except UnsafePath as e:
            self._error(HTTPStatus.BAD_REQUEST, f"refused path: {e}", close=self.command in ("PUT", "POST"))
        except (ConnectionError, TimeoutError) as e:
            log.warning("%s %s: connection lost: %s", self.command, self.path, e)
            self.close_connection = True
        except (NotADirectoryError, FileExistsError, IsADirectoryError) as e:
            # e.g. PUT a/b while a is a file: the path conflicts with what is there.
            self._error(
                HTTPStatus.CONFLICT,
                f"path conflicts with an existing file or folder: {e.strerror}",
                close=self.command == "PUT",
            )
        except OSError as e:
            log.error("%s %s: %s", self.command, self.path, e)
            self._error(
                HTTPStatus.INTERNAL_SERVER_ERROR, f"file system error: {e.strerror or e}", close=self.command == "PUT"
            )

    def _target(self) -> tuple[list[str], bool, Path]:
        path = urlsplit(self.path).path
        if not path.startswith(FILES_PREFIX):
            raise _RequestError(HTTPStatus.NOT_FOUND, f"unknown path {path!r}; files live under {FILES_PREFIX}")
        parts, is_dir = split_request_path(path[len(FILES_PREFIX) :])
        return parts, is_dir, resolve_under_root(self.cfg.root, parts)

    def _require_token(self) -> None:
        expected = self.cfg.token
        if not expected:
            raise _RequestError(HTTPStatus.FORBIDDEN, "writes are disabled: the server has no ELASTIC_CTR_TOKEN")
        given = self.headers.get("Authorization", "")
        if not given.startswith("Bearer "):
            raise _RequestError(HTTPStatus.UNAUTHORIZED, "writes need 'Authorization: Bearer <ELASTIC_CTR_TOKEN>'")
        if not hmac.compare_digest(given[len("Bearer ") :].strip().encode(), expected.encode()):
            raise _RequestError(HTTPStatus.FORBIDDEN, "wrong token")

    def _declared_length(self) -> int | None:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            return None
        raw = self.headers.get("Content-Length")
        if raw is None:
            raise _RequestError(HTTPStatus.LENGTH_REQUIRED, "an upload needs Content-Length or chunked encoding")
        try:
            n = int(raw)
            if n < 0:
                raise ValueError
        except ValueError:
            raise _RequestError(HTTPStatus.BAD_REQUEST, f"bad Content-Length {raw!r}") from None
        if n > self.cfg.max_bytes:
            raise _RequestError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"{n} bytes is over the size limit of {self.cfg.max_bytes} bytes"
            )
        return n

    def handle_expect_100(self):
        # Refuse before the client sends the body when we already know the answer.
        if self.command == "PUT":
            try:
                self._require_token()
                self._target()
                self._declared_length()
            except (_RequestError, UnsafePath) as e:
                status = e.status if isinstance(e, _RequestError) else HTTPStatus.BAD_REQUEST
                self._error(status, str(e), close=True)
                return False
        return super().handle_expect_100()

    # ---- body streaming -------------------------------------------------
    def _body_chunks(self, length: int | None):
        """Yield the request body in pieces; raise ConnectionError if it ends early."""
        if length is not None:
            left = length
            while left:
                piece = self.rfile.read(min(CHUNK, left))
                if not piece:
                    raise ConnectionError(f"upload ended after {length - left} of {length} bytes")
                left -= len(piece)
                yield piece
            return
        total = 0
        while True:  # chunked transfer encoding
            size_line = self.rfile.readline(1024)
            if not size_line:
                raise ConnectionError("upload ended inside chunked body")
            try:
                size = int(size_line.split(b";")[0].strip(), 16)
            except ValueError:
                raise _RequestError(HTTPStatus.BAD_REQUEST, "malformed chunked body") from None
            if size == 0:
                while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return
            total += size
            if total > self.cfg.max_bytes:
                raise _RequestError(
                    HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"upload is over the size limit of {self.cfg.max_bytes} bytes"
                )
            left = size
            while left:
                piece = self.rfile.read(min(CHUNK, left))
                if not piece:
                    raise ConnectionError("upload ended inside a chunk")
                left -= len(piece)
                yield piece
            self.rfile.readline(16)  # CRLF after the chunk

    # ---- methods --------------------------------------------------------
    def do_GET(self):
        self._dispatch(self._get)

    def do_HEAD(self):
        self._dispatch(self._get)

    def do_PUT(self):
        self._dispatch(self._put)

    def do_DELETE(self):
        self._dispatch(self._delete)

    def _get(self):
        if urlsplit(self.path).path == "/healthz":
            self._send_json(HTTPStatus.OK, {"status": "ok"})
            return
        parts, is_dir, target = self._target()
        if target.is_dir():
            entries = []
            with os.scandir(target) as it:
                for e in sorted(it, key=lambda e: e.name):
                    if e.name == STAGING_DIR and not parts:
                        continue
                    with contextlib.suppress(FileNotFoundError):
                        d = e.is_dir()
                        entries.append({"name": e.name, "size": 0 if d else e.stat().st_size, "is_dir": d})
            self._send_json(HTTPStatus.OK, {"path": "/".join(parts), "entries": entries})
            return
        if is_dir or not target.is_file():
            raise _RequestError(HTTPStatus.NOT_FOUND, f"no such {'folder' if is_dir else 'file'}: {'/'.join(parts)}")
        try:
            f = open(target, "rb")
        except FileNotFoundError:
            raise _RequestError(HTTPStatus.NOT_FOUND, f"no such file: {'/'.join(parts)}") from None
        with f:
            st = os.fstat(f.fileno())  # the open file: a concurrent rename cannot mix two versions
            sha = _file_sha256(self.cfg, f, st)
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(st.st_size))
            self.send_header(SHA_HEADER, sha)
            self.end_headers()
            if self.command == "HEAD":
                return
            f.seek(0)
            # The kernel copies file -> socket (sendfile) when it can: shards are large.
            self.connection.sendfile(f, 0, st.st_size)

    def _put(self):
        self._require_token()
        parts, is_dir, target = self._target()
        if is_dir or not parts:
            raise _RequestError(HTTPStatus.BAD_REQUEST, "PUT needs a file path, not a folder")
        if target.is_dir():
            raise _RequestError(HTTPStatus.CONFLICT, f"{'/'.join(parts)} is a folder")
        length = self._declared_length()
        want_sha = self.headers.get(SHA_HEADER, "").strip().lower() or None
        staging = Path(os.path.realpath(self.cfg.root)) / STAGING_DIR
        staging.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix="upload-", dir=staging)
        try:
            h = hashlib.sha256()
            size = 0
            with os.fdopen(fd, "wb") as out:
                for piece in self._body_chunks(length):
                    h.update(piece)
                    out.write(piece)
                    size += len(piece)
                out.flush()
                os.fsync(out.fileno())
            digest = h.hexdigest()
            if want_sha and want_sha != digest:
                raise _RequestError(
                    HTTPStatus.BAD_REQUEST,
                    f"sha256 mismatch: header says {want_sha}, body is {digest}; nothing written",
                )
            # Check again right before the rename: the folders may have changed meanwhile.
            target = resolve_under_root(self.cfg.root, parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            resolve_under_root(self.cfg.root, parts)
            if target.is_dir():
                raise _RequestError(HTTPStatus.CONFLICT, f"{'/'.join(parts)} is a folder")
            os.chmod(tmp, 0o644)
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        st = os.stat(target)
        with self.cfg.sha_lock:
            self.cfg.sha_cache[(st.st_ino, st.st_size, st.st_mtime_ns)] = digest
        self._send_json(HTTPStatus.CREATED, {"path": "/".join(parts), "size": size, "sha256": digest})

    def _delete(self):
        self._require_token()
        parts, _is_dir, target = self._target()
        if not parts:
            raise _RequestError(HTTPStatus.BAD_REQUEST, "refusing to delete the root")
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.is_dir():
            # Move aside first, so readers never list a half-deleted folder.
            aside = Path(tempfile.mkdtemp(prefix="delete-", dir=Path(self.cfg.root) / STAGING_DIR))
            os.replace(target, aside / "x")
            shutil.rmtree(aside, ignore_errors=True)
        else:
            raise _RequestError(HTTPStatus.NOT_FOUND, f"no such file: {'/'.join(parts)}")
        self._send_json(HTTPStatus.OK, {"path": "/".join(parts), "deleted": True})


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128


def make_fileserver(
    *,
    root: str | os.PathLike,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    token: str | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> ThreadingHTTPServer:
    """Create (bind, not yet serve) a file server for ``root``; port 0 picks a free port."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    staging = root / STAGING_DIR
    shutil.rmtree(staging, ignore_errors=True)  # uploads cut off by a previous crash
    staging.mkdir()
    cfg = FileServerConfig(root=root.resolve(), token=token or None, max_bytes=max_bytes)
    handler = type("BoundFileRequestHandler", (FileRequestHandler,), {"cfg": cfg})
    return _Server((host, port), handler)


def serve_in_thread(server: ThreadingHTTPServer) -> threading.Thread:
    """Run ``server`` in a daemon thread (tests, embedding); stop with server.shutdown()."""
    # A short poll interval makes shutdown() quick (tests start and stop many servers).
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="fileserver", daemon=True)
    t.start()
    return t
