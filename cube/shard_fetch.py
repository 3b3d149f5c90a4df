"""What cube-agent fetches and how it installs it: chains of versions, URL policy, staging, local copies.

A prepare names a version and the *chain* that builds it: a base (a full
representation) and the deltas after it, oldest first, each with this shard's
files (name, size, sha256) and the file-server folder holding them
(``cube/VERSION/``, or ``cube/VERSION/compacted/`` for a compacted base).

Rules that keep the served data safe:
- Only the file server the agent was configured with is contacted, only under
  its ``cube/`` folder, without following redirects (``UrlPolicy``).
- Downloads go to ``DATA/.agent-staging/`` and are checked there (size, sha256,
  structure, version, shard, kind) before the whole version folder is swapped into
  ``DATA/VERSION/``; a refused download removes only its staging copy, so a
  refusal never deletes or changes a file that cube-server reads, and leaves no
  empty folder behind.
- Error messages name the file-server path and what did not match, never any of
  the fetched content (not even a digest prefix).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

import requests

from ctr_foundation import names
from ctr_foundation.atomic import atomic_write_json, replace_path
from ctr_foundation.errors import ComponentError, DataError, UsageError
from cube.shard_format import (
    MANIFEST,
    CorruptShardError,
    check_file,
    deleted_file_name,
    file_stamp,
    sha256_file,
    shard_file_name,
    valid_version_name,
)

STAGING = ".agent-staging"
CHUNK = 1 << 20
_SAFE_COMPONENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class PrepareRefused(CorruptShardError):
    """A download or local copy failed its checks; nothing the server reads was touched (422)."""


class VersionConflict(UsageError):
    """A prepare would change the content of a version the server holds (409): versions never change."""


@dataclass(frozen=True)
class FileSpec:
    name: str  # the local file name (shard-I.arrow / deleted-I.arrow)
    url: str
    sha256: str
    size: int | None


@dataclass(frozen=True)
class ChainItem:
    version: str
    kind: str  # "base" (a full representation) or "delta"
    parent: str | None
    files: tuple[FileSpec, ...]

    def manifest_files(self) -> dict:
        return {f.name: {"sha256": f.sha256, "size": f.size} for f in self.files}


class UrlPolicy:
    """URLs cube-agent may download: the configured file server's ``files/cube/...`` and nothing else."""

    def __init__(self, fileserver_url: str | None):
        self.base = fileserver_url.rstrip("/") if fileserver_url else None
        if self.base:
            u = urlsplit(self.base)
            if u.scheme not in ("http", "https") or not u.hostname or u.query or u.fragment:
                raise UsageError(f"--fileserver {fileserver_url!r} must look like http://HOST:PORT")
            self._origin = (u.scheme, (u.hostname or "").lower(), u.port or (443 if u.scheme == "https" else 80))
            self._prefix = f"{u.path.rstrip('/')}/files/{names.CUBE_PREFIX}/"

    def _require_base(self) -> str:
        if not self.base:
            raise UsageError(
                "cube-agent has no file server configured (--fileserver / ELASTIC_CTR_FILESERVER_URL): "
                "it downloads nothing"
            )
        return self.base

    def url_for(self, folder: str, name: str) -> str:
        """The URL of ``folder`` + ``name`` (folder = ``cube/VERSION/`` or ``cube/VERSION/compacted/``)."""
        return f"{self._require_base()}/files/{quote(folder + name)}"

    def check(self, url) -> str:
        """``url`` if it is under the file server's cube/ folder (no escapes, no query), else UsageError."""
        self._require_base()
        if not isinstance(url, str) or not url:
            raise UsageError("field 'url' must be a non-empty string")
        allowed = f"{self.base}/files/{names.CUBE_PREFIX}/..."
        refused = UsageError(f"refused to fetch {url[:200]!r}: only {allowed} is allowed")
        try:
            u = urlsplit(url)
            port = u.port or (443 if u.scheme == "https" else 80)
        except ValueError:
            raise refused from None
        if (u.scheme, (u.hostname or "").lower(), port) != self._origin or u.query or u.fragment or u.username:
            raise refused
        if not u.path.startswith(self._prefix) or "%" in u.path:
            raise refused
        parts = u.path[len(self._prefix) :].split("/")
        if len(parts) < 2 or not all(_SAFE_COMPONENT.match(p) for p in parts):
            raise refused
        return url


def _spec(raw, name: str, url: str) -> FileSpec:
    if not isinstance(raw, dict):
        raise UsageError(f"file {name!r}: expected an object with sha256 and size")
    sha, size = raw.get("sha256"), raw.get("size")
    if not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise UsageError(f"file {name!r}: 'sha256' must be 64 lower-case hex digits")
    if size is not None and (type(size) is not int or size < 0):
        raise UsageError(f"file {name!r}: 'size' must be a non-negative integer")
    return FileSpec(name, url, sha, size)


def parse_chain(raw_chain, shard: int, policy: UrlPolicy, target: str) -> list[ChainItem]:
    """This shard's part of a chain (oldest first), checked: a base, then deltas each on the one before."""
    if not isinstance(raw_chain, list) or not raw_chain or len(raw_chain) > 10_000:
        raise UsageError("'chain' must be a non-empty list of versions, oldest (a base) first")
    items: list[ChainItem] = []
    wanted = {"base": [shard_file_name(shard)], "delta": [shard_file_name(shard), deleted_file_name(shard)]}
    for n, raw in enumerate(raw_chain):
        if not isinstance(raw, dict):
            raise UsageError(f"chain[{n}] must be an object")
        version, kind, parent, folder = raw.get("version"), raw.get("kind"), raw.get("parent"), raw.get("path")
        if not valid_version_name(version):
            raise UsageError(f"chain[{n}]: 'version' {version!r} is not a valid version name")
        if kind not in wanted or (n == 0) != (kind == "base"):
            raise UsageError(f"chain[{n}] ({version}): the first item must be a base and every later one a delta")
        if kind == "delta" and parent != items[-1].version:
            raise UsageError(f"chain[{n}] ({version}): parent {parent!r} is not the item before it")
        allowed = (f"{names.CUBE_PREFIX}/{version}/", f"{names.CUBE_PREFIX}/{version}/compacted/")
        if folder not in allowed:
            raise UsageError(f"chain[{n}] ({version}): 'path' must be one of {list(allowed)}")
        files = raw.get("files")
        if not isinstance(files, dict):
            raise UsageError(f"chain[{n}] ({version}): 'files' must be an object")
        specs = []
        for name in wanted[kind]:
            if name not in files:
                raise UsageError(f"chain[{n}] ({version}): no {name} for shard {shard}")
            specs.append(_spec(files[name], name, policy.url_for(folder, name)))
        items.append(ChainItem(version, kind, parent if kind == "delta" else None, tuple(specs)))
    if items[-1].version != target:
        raise UsageError(f"the chain ends with {items[-1].version!r}, not the version {target!r} being prepared")
    return items


def parse_prepare(body: dict, shard: int, policy: UrlPolicy) -> tuple[str, list[ChainItem], bool]:
    """(version, chain, pin) of a prepare call; the one-file form ``{version, url, sha256, size?}`` is a base."""
    version = body.get("version")
    if not valid_version_name(version):
        raise UsageError("field 'version' must be a version name (letters, digits, '-', '_', '.')")
    pin = body.get("pin", False)
    if not isinstance(pin, bool):
        raise UsageError("field 'pin' must be true or false")
    if "chain" in body:
        return version, parse_chain(body["chain"], shard, policy, version), pin
    url = policy.check(body.get("url"))
    spec = _spec({"sha256": body.get("sha256"), "size": body.get("size")}, shard_file_name(shard), url)
    return version, [ChainItem(version, "base", None, (spec,))], pin


class LocalStore:
    """The agent's side of the data folder: local copies of versions and their manifests."""

    def __init__(self, data_dir: Path, shard: int, timeout: float):
        self.data_dir, self.shard, self.timeout = data_dir, shard, timeout
        self.staging = data_dir / STAGING
        self._verified: dict[Path, str] = {}  # file -> the stamp under which its sha256 last matched
        self._session = requests.Session()

    def clear_staging(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)

    def manifest(self, version: str) -> dict | None:
        try:
            obj = json.loads((self.data_dir / version / MANIFEST).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return obj if isinstance(obj, dict) and isinstance(obj.get("files"), dict) else None

    def versions(self) -> list[str]:
        """Local version folders holding this shard, oldest first."""
        if not self.data_dir.is_dir():
            return []
        return sorted(
            p.name
            for p in self.data_dir.iterdir()
            if p.is_dir() and not p.name.startswith(".") and (p / shard_file_name(self.shard)).exists()
        )

    def parent_of(self, version: str) -> str | None:
        m = self.manifest(version)
        return m.get("parent") if m and m.get("kind") == "delta" else None

    def _file_ok(self, path: Path, sha256: str, size: int | None) -> bool:
        try:
            stamp = file_stamp(path)
            if size is not None and path.stat().st_size != size:
                return False
        except OSError:
            return False
        if self._verified.get(path) == f"{stamp}:{sha256}":
            return True
        try:
            ok = sha256_file(path) == sha256
        except OSError:
            return False
        if ok:
            self._verified[path] = f"{stamp}:{sha256}"
        return ok

    def state_of(self, item: ChainItem) -> str:
        """``same`` (local copy is this item and verifies), ``damaged`` (is this item, but a file fails),
        ``different`` (another representation or content of the version), or ``absent``."""
        m = self.manifest(item.version)
        if m is None:
            return "absent"
        local = m["files"]
        same = m.get("kind", "base") == item.kind and all(
            isinstance(local.get(f.name), dict) and local[f.name].get("sha256") == f.sha256 for f in item.files
        )
        if not same:
            return "different"
        ok = all(self._file_ok(self.data_dir / item.version / f.name, f.sha256, f.size) for f in item.files)
        return "same" if ok else "damaged"

    def install(self, item: ChainItem) -> int:
        """Download, check and install one version's files of this shard; return the bytes downloaded."""
        self.staging.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=f"{item.version}.", dir=self.staging))
        try:
            got = 0
            rows = {}
            for spec in item.files:
                got += self._download(spec, stage / spec.name)
                rows[spec.name] = self._check(item, stage / spec.name)
            shard_meta = rows[shard_file_name(self.shard)]
            manifest = {
                "version": item.version,
                "kind": item.kind,
                "parent": item.parent,
                "shards": shard_meta["shards"],
                "dim": shard_meta["dim"],
                "rows": shard_meta["rows"],
                "files": {
                    f.name: {
                        "shard": self.shard,
                        "rows": rows[f.name]["rows"],
                        "size": (stage / f.name).stat().st_size,
                        "sha256": f.sha256,
                    }
                    for f in item.files
                },
                "local_copy_of": [f.url for f in item.files],
            }
            atomic_write_json(stage / MANIFEST, manifest)
            stage.chmod(0o755)  # mkdtemp makes it 0700; the server (same user) only reads it
            replace_path(stage, self.data_dir / item.version)
            for f in item.files:
                path = self.data_dir / item.version / f.name
                self._verified[path] = f"{file_stamp(path)}:{f.sha256}"
            return got
        finally:
            shutil.rmtree(stage, ignore_errors=True)

    def _download(self, spec: FileSpec, dest: Path) -> int:
        shown = unquote(urlsplit(spec.url).path).split("/files/", 1)[-1]
        h, got = hashlib.sha256(), 0
        try:
            with self._session.get(spec.url, stream=True, timeout=self.timeout, allow_redirects=False) as r:
                if r.status_code != 200:
                    raise ComponentError(f"download of {shown}: HTTP {r.status_code} from the file server")
                with open(dest, "wb") as f:
                    for chunk in r.iter_content(CHUNK):
                        got += len(chunk)
                        if spec.size is not None and got > spec.size:
                            raise PrepareRefused(f"download of {shown}: more than the expected {spec.size} bytes")
                        h.update(chunk)
                        f.write(chunk)
                    f.flush()
                    os.fsync(f.fileno())
        except requests.RequestException as e:
            raise ComponentError(f"download of {shown} failed: {type(e).__name__}") from e
        if spec.size is not None and got != spec.size:
            raise PrepareRefused(f"download of {shown}: {got} bytes, expected {spec.size} (truncated?)")
        if h.hexdigest() != spec.sha256:
            raise PrepareRefused(f"download of {shown}: its sha256 does not match the expected digest")
        return got

    def _check(self, item: ChainItem, path: Path) -> dict:
        """Structure, version, shard and kind of a downloaded file, before anything is installed."""
        try:
            meta = check_file(path)
        except CorruptShardError as e:
            raise PrepareRefused(f"{item.version}/{path.name}: {str(e).rsplit(': ', 1)[-1]}") from e
        want_kind = "delta" if (item.kind == "delta" and path.name.startswith("shard-")) else "base"
        problems = []
        if meta.get("version") != item.version:
            problems.append(f"holds version {meta.get('version')!r}")
        if meta.get("shard") != str(self.shard):
            problems.append(f"is shard {meta.get('shard')}")
        if path.name.startswith("shard-") and meta.get("kind", "base") != want_kind:
            problems.append(f"holds {meta.get('kind', 'base')} rows")
        if problems:
            raise PrepareRefused(
                f"{item.version}/{path.name} {' and '.join(problems)}; expected version {item.version!r} "
                f"shard {self.shard} ({item.kind})"
            )
        meta["shards"], meta["dim"] = int(meta.get("shards", 0)), int(meta.get("dim", 0) or 0)
        return meta

    def remove(self, version: str) -> None:
        with contextlib.suppress(OSError):
            shutil.rmtree(self.data_dir / version)


def chain_from_manifest(manifest: dict, version: str) -> list[dict]:
    """A one-item chain for a base version published without chain.json (before deltas existed)."""
    if manifest.get("kind", "base") != "base":
        raise DataError(f"{names.CUBE_PREFIX}/{version}/ is a delta version but has no chain.json")
    return [
        {
            "version": version,
            "kind": "base",
            "parent": None,
            "path": f"{names.CUBE_PREFIX}/{version}/",
            "files": manifest.get("files") or {},
        }
    ]
