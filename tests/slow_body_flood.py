"""A slow-body flood, run as its own process so that its event loop shares neither a core's time slice nor the
GIL with the client being measured beside it:

    python tests/slow_body_flood.py PORT CONNECTIONS [--drip SECONDS] [--body BYTES] [--once]

``CONNECTIONS`` connections each announce a ``--body``-byte prediction body (1 MB) and send one byte every
``--drip`` seconds; a connection the server answers or closes is dialled again at once (``--once``: not).
It prints ``ramped`` once every connection has dialled at least once, runs until its stdin closes, then
prints one JSON line of counts: dials, refused (503 answers), peak_open, open.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys


class SlowBodyFlood:
    def __init__(self, port: int, n: int, drip: float, body: int, redial: bool = True):
        self.port, self.n, self.drip, self.redial = port, n, drip, redial
        self.head = (
            b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % body
        )
        self.dials = self.refused = self.open = self.peak_open = 0
        self.stop = asyncio.Event()

    async def one(self) -> None:
        while not self.stop.is_set():
            self.dials += 1
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:
                await asyncio.sleep(0.05)
                continue
            self.open += 1
            self.peak_open = max(self.peak_open, self.open)
            try:
                writer.write(self.head)
                while not self.stop.is_set():
                    try:
                        data = await asyncio.wait_for(reader.read(4096), self.drip)
                    except TimeoutError:
                        writer.write(b"x")
                        continue
                    if data.startswith(b"HTTP/1.1 503"):
                        self.refused += 1
                    break  # answered or closed: dial again
            except OSError:
                pass
            finally:
                self.open -= 1
                writer.close()
            if not self.redial:
                return
            await asyncio.sleep(0.02)

    async def run(self) -> dict:
        loop = asyncio.get_running_loop()
        tasks = [asyncio.create_task(self.one()) for _ in range(self.n)]
        stdin_closed = loop.run_in_executor(None, sys.stdin.read)
        while self.dials < self.n:
            await asyncio.sleep(0.05)
        print("ramped", flush=True)
        await stdin_closed
        held = self.open
        self.stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return {"dials": self.dials, "refused": self.refused, "peak_open": self.peak_open, "open": held}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("port", type=int)
    ap.add_argument("connections", type=int)
    ap.add_argument("--drip", type=float, default=2.0, help="seconds between a connection's body bytes")
    ap.add_argument("--body", type=int, default=1_000_000, help="the Content-Length each connection announces")
    ap.add_argument("--once", action="store_true", help="a connection the server drops is not dialled again")
    args = ap.parse_args()
    counts = asyncio.run(SlowBodyFlood(args.port, args.connections, args.drip, args.body, not args.once).run())
    print(json.dumps(counts), flush=True)


if __name__ == "__main__":
    main()
