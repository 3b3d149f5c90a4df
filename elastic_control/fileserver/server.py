"""The file server process: streams bodies to and from disk on the one HTTP layer.

Uploads (a streamed route: the body is read from the socket while it is
written, never held in memory) go to a staging file while their sha256 is
computed, are fsynced, checked against ``X-Content-Sha256`` when the client
sent one, and only then renamed over the target: a reader sees the old file
or the new one, never a part, and an upload cut off mid-body leaves the
previous file intact. Two concurrent uploads of one path each stage their own
file; the last rename wins whole. Downloads are sent with sendfile.

Reads of ``cube/`` (shards, manifests, dense models, current.json) are open;
every other read (``config/`` holds data.config and its credentials) and every
write needs the token, checked before any body byte is read. A folder listing
leaves out symlinks whose target lies outside the tree being listed (``cube/``
for the open listing): the open listing never shows what lies behind a link
into ``config/`` or elsewhere on the host.

A cube version in use cannot be deleted (409 naming the version and why): the
one ``cube/current.json`` names, the versions of its ``chain.json`` (a delta's
ancestors) and those pinned in ``cube/pins.json`` with their chains. Deleting
it would leave serving answering with a version no new replica can download.
If current.json or pins.json cannot be read, no version folder is deleted.

With ``kept_logs`` (a folder: in a cluster the shared claim's logs/, mounted
read-only), ``logs/...`` is that folder, not the root's: the training pods'
kept logs (ctr_foundation/log_keeper.py), read with the token and never written.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ctr_foundation import names
from ctr_foundation.errors import DataError
from ctr_foundation.http_messages import FileBody, HttpError, Request, Response
from ctr_foundation.http_protocol import STREAM, THREAD, Route
from ctr_foundation.http_server import HttpLimits, HttpServer
from ctr_foundation.records import CurrentVersion
from elastic_control.fileserver.paths import STAGING_DIR, UnsafePath, resolve_under_root, split_request_path

log = logging.getLogger("elastic_control.fileserver")

FILES_PREFIX = "/files/"
SHA_HEADER = "X-Content-Sha256"
CHUNK = 1 << 20
DEFAULT_MAX_BYTES = 8 << 30  # shards of a large table fit; a runaway upload does not fill the disk
DEFAULT_PORT = names.FILESERVER_PORT
LIMITS = HttpLimits(max_connections=512, threads=32, body_timeout=120.0, max_unfinished_bodies=64)
PINS_FILE = "pins.json"  # {"versions": [VERSION, ...]} in cube/ (cube-transfer and serving read it)
CHAIN_FILE = "chain.json"  # cube/VERSION/chain.json: {"chain": [{"version": ...}, ...]}


def _stat_key(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class ShaCache:
    """sha256 of served files by path, so GETs of large shards hash each file once.

    An entry is (the file's stat key, its digest) and is trusted only for the file
    that holds that path now: the server's own renames and deletes update the entry
    under the lock they happen in, so a freed inode reused by a later upload with
    the same size and timestamp tick can never inherit an old digest.
    """

    def __init__(self) -> None:
        self._entries: dict[str, tuple[tuple, str]] = {}
        self._lock = threading.Lock()

    def digest(self, path: Path, f) -> str:
        """sha256 of ``f``, the open file read from ``path``."""
        key = _stat_key(os.fstat(f.fileno()))
        with self._lock:
            known = self._entries.get(str(path))
        if known and known[0] == key:
            return known[1]
        h = hashlib.sha256()
        f.seek(0)
        for chunk in iter(lambda: f.read(CHUNK), b""):
            h.update(chunk)
        digest = h.hexdigest()
        with self._lock:
            # Remember it only if the path still names the file just hashed.
            with contextlib.suppress(FileNotFoundError):
                if _stat_key(os.stat(path)) == key:
                    self._entries[str(path)] = (key, digest)
        return digest

    def install(self, staged: str, target: Path, digest: str) -> None:
        """Rename ``staged`` over ``target`` and record its digest in one step."""
        with self._lock:
            os.replace(staged, target)
            try:  # keyed as the file is after the rename (a rename changes ctime on some file systems)
                self._entries[str(target)] = (_stat_key(os.stat(target)), digest)
            except FileNotFoundError:  # deleted meanwhile by hand: nothing to remember
                self._entries.pop(str(target), None)

    def forget_under(self, path: Path) -> None:
        prefix = str(path)
        with self._lock:
            for p in [p for p in self._entries if p == prefix or p.startswith(prefix + os.sep)]:
                del self._entries[p]


@dataclass
class FileServerConfig:
    root: Path
    token: str | None
    max_bytes: int = DEFAULT_MAX_BYTES
    sha: ShaCache = field(default_factory=ShaCache)
    kept_logs: Path | None = None  # served read-only as logs/ (the training pods' kept logs)


def _fs_errors(fn):
    """Map file-system errors of a handler onto statuses (a conflict is the client's, the rest ours)."""

    def wrapped(req: Request) -> Response:
        try:
            return fn(req)
        except UnsafePath as e:
            raise HttpError(400, f"refused path: {e}") from None
        except (NotADirectoryError, FileExistsError, IsADirectoryError) as e:
            # e.g. PUT a/b while a is a file: the path conflicts with what is there.
            raise HttpError(409, f"path conflicts with an existing file or folder: {e.strerror}") from None
        except (ConnectionError, TimeoutError):
            raise
        except OSError as e:
            if e.errno in (errno.ENAMETOOLONG, errno.ELOOP):  # the client's path, not our disk
                raise HttpError(400, f"refused path: {e.strerror}") from None
            if e.errno in (errno.ENOSPC, errno.EDQUOT):  # a full disk or quota: the upload was discarded
                log.error("%s %s: %s", req.method, req.path, e)
                raise HttpError(507, f"no space left on the file server's disk: {e.strerror}") from None
            log.error("%s %s: %s", req.method, req.path, e)
            raise HttpError(500, f"file system error: {e.strerror or e}") from None

    return wrapped


class FileServerApp:
    """Routes of the file server (``HttpServer`` app)."""

    def __init__(self, cfg: FileServerConfig):
        self.cfg = cfg
        # Held while a delete checks what is in use and deletes, and while current.json or pins.json is
        # replaced: a version cannot become current between the check and its deletion.
        self._use_lock = threading.Lock()
        self.health = Route(lambda req: Response.json({"status": "ok"}), mode=THREAD)
        self.read_open = Route(_fs_errors(self._get), mode=THREAD)
        self.read_private = Route(_fs_errors(self._get), mode=THREAD, token=True)
        self.put = Route(_fs_errors(self._put), mode=STREAM, token=True, max_body=cfg.max_bytes)
        self.delete = Route(_fs_errors(self._delete), mode=THREAD, token=True)

    # ---- routing (on the event loop, before any body byte is read) ------------------------
    def route(self, req: Request) -> Route:
        if req.raw_path == "/healthz":
            if req.method in ("GET", "HEAD"):
                return self.health
            raise HttpError(405, "use GET /healthz", headers={"Allow": "GET, HEAD"})
        if not req.raw_path.startswith(FILES_PREFIX):
            raise HttpError(404, f"unknown path {req.path!r}; files live under {FILES_PREFIX}")
        try:
            parts, _ = split_request_path(req.raw_path[len(FILES_PREFIX) :])
        except UnsafePath as e:
            raise HttpError(400, f"refused path: {e}") from None
        if req.method in ("GET", "HEAD"):
            return self.read_open if self._public(parts) else self.read_private
        if parts[:1] == [names.KEPT_LOGS_PREFIX]:
            raise HttpError(
                405, "kept logs are read-only here (the training pods write them)", headers={"Allow": "GET, HEAD"}
            )
        if req.method == "PUT":
            if req.content_length is None and not req.chunked:
                raise HttpError(411, "an upload needs Content-Length or chunked encoding", close=True)
            return self.put
        if req.method == "DELETE":
            return self.delete
        raise HttpError(
            405,
            f"{req.method} is not allowed; use GET, HEAD, PUT or DELETE",
            headers={"Allow": "GET, HEAD, PUT, DELETE"},
        )

    def _public(self, parts: list[str]) -> bool:
        """Readable without the token: inside a public folder, also once symlinks are resolved."""
        if not parts or parts[0] not in names.FILESERVER_PUBLIC_PREFIXES:
            return False
        real_root = os.path.realpath(self.cfg.root)
        top = os.path.realpath(os.path.join(real_root, parts[0]))
        real = os.path.realpath(os.path.join(real_root, *parts))
        return top == os.path.join(real_root, parts[0]) and (real == top or real.startswith(top + os.sep))

    def _target(self, req: Request) -> tuple[list[str], bool, Path]:
        parts, is_dir = split_request_path(req.raw_path[len(FILES_PREFIX) :])
        return parts, is_dir, resolve_under_root(self.cfg.root, parts)

    def _kept_logs_target(self, parts: list[str]) -> Path:
        if self.cfg.kept_logs is None:
            raise HttpError(404, "this file server keeps no logs (it runs without --kept-logs)")
        return resolve_under_root(self.cfg.kept_logs, parts[1:])

    # ---- handlers (thread pool) ------------------------------------------------------------
    def _get(self, req: Request) -> Response:
        parts, is_dir = split_request_path(req.raw_path[len(FILES_PREFIX) :])
        if parts[:1] == [names.KEPT_LOGS_PREFIX]:
            target = self._kept_logs_target(parts)
            real_root = tree = os.path.realpath(self.cfg.kept_logs)
        else:
            target = resolve_under_root(self.cfg.root, parts)
            real_root = os.path.realpath(self.cfg.root)
            tree = os.path.join(real_root, parts[0]) if self._public(parts) else real_root
        if target.is_dir():
            entries = []
            with os.scandir(target) as it:
                for e in sorted(it, key=lambda e: e.name):
                    if e.name == STAGING_DIR and not parts:
                        continue
                    if e.is_symlink() and not _inside(os.path.realpath(e.path), tree):
                        continue  # a link out of the listed tree: neither its target's kind nor its size
                    with contextlib.suppress(FileNotFoundError):
                        d = e.is_dir()
                        entries.append({"name": e.name, "size": 0 if d else e.stat().st_size, "is_dir": d})
            return Response.json({"path": "/".join(parts), "entries": entries})
        if is_dir or not target.is_file():
            raise HttpError(404, f"no such {'folder' if is_dir else 'file'}: {'/'.join(parts)}")
        try:
            f = open(target, "rb")
        except FileNotFoundError:
            raise HttpError(404, f"no such file: {'/'.join(parts)}") from None
        try:
            st = os.fstat(f.fileno())  # the open file: a concurrent rename cannot mix two versions
            sha = self.cfg.sha.digest(target, f)
        except BaseException:
            f.close()
            raise
        # The protocol sends the file (sendfile where it can) and closes it.
        return Response(200, FileBody(f, 0, st.st_size), "application/octet-stream", {SHA_HEADER: sha})

    def _put(self, req: Request) -> Response:
        parts, is_dir, target = self._target(req)
        if is_dir or not parts:
            raise HttpError(400, "PUT needs a file path, not a folder")
        if target.is_dir():
            raise HttpError(409, f"{'/'.join(parts)} is a folder")
        want_sha = req.headers.get(SHA_HEADER.lower(), "").strip().lower() or None
        staging = Path(os.path.realpath(self.cfg.root)) / STAGING_DIR
        staging.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix="upload-", dir=staging)
        try:
            h = hashlib.sha256()
            size = 0
            with os.fdopen(fd, "wb") as out:
                for piece in req.stream:
                    h.update(piece)
                    out.write(piece)
                    size += len(piece)
                out.flush()
                os.fsync(out.fileno())
            digest = h.hexdigest()
            if want_sha and want_sha != digest:
                raise HttpError(400, f"sha256 mismatch: header says {want_sha}, body is {digest}; nothing written")
            # Check again right before the rename: the folders may have changed meanwhile.
            target = resolve_under_root(self.cfg.root, parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            resolve_under_root(self.cfg.root, parts)
            if target.is_dir():
                raise HttpError(409, f"{'/'.join(parts)} is a folder")
            os.chmod(tmp, 0o644)
            if parts in ([names.CUBE_PREFIX, names.CURRENT_FILE], [names.CUBE_PREFIX, PINS_FILE]):
                with self._use_lock:
                    self.cfg.sha.install(tmp, target, digest)
            else:
                self.cfg.sha.install(tmp, target, digest)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        log.info("PUT %s (%d bytes)", "/".join(parts), size)
        return Response.json({"path": "/".join(parts), "size": size, "sha256": digest}, 201)

    def _delete(self, req: Request) -> Response:
        parts, _is_dir, target = self._target(req)
        if not parts:
            raise HttpError(400, "refusing to delete the root")
        with self._use_lock:
            self._refuse_if_in_use(parts, target)
            return self._delete_unlocked(parts, target)

    def _refuse_if_in_use(self, parts: list[str], target: Path) -> None:
        """409 if ``target`` is, holds or lies inside the folder of a cube version in use."""
        cube = os.path.join(os.path.realpath(self.cfg.root), names.CUBE_PREFIX)
        real = os.path.realpath(target)
        if not (_inside(real, cube) or _inside(cube, real)):
            return
        what = "/".join(parts)
        try:
            used = self._versions_in_use(cube)
        except DataError as e:
            rel = os.path.relpath(real, cube)
            if real == cube or not _inside(real, cube) or os.sep in rel or os.path.isdir(real):
                raise HttpError(
                    409, f"cannot tell which cube versions are in use ({e}): refusing to delete {what}"
                ) from None
            return  # a file directly in cube/ (current.json itself may be replaced or removed)
        for version, why in sorted(used.items()):
            folder = os.path.join(cube, version)
            if _inside(real, folder) or _inside(folder, real):
                raise HttpError(409, f"cube version {version} is in use ({why}): refusing to delete {what}")

    def _versions_in_use(self, cube: str) -> dict[str, str]:
        """version -> why it is in use; DataError if current.json or pins.json exists but cannot be read."""
        used: dict[str, str] = {}

        def with_chain(version: str, why: str) -> None:
            used.setdefault(version, why)
            try:
                doc = _read_json(os.path.join(cube, version, CHAIN_FILE))
            except DataError:
                return  # a base version without a readable chain: itself only
            chain = doc.get("chain") if isinstance(doc, dict) else None
            for item in chain if isinstance(chain, list) else ():
                v = item.get("version") if isinstance(item, dict) else None
                if isinstance(v, str) and v and v != version:
                    used.setdefault(v, f"the chain of {version}, {why}, needs it")

        current = _read_json(os.path.join(cube, names.CURRENT_FILE))
        if current is not None:
            record = CurrentVersion.from_json(current, f"{names.CUBE_PREFIX}/{names.CURRENT_FILE}")
            with_chain(record.version, f"named by {names.CUBE_PREFIX}/{names.CURRENT_FILE}")
        pins = _read_json(os.path.join(cube, PINS_FILE))
        if pins is not None:
            versions = pins.get("versions") if isinstance(pins, dict) else None
            if not isinstance(versions, list) or not all(isinstance(v, str) for v in versions):
                raise DataError(f'{names.CUBE_PREFIX}/{PINS_FILE} must be {{"versions": [VERSION, ...]}}')
            for v in versions:
                with_chain(v, f"pinned in {names.CUBE_PREFIX}/{PINS_FILE}")
        return used

    def _delete_unlocked(self, parts: list[str], target: Path) -> Response:
        self.cfg.sha.forget_under(target)
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.is_dir():
            # Move aside first, so readers never list a half-deleted folder.
            aside = Path(tempfile.mkdtemp(prefix="delete-", dir=Path(self.cfg.root) / STAGING_DIR))
            os.replace(target, aside / "x")
            shutil.rmtree(aside, ignore_errors=True)
        else:
            raise HttpError(404, f"no such file: {'/'.join(parts)}")
        log.info("DELETE %s", "/".join(parts))
        return Response.json({"path": "/".join(parts), "deleted": True})


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder + os.sep)


def _read_json(path: str):
    """The JSON document at ``path``, None if there is none; DataError if it cannot be read."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise DataError(f"{os.path.basename(path)}: {e}") from None


@contextlib.contextmanager
def fileserver_in_thread(
    root: str | os.PathLike, *, token: str | None, max_bytes: int = DEFAULT_MAX_BYTES, kept_logs=None
):
    """A file server for ``root`` on 127.0.0.1:0 in this process (tests, benchmarks); yields its base URL."""
    server = make_fileserver(root=root, host="127.0.0.1", port=0, token=token, max_bytes=max_bytes, kept_logs=kept_logs)
    server.start_in_thread()
    try:
        yield server.url
    finally:
        server.shutdown()
        server.server_close()


def make_fileserver(
    *,
    root: str | os.PathLike,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    token: str | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    limits: HttpLimits | None = None,
    kept_logs: str | os.PathLike | None = None,
) -> HttpServer:
    """Create (bind, not yet serve) a file server for ``root``; port 0 picks a free port; ``kept_logs``: a
    folder served read-only as logs/ (it need not exist yet: the first training pod creates it)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    staging = root / STAGING_DIR
    shutil.rmtree(staging, ignore_errors=True)  # uploads cut off by a previous crash
    staging.mkdir()
    cfg = FileServerConfig(
        root=root.resolve(),
        token=token or None,
        max_bytes=max_bytes,
        kept_logs=Path(kept_logs).resolve() if kept_logs else None,
    )
    return HttpServer(
        FileServerApp(cfg), host=host, port=port, token=cfg.token, name="file server", limits=limits or LIMITS
    )
