"""cube-server's request path in-process: a real CubeWorker and LookupProtocol, a transport that records writes.

A lone whole lookup on the worker's only connection is answered at once (no answer slot, queue or
merge pass); these tests hold it to the same bytes, metrics and answer order as the ordinary path.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from helpers_cube import TOKEN, write_synthetic_pass

from ctr_foundation.http_server import HttpServer
from cube.builder import build_version
from cube.lookup_protocol import LookupProtocol
from cube.server import initial_state
from cube.server_app import CubeWorker
from cube.version_store import StateFile

DIM = 4
VERSION = "pass-20240101-00"


class RecordingTransport:
    def __init__(self):
        self.writes: list[bytes] = []

    def write(self, data):
        self.writes.append(bytes(data))

    def writelines(self, parts):
        self.writes.append(b"".join(parts))

    def set_write_buffer_limits(self, **_):
        pass

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass

    def close(self):
        pass

    def can_write_eof(self):
        return True

    def write_eof(self):
        pass

    def get_extra_info(self, *_):
        return None


@pytest.fixture
def served(tmp_path):
    keys = np.unique(np.random.default_rng(5).integers(1, 2**64 - 1, 2000, dtype=np.uint64))
    values = (np.arange(len(keys), dtype=np.float32)[:, None] * 10 + np.arange(DIM, dtype=np.float32)).astype(
        np.float32
    )
    build_version(
        pass_dir=write_synthetic_pass(tmp_path / "passes" / VERSION, keys, values), shards=1, output=tmp_path / "cube"
    )
    store = StateFile(tmp_path / "state")
    with store.locked():
        store.write(initial_state(tmp_path / "cube", 0, 1, store))
    return tmp_path, keys, values


def _connection(tmp_path) -> tuple[CubeWorker, LookupProtocol, RecordingTransport]:
    """A connection of a worker serving ``tmp_path``'s version, on the running event loop."""
    loop = asyncio.get_running_loop()
    worker = CubeWorker(
        data_dir=tmp_path / "cube",
        state_dir=tmp_path / "state",
        shard=0,
        worker=0,
        workers=1,
        token=TOKEN,
        max_batch=1000,
    )
    worker.apply_state_file()
    worker._loop = loop
    server = HttpServer(worker, name="cube-server test", token=TOKEN)
    server.loop = loop
    proto = LookupProtocol(server, worker)
    transport = RecordingTransport()
    proto.connection_made(transport)
    return worker, proto, transport


def _lookup(keys: np.ndarray, target: str = "/v1/lookup") -> bytes:
    body = keys.astype("<u8").tobytes()
    return b"POST %s HTTP/1.1\r\nHost: cube\r\nContent-Length: %d\r\n\r\n" % (target.encode(), len(body)) + body


def _answer(raw: bytes) -> tuple[int, dict, bytes]:
    end = raw.index(b"\r\n\r\n")
    lines = raw[:end].decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    body = raw[end + 4 :]
    assert len(body) == int(headers["content-length"])
    return int(lines[0].split(" ")[1]), headers, body


def test_a_lone_lookup_is_answered_at_once_with_the_bytes_and_metrics_of_the_ordinary_path(served):
    tmp_path, keys, values = served
    rng = np.random.default_rng(1)
    query = np.concatenate([keys[rng.integers(0, len(keys), 23)], np.array([3, 5, 2**64 - 1], np.uint64)])

    async def run():
        worker, proto, transport = _connection(tmp_path)
        request = _lookup(query)
        proto.data_received(request)  # whole, alone: answered inside the call
        assert len(transport.writes) == 1 and not proto.pending and not worker._pending
        status, headers, body = _answer(transport.writes[0])
        assert status == 200 and headers["x-cube-version"] == VERSION and headers["x-cube-misses"] == "3"
        n = len(query)
        got = np.frombuffer(body[: n * DIM * 4], "<f4").reshape(n, DIM)
        pos = np.searchsorted(keys, query[:23])
        np.testing.assert_array_equal(got[:23], values[pos])
        assert not got[23:].any()
        found = np.unpackbits(np.frombuffer(body[n * DIM * 4 :], np.uint8), bitorder="little")[:n]
        assert found[:23].all() and not found[23:].any()
        m = worker.metrics
        assert (m.requests["lookup|200"], m.keys, m.misses, m.batches, sum(m.latency_counts)) == (1, n, 3, 1, 1)
        # The same request in two pieces (head, then body) takes the ordinary path: the same answer.
        cut = request.index(b"\r\n\r\n") + 4
        proto.data_received(request[:cut])
        assert len(transport.writes) == 1
        proto.data_received(request[cut:])
        assert transport.writes[1:] == transport.writes[:1]
        # Two pipelined in one piece: merged, each its own answer (the same bytes again).
        proto.data_received(request + request)
        assert transport.writes[2:] == transport.writes[:1] * 2
        assert (m.requests["lookup|200"], m.keys, m.misses) == (4, 4 * n, 12)

    asyncio.run(run())


def test_a_lone_lookup_that_is_no_plain_success_is_answered_by_the_ordinary_path(served):
    tmp_path, keys, _ = served

    async def run():
        worker, proto, transport = _connection(tmp_path)
        proto.data_received(_lookup(keys[:2], "/v1/lookup?version=nope"))
        proto.data_received(b"POST /v1/lookup HTTP/1.1\r\nContent-Length: 17\r\n\r\n" + bytes(17))  # not 8n bytes
        proto.data_received(_lookup(np.zeros(1001, np.uint64)))  # over --max-batch 1000
        assert [_answer(w)[0] for w in transport.writes] == [404, 400, 413]
        m = worker.metrics.requests
        assert (m["lookup|404"], m["lookup|400"], m["lookup|413"], m["lookup|200"]) == (1, 1, 1, 0)

    asyncio.run(run())


def test_a_lookup_behind_an_unanswered_request_waits_for_its_answer(served):
    """A control call still running owns the connection's next answer: the lookup after it is not
    answered first, even though it arrived whole and alone."""
    tmp_path, keys, _ = served

    async def run():
        worker, proto, transport = _connection(tmp_path)
        body = b'{"version": "%s"}' % VERSION.encode()
        control = (
            b"POST /v1/activate HTTP/1.1\r\nHost: cube\r\nAuthorization: Bearer %s\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (TOKEN.encode(), len(body))
        ) + body
        proto.data_received(control)  # a task on the loop: not answered yet
        assert not transport.writes and len(proto.pending) == 1
        proto.data_received(_lookup(keys[:5]))
        assert not transport.writes  # queued behind the control call's answer
        for _ in range(200):  # the control call waits for the state file's acknowledgement
            if transport.writes:
                break
            await asyncio.sleep(0.02)
        assert [_answer(w)[0] for w in transport.writes] == [200, 200]
        assert b'"active"' in transport.writes[0] and _answer(transport.writes[1])[1]["x-cube-misses"] == "0"

    asyncio.run(run())
