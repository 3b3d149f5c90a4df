"""A small client for the file server, used by cube-transfer, serving and the CTR client.

Uploads stream from disk with their sha256 (the server refuses a body that
does not match); downloads verify the ``X-Content-Sha256`` header and are
written atomically.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from urllib.parse import quote

import requests

from ctr_foundation.atomic import atomic_open
from ctr_foundation.env_vars import TOKEN
from ctr_foundation.errors import ComponentError, ElasticControlError
from ctr_foundation.http_auth import auth_headers

SHA_HEADER = "X-Content-Sha256"
CHUNK = 1 << 20


class FileServerError(ComponentError):
    """The file server refused a request or could not be reached."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class NotFound(FileServerError):
    """The file or folder does not exist on the file server."""


def sha256_of_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


class FileServerClient:
    """``FileServerClient("http://host:8080", token=...)``; the token defaults to ELASTIC_CTR_TOKEN.

    The token is sent with every request: writes need it, and so do reads of
    anything outside ``cube/`` (e.g. ``config/slot.conf``).
    """

    def __init__(self, base_url: str, token: str | None = None, timeout: float = 60.0):
        if not base_url.startswith(("http://", "https://")):
            raise ElasticControlError(f"file server URL {base_url!r} must start with http:// or https://")
        self.base_url = base_url.rstrip("/")
        self.token = token if token is not None else TOKEN.get()
        self.timeout = timeout
        self._session = requests.Session()

    def url(self, path: str) -> str:
        return f"{self.base_url}/files/{quote(path.lstrip('/'))}"

    def _auth(self) -> dict:
        return auth_headers(self.token)

    def _request(self, method: str, path: str, **kwargs) -> requests.Response:
        # The token goes with every request: writes need it, and so do reads outside cube/ (config/).
        kwargs["headers"] = {**self._auth(), **kwargs.get("headers", {})}
        try:
            r = self._session.request(method, self.url(path), timeout=self.timeout, **kwargs)
        except requests.RequestException as e:
            raise FileServerError(f"file server {self.base_url} unreachable: {e}") from e
        if r.status_code == 404:
            raise NotFound(f"{path}: not found on the file server {self.base_url}", 404)
        if r.status_code >= 400:
            try:
                reason = r.json().get("error", r.text)
            except ValueError:
                reason = r.text.strip()
            raise FileServerError(f"file server {method} {path}: HTTP {r.status_code}: {reason}", r.status_code)
        return r

    def put_bytes(self, path: str, data: bytes) -> dict:
        headers = {SHA_HEADER: hashlib.sha256(data).hexdigest(), **self._auth()}
        return self._request("PUT", path, data=data, headers=headers).json()

    def put_file(self, path: str, local: str | os.PathLike) -> dict:
        """Upload a local file (streamed, sha256 checked by the server)."""
        headers = {SHA_HEADER: sha256_of_file(local), **self._auth(), "Content-Length": str(os.path.getsize(local))}
        with open(local, "rb") as f:
            return self._request("PUT", path, data=f, headers=headers).json()

    def put_tree(self, prefix: str, local_dir: str | os.PathLike) -> list[dict]:
        """Upload every file under ``local_dir`` to ``prefix/RELATIVE``."""
        out = []
        local_dir = Path(local_dir)
        for p in sorted(local_dir.rglob("*")):
            if p.is_file():
                out.append(self.put_file(f"{prefix.rstrip('/')}/{p.relative_to(local_dir).as_posix()}", p))
        return out

    def get_bytes(self, path: str) -> bytes:
        r = self._request("GET", path)
        want = r.headers.get(SHA_HEADER)
        if want and hashlib.sha256(r.content).hexdigest() != want:
            raise FileServerError(f"{path}: sha256 of the download does not match the server's")
        return r.content

    def get_json(self, path: str):
        import json

        try:
            return json.loads(self.get_bytes(path))
        except ValueError as e:
            raise FileServerError(f"{path} on the file server is not valid JSON: {e}") from e

    def get_file(self, path: str, local: str | os.PathLike) -> str:
        """Download to ``local`` atomically, verifying sha256; returns the sha256."""
        r = self._request("GET", path, stream=True)
        want = r.headers.get(SHA_HEADER)
        h = hashlib.sha256()
        try:
            with atomic_open(local, "wb") as f:
                for chunk in r.iter_content(CHUNK):
                    h.update(chunk)
                    f.write(chunk)
                if want and h.hexdigest() != want:
                    raise FileServerError(f"{path}: sha256 of the download does not match the server's")
        except requests.RequestException as e:
            raise FileServerError(f"{path}: download interrupted: {e}") from e
        finally:
            r.close()
        return h.hexdigest()

    def get_tree(self, prefix: str, local_dir: str | os.PathLike) -> list[Path]:
        """Download every file under folder ``prefix`` into ``local_dir`` (recursively)."""
        got = []
        for entry in self.list(prefix):
            rel = f"{prefix.rstrip('/')}/{entry['name']}"
            dest = Path(local_dir) / entry["name"]
            if entry["is_dir"]:
                got += self.get_tree(rel, dest)
            else:
                self.get_file(rel, dest)
                got.append(dest)
        return got

    def list(self, folder: str) -> list[dict]:
        folder = folder.strip("/")
        return self._request("GET", folder + "/" if folder else "").json()["entries"]

    def delete(self, path: str) -> None:
        self._request("DELETE", path, headers=self._auth())

    def exists(self, path: str) -> bool:
        try:
            self._request("HEAD", path)
            return True
        except NotFound:
            return False

    def health(self) -> dict:
        try:
            r = self._session.get(self.base_url + "/healthz", timeout=self.timeout)
            r.raise_for_status()
            return r.json()
        except (requests.RequestException, ValueError) as e:
            raise FileServerError(f"file server {self.base_url} is not healthy: {e}") from e
