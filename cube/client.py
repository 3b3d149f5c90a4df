"""CubeClient: batched lookups across all cube shards, for serving and tests.

    client = CubeClient(["http://127.0.0.1:8027", "http://127.0.0.1:8028"])
    values, found, version = client.lookup(np.array([...], dtype=np.uint64))

Keys are grouped by shard (key % N), every shard is asked once, concurrently,
over keep-alive connections, and the answers are put back in input order.
Thread-safe: each call borrows connections from a per-shard pool.

Consistency: an un-pinned lookup that finds shards answering with different
versions (a rollout switching right now) is repeated pinned to the newest of
those versions, which every shard still holds (servers keep the prepared,
active and previous versions); so one call never mixes versions.
"""

from __future__ import annotations

import json
import queue
import socket
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote, urlsplit

import numpy as np

from ctr_foundation.errors import ComponentError, UsageError

DEFAULT_TIMEOUT = 5.0


class CubeUnavailableError(ComponentError):
    """A shard could not be reached or answered with an error."""


class CubeVersionError(CubeUnavailableError):
    """The pinned version is not held by a shard (HTTP 404)."""


class _ShardConnections:
    """A small pool of keep-alive HTTP/1.1 connections to one shard.

    A minimal client on purpose (serving's hot path: about one lookup per merged batch): the request is
    one ``sendall`` of head and body (http.client sends them in two, each a wake-up of the shard), with
    TCP_NODELAY, and the answer's head is split by hand (http.client parses it with the email package).
    Cube servers frame every answer with Content-Length (ctr_foundation.http_messages); anything else is
    an error naming the shard.
    """

    def __init__(self, url: str, timeout: float):
        u = urlsplit(url if "://" in url else f"http://{url}")
        if u.scheme != "http" or not u.hostname:
            raise UsageError(f"cube shard URL {url!r} must look like http://HOST:PORT")
        self.url, self.host, self.port, self.timeout = url, u.hostname, u.port or 80, timeout
        self._host_header = f"Host: {self.host}:{self.port}\r\n".encode()
        self.idle: queue.LifoQueue = queue.LifoQueue()

    def _connect(self) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def request(self, method: str, path: str, body: bytes = b"", headers: dict | None = None, timeout=None):
        """(status, headers with lower-case names, body); one retry on a fresh connection if a kept-alive one
        went stale. ``timeout`` (seconds, default the pool's) bounds each socket wait of this request."""
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        message = (
            f"{method} {path} HTTP/1.1\r\n".encode()
            + self._host_header
            + f"{extra}Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        for attempt in (0, 1):
            sock, reused = None, False
            if attempt == 0:  # the retry takes a fresh connection: the next idle one may have gone stale too
                try:
                    sock, reused = self.idle.get_nowait(), True
                except queue.Empty:
                    pass
            try:
                if sock is None:
                    sock = self._connect()
                sock.settimeout(self.timeout if timeout is None else timeout)
                sock.sendall(message)
                status, head, data, keep = _read_answer(sock, method)
            except (OSError, _BadAnswer) as e:
                if sock is not None:
                    sock.close()
                if reused and attempt == 0 and not isinstance(e, socket.timeout):
                    continue
                what = "timed out" if isinstance(e, socket.timeout) else f"unreachable ({e})"
                raise CubeUnavailableError(f"cube shard {self.url} {what}") from e
            if keep:
                self.idle.put(sock)
            else:
                sock.close()
            return status, head, data
        raise AssertionError("unreachable")

    def close(self) -> None:
        while True:
            try:
                self.idle.get_nowait().close()
            except queue.Empty:
                return


class _BadAnswer(Exception):
    """A shard's answer that is not HTTP/1.x framed by Content-Length (or the connection closed early)."""


MAX_ANSWER_HEAD = 64 << 10


def _read_answer(sock: socket.socket, method: str) -> tuple[int, dict, bytes, bool]:
    """(status, headers, body, keep-alive) of one answer read from ``sock``."""
    buf = bytearray()
    while True:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            break
        if len(buf) > MAX_ANSWER_HEAD:
            raise _BadAnswer(f"answer head longer than {MAX_ANSWER_HEAD} bytes")
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise _BadAnswer("connection closed before an answer" if not buf else "connection closed mid-answer")
        buf += chunk
    lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise _BadAnswer(f"not an HTTP answer: {lines[0][:80]!r}")
    head: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise _BadAnswer(f"bad header line {line[:80]!r}")
        head[name.strip().lower()] = value.strip()
    status = int(parts[1])
    if "transfer-encoding" in head or "content-length" not in head:
        if method == "HEAD" or status in (204, 304):
            return status, head, b"", head.get("connection", "").lower() != "close"
        raise _BadAnswer("answer not framed by Content-Length")
    length = int(head["content-length"]) if head["content-length"].isdigit() else -1
    if length < 0:
        raise _BadAnswer(f"bad Content-Length {head['content-length'][:40]!r}")
    body = buf[end + 4 :]
    while len(body) < length:
        chunk = sock.recv(max(1 << 16, length - len(body)))
        if not chunk:
            raise _BadAnswer("connection closed mid-answer")
        body += chunk
    if len(body) > length:
        raise _BadAnswer("more bytes than Content-Length")
    keep = parts[0] == "HTTP/1.1" and head.get("connection", "").lower() != "close"
    return status, head, bytes(body), keep


def _error_text(body: bytes) -> str:
    try:
        return json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return body[:200].decode("utf-8", "replace")


class CubeClient:
    """Lookups across N cube shards (``shard_urls`` in shard order)."""

    def __init__(self, shard_urls: list[str] | str, *, timeout: float = DEFAULT_TIMEOUT):
        if isinstance(shard_urls, str):
            shard_urls = [u.strip() for u in shard_urls.split(",") if u.strip()]
        if not shard_urls:
            raise UsageError("CubeClient needs at least one shard URL")
        self.shards = [_ShardConnections(u, timeout) for u in shard_urls]
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.shards)), thread_name_prefix="cube-client")

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        for s in self.shards:
            s.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def lookup_shard(self, i: int, keys: np.ndarray, version: str | None, *, timeout: float | None = None):
        """(values float32[n, dim], found bool[n], version) from shard ``i`` alone, for keys it holds (key % N == i)."""
        return self._lookup_shard(i, keys, version, timeout)

    def _lookup_shard(self, i: int, keys: np.ndarray, version: str | None, timeout: float | None = None):
        path = "/v1/lookup" + (f"?version={quote(version)}" if version else "")
        status, headers, body = self.shards[i].request(
            "POST",
            path,
            np.ascontiguousarray(keys, dtype="<u8").tobytes(),
            {"Content-Type": "application/octet-stream"},
            timeout,
        )
        if status == 404 and version:
            raise CubeVersionError(f"cube shard {self.shards[i].url}: {_error_text(body)}")
        if status != 200:
            raise CubeUnavailableError(f"cube shard {self.shards[i].url} answered {status}: {_error_text(body)}")
        n, dim = len(keys), int(headers["x-cube-dim"])
        if len(body) != n * dim * 4 + (n + 7) // 8:
            raise CubeUnavailableError(
                f"cube shard {self.shards[i].url}: answer of {len(body)} bytes does not fit {n} keys of dim {dim}"
            )
        values = np.frombuffer(body, dtype="<f4", count=n * dim).reshape(n, dim)
        found = np.unpackbits(np.frombuffer(body, np.uint8, offset=n * dim * 4), count=n, bitorder="little").astype(
            bool
        )
        return values, found, headers["x-cube-version"]

    def _lookup_once(self, keys: np.ndarray, version: str | None):
        n_shards = len(self.shards)
        if n_shards == 1 or len(keys) == 0:  # (no keys: still ask shard 0, to learn dim and version)
            return {0: (np.arange(len(keys)), self._lookup_shard(0, keys, version))}
        shard_of = keys % np.uint64(n_shards)
        groups = {i: np.flatnonzero(shard_of == i) for i in range(n_shards)}
        groups = {i: idx for i, idx in groups.items() if len(idx)}
        # the calling thread asks the last shard itself: a batch whose keys all live on one shard (a few cache
        # misses) costs no thread hand-off, and n shards cost n - 1 (each is a wake-up and a GIL switch)
        *others, (last, last_idx) = groups.items()
        futures = {i: self._pool.submit(self._lookup_shard, i, keys[idx], version) for i, idx in others}
        try:
            mine = self._lookup_shard(last, keys[last_idx], version)
        finally:
            parts = {i: (groups[i], f.result()) for i, f in futures.items()}  # (raises the first shard error)
        parts[last] = (last_idx, mine)
        return parts

    def lookup(self, keys, version: str | None = None) -> tuple[np.ndarray, np.ndarray, str]:
        """(values float32[n, dim], found bool[n], version) for uint64 ``keys``; missing keys are zeros."""
        keys = np.ascontiguousarray(keys, dtype=np.uint64).reshape(-1)
        parts = self._lookup_once(keys, version)
        versions = {res[2] for _, res in parts.values()}
        if len(versions) > 1:  # a switch is in progress: ask again, pinned to one version
            for pinned in sorted(versions, reverse=True):
                try:
                    parts = self._lookup_once(keys, pinned)
                    break
                except CubeVersionError:
                    continue
            versions = {res[2] for _, res in parts.values()}
            if len(versions) != 1:
                raise CubeUnavailableError(f"cube shards disagree on the version ({sorted(versions)})")
        dim = next(iter(parts.values()))[1][0].shape[1]
        values = np.zeros((len(keys), dim), dtype=np.float32)
        found = np.zeros(len(keys), dtype=bool)
        for idx, (v, f, _) in parts.values():
            values[idx] = v
            found[idx] = f
        return values, found, versions.pop()

    def status(self) -> list[dict]:
        """Every shard's /v1/status."""
        out = []
        for s in self.shards:
            status, _, body = s.request("GET", "/v1/status")
            if status != 200:
                raise CubeUnavailableError(f"cube shard {s.url} answered {status} to /v1/status")
            out.append(json.loads(body))
        return out
