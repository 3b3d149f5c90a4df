"""A local S3 endpoint over a folder: the few S3 calls a reader makes (HeadBucket, HeadObject,
GetObject with ranges, ListObjectsV2 with a delimiter), answered as S3 answers them.

``with LocalS3(root) as s3:`` serves ``root/BUCKET/KEY`` at ``s3.url`` (set AWS_ENDPOINT_URL to it);
``s3.requests`` records (method, path, query) for the tests. Signatures are not checked.
"""

from __future__ import annotations

import email.utils
import hashlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlparse
from xml.sax.saxutils import escape


class LocalS3:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.requests: list[tuple[str, str, dict]] = []

    def __enter__(self) -> LocalS3:
        s3 = self

        class Handler(_Handler):
            store = s3

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Handler(BaseHTTPRequestHandler):
    store: LocalS3
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _reply(self, code: int, body: bytes = b"", headers: dict | None = None, *, head: bool = False) -> None:
        self.send_response(code)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)) if not head else (headers or {}).get("Content-Length", "0"))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _error(self, code: int, name: str, head: bool = False) -> None:
        body = f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{name}</Code><Message>{name}</Message></Error>'
        self._reply(code, b"" if head else body.encode(), {"Content-Type": "application/xml"}, head=head)

    def _target(self) -> tuple[str, str, dict]:
        url = urlparse(self.path)
        parts = unquote(url.path).lstrip("/").split("/", 1)
        query = {k: v[0] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        self.store.requests.append((self.command, url.path, query))
        return parts[0], parts[1] if len(parts) > 1 else "", query

    def _object(self, path: Path, head: bool) -> None:
        data = path.read_bytes()
        headers = {
            "Content-Type": "application/octet-stream",
            "ETag": f'"{hashlib.md5(data).hexdigest()}"',  # noqa: S324 - what S3 calls an ETag
            "Last-Modified": email.utils.formatdate(path.stat().st_mtime, usegmt=True),
            "Accept-Ranges": "bytes",
        }
        wanted = self.headers.get("Range")
        if wanted and wanted.startswith("bytes="):
            start, _, end = wanted[6:].partition("-")
            first, last = int(start or 0), min(int(end) if end else len(data) - 1, len(data) - 1)
            headers["Content-Range"] = f"bytes {first}-{last}/{len(data)}"
            chunk = data[first : last + 1]
            headers["Content-Length"] = str(len(chunk))
            return self._reply(206, chunk, headers, head=head)
        headers["Content-Length"] = str(len(data))
        return self._reply(200, data, headers, head=head)

    def _list(self, bucket: str, query: dict) -> None:
        prefix, delimiter = query.get("prefix", ""), query.get("delimiter", "")
        base = self.store.root / bucket
        keys = sorted(str(p.relative_to(base)) for p in base.rglob("*") if p.is_file())
        contents, prefixes = [], []
        for key in keys:
            if not key.startswith(prefix):
                continue
            rest = key[len(prefix) :]
            if delimiter and delimiter in rest:
                common = prefix + rest.split(delimiter, 1)[0] + delimiter
                if common not in prefixes:
                    prefixes.append(common)
                continue
            contents.append(key)
        items = "".join(
            f"<Contents><Key>{escape(k)}</Key><Size>{(base / k).stat().st_size}</Size>"
            f"<LastModified>2026-01-01T00:00:00.000Z</LastModified><ETag>&quot;x&quot;</ETag>"
            "<StorageClass>STANDARD</StorageClass></Contents>"
            for k in contents
        )
        common = "".join(f"<CommonPrefixes><Prefix>{escape(p)}</Prefix></CommonPrefixes>" for p in prefixes)
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>'
            '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"<Name>{escape(bucket)}</Name><Prefix>{escape(prefix)}</Prefix><KeyCount>{len(contents) + len(prefixes)}"
            f"</KeyCount><MaxKeys>1000</MaxKeys><Delimiter>{escape(delimiter)}</Delimiter>"
            f"<IsTruncated>false</IsTruncated>{items}{common}</ListBucketResult>"
        )
        self._reply(200, body.encode(), {"Content-Type": "application/xml"})

    def _handle(self, head: bool) -> None:
        bucket, key, query = self._target()
        base = self.store.root / bucket
        if not base.is_dir():
            return self._error(404, "NoSuchBucket", head)
        if not key:
            if head:
                return self._reply(200, b"", {"Content-Length": "0"}, head=True)
            return self._list(bucket, query)
        path = base / key
        if path.is_file():
            return self._object(path, head)
        if key.endswith("/") and path.is_dir():  # a "directory marker" some clients probe
            return self._reply(200, b"", {"Content-Length": "0"}, head=head)
        return self._error(404, "NoSuchKey", head)

    def do_GET(self):
        self._handle(False)

    def do_HEAD(self):
        self._handle(True)


def s3_url(bucket: str, key: str) -> str:
    return f"s3://{bucket}/{quote(key)}"
