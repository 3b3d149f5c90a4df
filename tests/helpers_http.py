"""Raw HTTP for the HTTP-layer tests: send exact bytes, parse the answers strictly, measure a server's memory.

Nothing here goes through an HTTP client library: requests are sent as
written (bad framing included) and every byte that comes back is accounted
for, so a test sees exactly what a server answered.
"""

from __future__ import annotations

import re
import socket
import time

import psutil

_STATUS_LINE = re.compile(rb"HTTP/1\.1 ([1-5][0-9]{2}) [\x20-\x7e]*")
_HEADER = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+): ?([\x20-\x7e]*)")


class Answer:
    """One parsed response."""

    def __init__(self, status: int, headers: dict[str, str], body: bytes):
        self.status, self.headers, self.body = status, headers, body

    def __repr__(self) -> str:
        return f"Answer({self.status}, {self.body[:120]!r})"


def parse_answers(data: bytes, *, head_request: bool = False) -> list[Answer]:
    """Every response in ``data``, in order; AssertionError naming the fault if ``data`` is not only
    well-formed HTTP/1.1 responses (status line, CRLF headers, Content-Length, exactly that much body).

    ``head_request``: some of the requests were HEAD, so an answer may have no body whatever its length."""
    out: list[Answer] = []
    pos = 0
    while pos < len(data):
        end = data.find(b"\r\n\r\n", pos)
        assert end >= 0, f"answer {len(out)}: head without its blank line: {data[pos : pos + 200]!r}"
        lines = data[pos:end].split(b"\r\n")
        m = _STATUS_LINE.fullmatch(lines[0])
        assert m, f"answer {len(out)}: bad status line {lines[0][:100]!r}"
        status = int(m.group(1))
        headers = {}
        for line in lines[1:]:
            h = _HEADER.fullmatch(line)
            assert h, f"answer {len(out)}: bad header line {line[:100]!r}"
            headers[h.group(1).decode().lower()] = h.group(2).decode()
        pos = end + 4
        if status < 200:
            out.append(Answer(status, headers, b""))
            continue
        assert "content-length" in headers, f"answer {len(out)} ({status}) has no Content-Length: {headers}"
        n = int(headers["content-length"])
        if head_request and (pos == len(data) or data.startswith(b"HTTP/1.1 ", pos)):
            n = 0  # an answer to HEAD: the headers of a GET, no body
        body = data[pos : pos + n]
        assert len(body) == n, f"answer {len(out)} ({status}): {len(body)} body bytes of {n}"
        pos += n
        out.append(Answer(status, headers, body))
        if headers.get("connection", "").lower() == "close":
            assert pos == len(data), (
                f"{len(data) - pos} bytes after a Connection: close answer: {data[pos : pos + 80]!r}"
            )
    return out


def exchange(
    port: int, data: bytes, *, timeout: float = 10.0, half_close: bool = True, host: str = "127.0.0.1"
) -> bytes:
    """Send ``data`` on a new connection (then half-close), return every byte until the server closes."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        try:
            s.sendall(data)
            if half_close:
                s.shutdown(socket.SHUT_WR)
        except OSError:  # EPIPE, ECONNRESET, ENOTCONN: the server refused early and closed
            pass  # its answer may still be readable
        chunks = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                piece = s.recv(1 << 16)
            except ConnectionResetError:
                break
            except TimeoutError as e:
                raise AssertionError(f"no end of answer within {timeout}s; got {b''.join(chunks)[:200]!r}") from e
            if not piece:
                break
            chunks.append(piece)
        return b"".join(chunks)


def status_of(data: bytes) -> int:
    answers = parse_answers(data)
    assert answers, "no answer at all"
    return answers[0].status


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` and its children (cube-server workers), in MiB."""
    p = psutil.Process(pid)
    total = p.memory_info().rss
    for c in p.children(recursive=True):
        try:
            total += c.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / (1 << 20)


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].rstrip("/"))


def request(method: str, path: str, headers: dict | None = None, body: bytes = b"", *, length: bool = True) -> bytes:
    """A request as bytes: Host, the headers given, Content-Length for a body (unless length=False)."""
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if body and length:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def chunked(body: bytes, size: int = 1000) -> bytes:
    parts = [b"%x\r\n%s\r\n" % (len(body[i : i + size]), body[i : i + size]) for i in range(0, len(body), size)]
    return b"".join(parts) + b"0\r\n\r\n"
