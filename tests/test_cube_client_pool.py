"""The cube client's pool of keep-alive connections: a lookup survives every pooled connection having gone
stale (the shard closed them while they were idle), because its one retry takes a fresh connection."""

from __future__ import annotations

import socket
import threading
import time

from cube.client import _ShardConnections


class AnswerOnceServer:
    """Answers one request per connection (keep-alive framing, after a short pause so that concurrent requests
    need connections of their own), then closes it: every pooled connection is stale at once."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    @staticmethod
    def _one(conn):
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                piece = conn.recv(4096)
                if not piece:
                    return
                data += piece
            time.sleep(0.2)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok")

    def close(self):
        self.sock.close()


def test_the_retry_after_a_stale_connection_takes_a_fresh_one():
    server = AnswerOnceServer()
    pool = _ShardConnections(f"http://127.0.0.1:{server.port}", timeout=5)
    try:
        answers = []
        threads = [threading.Thread(target=lambda: answers.append(pool.request("GET", "/x"))) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [a[0] for a in answers] == [200, 200, 200]
        assert pool.idle.qsize() == 3  # three kept-alive connections, all closed by the server by now
        time.sleep(0.1)
        status, _, body = pool.request("GET", "/x")  # a stale one, then a fresh one: not a second stale one
        assert (status, body) == (200, b"ok")
        assert server.accepted == 4
    finally:
        pool.close()
        server.close()
