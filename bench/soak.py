"""Soak: 32 clients, a hot reload every 30 s, 1,000 idle connections, for N minutes; zero failed requests.

    .venv/bin/python bench/soak.py --minutes 10            # trains two small passes first (about a minute)
    .venv/bin/python bench/soak.py --minutes 1 --passes A,B

Real processes on loopback, as the local pipeline runs them: the file server,
2 cube-server + cube-agent pairs, cube-transfer (``--poll-interval 1``) and
serving following the file server's ``cube/current.json``. Two passes A and B
are trained by the product (`elastic-control data criteo` + `train` on real
Criteo lines, 2 hours); every ``--reload-every`` seconds a new pass is written
(a copy of A or B, alternately, under the next hour's name) and its donefile
line appended: cube-transfer builds it, ships it to both shards, activates it,
publishes current.json, and serving hot-reloads its dense model and switches
its lookups to it.

Each client (keep-alive, one thread each) sends 1-8 of A's golden lines per
request and checks every answer: HTTP 200, and each probability equal (within
1e-5) to the offline score (bench_support.score_pass, the product's scoring
path) of that line under the content of the version the answer names
(``model_version``): a mixed answer (A's dense model with B's embeddings, a
half-loaded shard) matches neither and is a failure. Meanwhile 1,000 idle
connections are held to serving (half of them with a request head half sent);
the ones the server closes (header and idle timeouts) are reopened at once.

Printed: requests, failures (zero is the goal), reloads and the time from a
donefile line to serving answering with it, requests/s and p50/p99 latency beside
a 10 s baseline of the same clients measured first in the same run (no reloads,
no idle connections: the peer), idle connections held, and the RSS of every
component at start, middle and end (stable: end within 10% + 20 MB of middle),
and serving's end RSS against its documented bound (its RSS at the start, plus its
feedback rings and hot-key caches as /v1/monitor reports their bytes, plus 64 MB).
Exit status 1 if any request failed or memory was not stable or not within the bound.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import http.client
import json
import os
import random
import selectors
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import requests

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

import pyarrow  # noqa: E402,F401  (before paddle)

from bench_rollout import TOKEN, Procs, append_done  # noqa: E402
from bench_support import (  # noqa: E402
    CRITEO_FILE,
    CRITEO_SLOTS,
    START,
    cli,
    free_port,
    golden,
    score_pass,
    train,
    write_criteo_slice,
    write_job,
)

AUTH = {"Authorization": f"Bearer {TOKEN}"}
TOLERANCE = 1e-5


def train_two_passes(work: Path, lines: int) -> tuple[Path, Path]:
    """Two consecutive passes (hours 0 and 1) of the product pipeline on real Criteo lines."""
    if not CRITEO_FILE.exists():
        raise SystemExit(f"real Criteo lines not found at {CRITEO_FILE}; pass --passes A,B")
    print(f"training 2 passes on {lines} real Criteo lines (elastic-control data criteo + train)...", flush=True)
    work.mkdir(parents=True, exist_ok=True)
    write_criteo_slice(work / "raw.txt", 0, lines)
    data = work / "data"
    cli("data", "criteo", "--input", work / "raw.txt", "--output", data, "--hours", 2, "--start", f"{START:%Y%m%d/%H}")
    passes = train(*write_job(work, data=data, slots=CRITEO_SLOTS, start=START, hours=2))
    if len(passes) < 2:
        raise SystemExit(f"training wrote {len(passes)} passes, 2 needed")
    return passes[-2], passes[-1]


def copy_pass(src: Path, models: Path, name: str) -> Path:
    """``src`` under a new pass name (its meta.json naming it), as the trainer would have written it."""
    dst = models / name
    shutil.copytree(src, dst)
    meta = json.loads((dst / "meta.json").read_text())
    meta.update({"pass": name, "kind": "base", "parent": None})
    (dst / "meta.json").write_text(json.dumps(meta))
    return dst


class Checker:
    """Expected probabilities of the request lines under each content (A, B); which content each version has."""

    def __init__(self, lines: list[str], expected: dict[str, np.ndarray]):
        self.lines, self.expected = lines, expected
        self.content: dict[str, str] = {}
        self.lock = threading.Lock()

    def check(self, idx: list[int], answer: dict) -> str | None:
        version = answer.get("model_version")
        with self.lock:
            content = self.content.get(version)
        if content is None:
            return f"answer names unknown version {version!r}"
        got = np.asarray(answer.get("predictions"), dtype=np.float64)
        want = self.expected[content][idx]
        if got.shape != want.shape:
            return f"{len(got)} predictions for {len(want)} instances"
        if not np.all(np.abs(got - want) <= TOLERANCE):
            return f"{version} ({content}): max |got - want| {float(np.max(np.abs(got - want))):.3g}"
        return None


class Clients:
    """``n`` keep-alive clients checking every answer; failures, latencies and versions seen."""

    def __init__(self, port: int, checker: Checker, n: int, seed: int = 0):
        self.port, self.checker, self.n = port, checker, n
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.failed = 0
        self.versions_seen: dict[str, float] = {}  # version -> first time an answer named it
        self.threads = [threading.Thread(target=self._run, args=(seed + i,), daemon=True) for i in range(n)]

    def start(self):
        for t in self.threads:
            t.start()
        return self

    def join(self):
        self.stop.set()
        for t in self.threads:
            t.join(120)

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        lat, n_lines = [], len(self.checker.lines)
        while not self.stop.is_set():
            idx = [rng.randrange(n_lines) for _ in range(rng.randint(1, 8))]
            body = json.dumps({"instances": [{"line": self.checker.lines[i]} for i in idx]})
            t0 = time.perf_counter()
            problem = None
            try:
                conn.request("POST", "/v1/predict", body=body, headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
                if resp.status != 200:
                    problem = f"HTTP {resp.status}: {data[:200]!r}"
                else:
                    answer = json.loads(data)
                    problem = self.checker.check(idx, answer)
                    v = answer.get("model_version")
                    if v not in self.versions_seen:
                        with self.lock:
                            self.versions_seen.setdefault(v, time.time())
            except (OSError, http.client.HTTPException, ValueError) as e:
                problem = f"{type(e).__name__}: {e}"
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            lat.append(time.perf_counter() - t0)
            if problem:
                with self.lock:
                    self.failed += 1
                    if len(self.failures) < 20:
                        self.failures.append(f"{time.strftime('%H:%M:%S')} {problem}")
        conn.close()
        with self.lock:
            self.latencies.extend(lat)

    def summary(self, seconds: float) -> dict:
        lat = np.array(self.latencies) * 1000
        return {
            "requests": len(lat),
            "failed": self.failed,
            "rps": len(lat) / seconds,
            "p50": float(np.percentile(lat, 50)) if len(lat) else float("nan"),
            "p99": float(np.percentile(lat, 99)) if len(lat) else float("nan"),
        }


class IdleConnections:
    """``n`` connections held open to a server doing nothing (half with a half-sent request head); the ones
    the server closes are reopened. ``held`` samples how many were open."""

    HALF = b"POST /v1/predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appl"

    def __init__(self, port: int, n: int):
        self.port, self.n = port, n
        self.sel = selectors.DefaultSelector()
        self.stop = threading.Event()
        self.reopened = 0
        self.refused = 0
        self.samples: list[int] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _open(self, i: int) -> None:
        try:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
            if i % 2:
                s.sendall(self.HALF)
            s.setblocking(False)
            self.sel.register(s, selectors.EVENT_READ, i)
        except OSError:
            self.refused += 1

    def start(self):
        for i in range(self.n):
            self._open(i)
        self.thread.start()
        return self

    def _run(self) -> None:
        last = 0.0
        while not self.stop.is_set():
            for key, _ in self.sel.select(timeout=0.5):
                s = key.fileobj
                with contextlib.suppress(OSError):
                    s.recv(65536)  # the server's answer (408/503) or EOF: it closed the connection
                self.sel.unregister(s)
                s.close()
                self.reopened += 1
                self._open(key.data)
            while len(self.sel.get_map()) < self.n and not self.stop.is_set():  # refused earlier: try again
                self._open(len(self.sel.get_map()))
                time.sleep(0.01)
            if time.monotonic() - last > 1:
                self.samples.append(len(self.sel.get_map()))
                last = time.monotonic()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()


def rss_mb(procs: dict[str, psutil.Process]) -> dict[str, float]:
    out = {}
    for name, p in procs.items():
        try:
            out[name] = p.memory_info().rss / 2**20
        except psutil.Error:
            out[name] = float("nan")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--idle", type=int, default=1000, help="idle connections held to serving")
    ap.add_argument("--reload-every", type=float, default=30.0, help="seconds between new passes")
    ap.add_argument("--passes", default=None, help="two pass folders A,B (default: train them, about a minute)")
    ap.add_argument("--lines", type=int, default=6000, help="Criteo lines to train on (without --passes)")
    ap.add_argument("--baseline", type=float, default=10.0, help="seconds of the no-reload baseline")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", dest="json_out", default=None, help="also write the figures here (JSON)")
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="soak-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"work folder {work}; load average {os.getloadavg()[0]:.1f}", flush=True)
    if args.passes:
        a, b = (Path(p) for p in args.passes.split(","))
    else:
        a, b = train_two_passes(work / "train", args.lines)
    lines, _ = golden(a)
    expected = {"A": score_pass(a, lines), "B": score_pass(b, lines)}
    differ = float(np.max(np.abs(expected["A"] - expected["B"])))
    print(f"{len(lines)} request lines; A and B differ on them by up to {differ:.3g}")
    models = work / "models"
    models.mkdir()
    checker = Checker(lines, expected)
    hour = [0]

    def new_pass(content: str) -> str:
        name = f"pass-{dt.datetime(2030, 1, 1) + dt.timedelta(hours=hour[0]):%Y%m%d-%H}"
        hour[0] += 1
        copy_pass(a if content == "A" else b, models, name)
        with checker.lock:
            checker.content[name] = content
        return name

    procs = Procs(work)
    ok = False
    try:
        fs_url, servers, agents = procs.cluster(2, ("cube-server", "cube-agent"))
        transfer = procs.transfer(models, fs_url, agents, "--poll-interval", "1", "--keep", "4", name="cube-transfer")
        first = new_pass("A")
        append_done(models, first)
        s_port = free_port()
        procs.start(
            "serving",
            [sys.executable, "-m", "elastic_control", "serve", "--host", "127.0.0.1", "--port", str(s_port),
             "--fileserver", fs_url, "--cube-servers", ",".join(servers), "--cache-dir", str(work / "cache")],
        )  # fmt: skip
        deadline = time.monotonic() + 300
        while True:
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"http://127.0.0.1:{s_port}/readyz", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"serving not ready after 300 s; see {work}")
            time.sleep(0.2)
        pids = {name: psutil.Process(p.pid) for name, p, _ in procs.procs}

        base = Clients(s_port, checker, args.clients, seed=1000).start()
        time.sleep(args.baseline)
        base.join()
        peer = base.summary(args.baseline)
        print(
            f"baseline ({args.clients} clients, {args.baseline:.0f} s, no reloads, no idle connections): "
            f"{peer['rps']:.0f} req/s, p50 {peer['p50']:.1f} ms, p99 {peer['p99']:.1f} ms, {peer['failed']} failed",
            flush=True,
        )

        idle = IdleConnections(s_port, args.idle).start()
        clients = Clients(s_port, checker, args.clients).start()
        seconds = args.minutes * 60
        t_start = time.monotonic()
        rss = {"start": rss_mb(pids)}
        print(f"soak started: {len(idle.sel.get_map())} idle connections; RSS MB at start {_fmt(rss['start'])}")
        reloads: list[tuple[str, float]] = []  # (version, donefile time)
        content, next_reload = "B", t_start + args.reload_every
        while (now := time.monotonic()) < t_start + seconds:
            if now >= next_reload:
                name = new_pass(content)
                reloads.append((name, append_done(models, name)))
                with contextlib.suppress(requests.RequestException):  # wake cube-transfer (it also polls)
                    requests.post(f"{transfer}/v1/poll", headers=AUTH, timeout=5)
                content = "A" if content == "B" else "B"
                next_reload += args.reload_every
            if "middle" not in rss and now >= t_start + seconds / 2:
                rss["middle"] = rss_mb(pids)
                print(
                    f"  middle ({(now - t_start) / 60:.1f} min): {len(reloads)} reloads, {clients.failed} failed, "
                    f"{len(idle.sel.get_map())} idle connections; RSS MB {_fmt(rss['middle'])}",
                    flush=True,
                )
            dead = [n for n, p, _ in procs.procs if p.poll() is not None]
            if dead:
                print(f"  component(s) exited: {dead}", flush=True)
                break
            time.sleep(0.2)
        elapsed = time.monotonic() - t_start
        rss["end"] = rss_mb(pids)
        bound = serving_bound_mb(s_port, rss["start"].get("serving", 0.0))
        clients.join()
        idle.close()
        time.sleep(3)
        got = clients.summary(elapsed)
        delays = [clients.versions_seen[v] - t for v, t in reloads if v in clients.versions_seen]
        missing = [v for v, t in reloads[:-1] if v not in clients.versions_seen]  # the last may not be live yet
        held = idle.samples or [0]
        stable = {
            n: rss["end"][n] <= rss["middle"].get(n, rss["end"][n]) * 1.1 + 20 for n in rss["end"] if "middle" in rss
        }
        print(f"\nsoak: {elapsed / 60:.1f} min, {args.clients} clients, a new pass every {args.reload_every:.0f} s")
        print(f"  requests {got['requests']:,}, failed {got['failed']} ({'OK' if got['failed'] == 0 else 'FAILED'})")
        for f in clients.failures[:10]:
            print(f"    {f}")
        print(
            f"  reloads {len(reloads)}, served {sum(v in clients.versions_seen for v, _ in reloads)} of them"
            + (f" (never served: {missing})" if missing else "")
            + (
                f"; donefile line -> serving answers with it: median {np.median(delays):.1f} s, max {max(delays):.1f} s"
                if delays
                else ""
            )
        )
        print(
            f"  {got['rps']:.0f} req/s, p50 {got['p50']:.1f} ms, p99 {got['p99']:.1f} ms | baseline {peer['rps']:.0f} "
            f"req/s, p50 {peer['p50']:.1f} ms, p99 {peer['p99']:.1f} ms | req/s x{got['rps'] / peer['rps']:.2f}, "
            f"p99 x{got['p99'] / peer['p99']:.2f}"
        )
        print(
            f"  idle connections held: min {min(held)}, median {int(np.median(held))} of {args.idle}; "
            f"reopened after the server closed them {idle.reopened}, refused {idle.refused}"
        )
        for phase in ("start", "middle", "end"):
            if phase in rss:
                print(f"  RSS MB {phase:6s} {_fmt(rss[phase])}")
        print(f"  memory stable (end <= middle x1.1 + 20 MB): {all(stable.values())} {stable}")
        within = bound is not None and rss["end"].get("serving", 0.0) <= bound["total"]
        if bound is not None:
            print(
                f"  serving's bound: start {bound['start']:.0f} + feedback rings {bound['rings']:.0f} + hot-key caches "
                f"{bound['caches']:.0f} + slack {SLACK_MB} = {bound['total']:.0f} MB; end {rss['end']['serving']:.0f}: "
                + ("within" if within else "ABOVE")
            )
        print(f"  load average {os.getloadavg()[0]:.1f}")
        ok = got["failed"] == 0 and bool(stable) and all(stable.values()) and within and not missing
        if args.json_out:
            Path(args.json_out).write_text(
                json.dumps(
                    {
                        "minutes": elapsed / 60,
                        **got,
                        "baseline": peer,
                        "reloads": len(reloads),
                        "never_served": missing,
                        "reload_delay_median_s": float(np.median(delays)) if delays else None,
                        "idle_min": min(held),
                        "rss_mb": rss,
                        "stable": stable,
                        "serving_bound_mb": bound,
                        "failures": clients.failures,
                        "ok": ok,
                    }
                )
            )
    finally:
        procs.stop()
    if ok and not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


SLACK_MB = 64  # the allocator's free lists and fragmentation


def serving_bound_mb(port: int, start_mb: float) -> dict | None:
    """Serving's documented memory bound (docs/contracts.md, "Memory"): its RSS once it answers, plus the
    feedback rings and the hot-key caches of the versions it holds (both allocated whole, committed as they
    fill), plus SLACK_MB; None if serving does not say."""
    try:
        monitor = requests.get(f"http://127.0.0.1:{port}/v1/monitor", headers=AUTH, timeout=10).json()
    except (requests.RequestException, ValueError):
        return None
    rings = monitor["feedback"]["ring_bytes"] / 2**20
    caches = (monitor.get("cache") or {}).get("bytes", 0) / 2**20
    return {"start": start_mb, "rings": rings, "caches": caches, "total": start_mb + rings + caches + SLACK_MB}


def _fmt(rss: dict[str, float]) -> str:
    return ", ".join(f"{n} {v:.0f}" for n, v in rss.items())


if __name__ == "__main__":
    sys.exit(main())
