"""Prometheus metrics of a cube-server, summed over its worker processes.

Each worker counts in memory and snapshots its counters to
``STATE_DIR/metrics-K.json`` about once a second; ``/metrics`` answered by
any worker adds its live counters to the other workers' latest snapshots
(so other workers' figures may be up to a second old).
"""

from __future__ import annotations

import bisect
import contextlib
import json
from collections import Counter
from pathlib import Path

from ctr_foundation.atomic import atomic_write_json

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class ServerMetrics:
    def __init__(self):
        self.requests: Counter = Counter()  # "endpoint|code" -> count
        self.keys = 0
        self.misses = 0
        self.batches = 0  # merged lookups executed
        self.latency_counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.latency_sum = 0.0

    def count_request(self, endpoint: str, code: int) -> None:
        self.requests[f"{endpoint}|{code}"] += 1

    def observe_lookup(self, keys: int, misses: int, seconds: float | None) -> None:
        self.keys += keys
        self.misses += misses
        if seconds is None:  # debugging (JSON) lookups are counted but not timed
            return
        self.latency_counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.latency_sum += seconds

    def observe_one(self, keys: int, misses: int, seconds: float) -> None:
        """Count one binary lookup (200) answered on its own, in ``seconds``."""
        self.batches += 1
        self.requests["lookup|200"] += 1
        self.keys += keys
        self.misses += misses
        self.latency_counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.latency_sum += seconds

    def observe_lookups(self, requests: int, keys: int, misses: int, seconds) -> None:
        """Count one merged pass that answered ``requests`` binary lookups (200), with their latencies."""
        self.batches += 1
        self.requests["lookup|200"] += requests
        self.keys += keys
        self.misses += misses
        counts = self.latency_counts
        for s in seconds:
            counts[bisect.bisect_left(LATENCY_BUCKETS, s)] += 1
            self.latency_sum += s

    def to_json(self) -> dict:
        return {
            "requests": dict(self.requests),
            "keys": self.keys,
            "misses": self.misses,
            "batches": self.batches,
            "latency_counts": list(self.latency_counts),  # a copy: snapshots are written from another thread
            "latency_sum": self.latency_sum,
        }

    @staticmethod
    def write_snapshot(state_dir: Path, worker: int, counters: dict) -> None:
        """Write ``counters`` (a ``to_json()``) where the other workers' ``render`` reads them."""
        atomic_write_json(state_dir / f"metrics-{worker}.json", counters)

    @staticmethod
    def _add(total: dict, part: dict) -> None:
        for k, v in part["requests"].items():
            total["requests"][k] = total["requests"].get(k, 0) + v
        for k in ("keys", "misses", "batches", "latency_sum"):
            total[k] += part[k]
        total["latency_counts"] = [a + b for a, b in zip(total["latency_counts"], part["latency_counts"], strict=True)]

    def render(self, state_dir: Path, worker: int, workers: int, *, shard: int, active: str | None) -> str:
        """Prometheus text format of all workers' counters."""
        total = self.to_json()
        total["requests"] = dict(total["requests"])
        for k in range(workers):
            if k == worker:
                continue
            with contextlib.suppress(FileNotFoundError, json.JSONDecodeError, KeyError):
                self._add(total, json.loads((state_dir / f"metrics-{k}.json").read_text(encoding="utf-8")))
        lab = f'shard="{shard}"'
        out = [
            "# HELP cube_requests_total HTTP requests by endpoint and status code.",
            "# TYPE cube_requests_total counter",
        ]
        for key, v in sorted(total["requests"].items()):
            endpoint, code = key.split("|")
            out.append(f'cube_requests_total{{{lab},endpoint="{endpoint}",code="{code}"}} {v}')
        out += [
            "# HELP cube_lookup_keys_total Keys looked up.",
            "# TYPE cube_lookup_keys_total counter",
            f"cube_lookup_keys_total{{{lab}}} {total['keys']}",
            "# HELP cube_lookup_misses_total Keys not found (answered with zero vectors).",
            "# TYPE cube_lookup_misses_total counter",
            f"cube_lookup_misses_total{{{lab}}} {total['misses']}",
            "# HELP cube_lookup_batches_total Merged lookups executed (one per group of waiting requests).",
            "# TYPE cube_lookup_batches_total counter",
            f"cube_lookup_batches_total{{{lab}}} {total['batches']}",
            "# HELP cube_lookup_latency_seconds Time from a lookup request's arrival to its answer.",
            "# TYPE cube_lookup_latency_seconds histogram",
        ]
        cumulative = 0
        for bound, c in zip((*LATENCY_BUCKETS, "+Inf"), total["latency_counts"], strict=True):
            cumulative += c
            out.append(f'cube_lookup_latency_seconds_bucket{{{lab},le="{bound}"}} {cumulative}')
        out += [
            f"cube_lookup_latency_seconds_sum{{{lab}}} {total['latency_sum']:.6f}",
            f"cube_lookup_latency_seconds_count{{{lab}}} {cumulative}",
            "# HELP cube_active_version_info The version un-pinned lookups get.",
            "# TYPE cube_active_version_info gauge",
            f'cube_active_version_info{{{lab},version="{active or ""}"}} 1',
            f"cube_workers{{{lab}}} {workers}",
        ]
        return "\n".join(out) + "\n"
