"""CPU per request of cube-server's own request path, in-process: no network, no load generator.

    .venv/bin/python bench/bench_cube_path.py                 # this checkout
    .venv/bin/python bench/bench_cube_path.py --tree DIR      # another checkout (e.g. main), same method

Each request is fed to a real connection protocol (``LookupProtocol`` of a
real ``CubeWorker`` holding a 1M-key version) as one ``data_received`` call,
and answered through the real merged-lookup code into a transport that only
counts bytes: the Python cost of parsing, routing, looking up and encoding
one request, which is what decides cube's speed at 26 keys per request
(cube/README.md). Best of 7 runs of 2,000 requests, process CPU time.

Peer, measured in the same run: the same lookups sent through the strict
generic parser (a head the fast path hands on: ``?version=`` percent-escaped),
i.e. what every request would cost without the fast path.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import inspect
import json
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parent.parent), help="checkout to measure")
    ap.add_argument("--requests", type=int, default=2000)
    args = ap.parse_args()
    sys.path.insert(0, args.tree)
    import pyarrow  # noqa: F401  (before anything that may import paddle)

    import numpy as np

    import cube.lookup_protocol as lp
    from cube.lookup_protocol import LookupProtocol
    from cube.server import initial_state
    from cube.server_app import CubeWorker
    from cube.shard_format import sha256_file, write_shard
    from cube.version_store import StateFile

    if not lp.__file__.startswith(str(Path(args.tree).resolve())):
        raise SystemExit(f"imported {lp.__file__}, not from {args.tree}")
    work = Path(tempfile.mkdtemp(prefix="bench-cube-path-"))
    rng = np.random.default_rng(0)
    keys = np.unique(rng.integers(1, 2**64 - 1, 1_000_000, dtype=np.uint64))
    values = rng.standard_normal((len(keys), 9)).astype(np.float32)
    shard = work / "v1" / "shard-0.arrow"
    shard.parent.mkdir()
    write_shard(shard, keys, values, version="bench", shard=0, shards=1)
    entry = {"shard": 0, "rows": len(keys), "size": shard.stat().st_size, "sha256": sha256_file(shard)}
    manifest = {"version": "bench", "shards": 1, "dim": 9, "rows": len(keys), "files": {"shard-0.arrow": entry}}
    (work / "v1" / "manifest.json").write_text(json.dumps(manifest))
    store = StateFile(work / "state")
    with store.locked():
        store.write(initial_state(work / "v1", 0, 1, store))

    class CountingTransport:
        def __init__(self):
            self.bytes = 0

        def write(self, b):
            self.bytes += len(b)

        def writelines(self, parts):
            self.bytes += sum(len(p) for p in parts)

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

        def get_extra_info(self, *_):
            return None

    async def run():
        worker = CubeWorker(
            data_dir=work / "v1", state_dir=work / "state", shard=0, worker=0, workers=1, token="t", max_batch=1_000_000
        )
        worker.apply_state_file()
        worker._loop = asyncio.get_running_loop()
        if list(inspect.signature(LookupProtocol.__init__).parameters)[1] == "server":
            # A real (never started) HttpServer: whatever a protocol reads of its server is there.
            from ctr_foundation.http_server import HttpServer  # function-level: the measured tree's module

            server = HttpServer(worker, name="bench", token="t")
            server.loop = asyncio.get_running_loop()
            proto = LookupProtocol(server, worker)
        else:  # the protocol before the one HTTP layer
            proto = LookupProtocol(worker, 8_001_024)
        transport = CountingTransport()
        proto.connection_made(transport)
        print(f"tree {args.tree}; {len(keys):,} keys x 9 float32; best of 7 x {args.requests} requests")
        for batch in (26, 1000):
            results = {}
            for name, target in (("fast path", "/v1/lookup"), ("generic parser", "/v1/lookup?version=b%65nch")):
                reqs = []
                for _ in range(args.requests):
                    q = keys[rng.integers(0, len(keys), batch)].astype("<u8").tobytes()
                    reqs.append(
                        b"POST %s HTTP/1.1\r\nHost: 127.0.0.1:8027\r\nContent-Type: application/octet-stream\r\n"
                        b"Content-Length: %d\r\n\r\n" % (target.encode(), len(q)) + q
                    )
                best = float("inf")
                for _ in range(7):
                    gc.collect()
                    gc.disable()
                    t0 = time.process_time()
                    for r in reqs:
                        proto.data_received(r)
                    best = min(best, (time.process_time() - t0) / len(reqs) * 1e6)
                    gc.enable()
                results[name] = best
            fast, generic = results["fast path"], results["generic parser"]
            print(
                f"batch {batch:5d}: fast path {fast:6.1f} us/request, generic parser {generic:6.1f} us/request, "
                f"fast/generic {fast / generic:.2f}x",
                flush=True,
            )

    asyncio.run(run())


if __name__ == "__main__":
    main()
