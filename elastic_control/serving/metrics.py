"""Serving's counters and latency histogram, rendered in the Prometheus text format."""

from __future__ import annotations

import bisect
import threading
from collections import Counter

LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class ServingMetrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.requests = Counter()  # by HTTP status
        self.instances = 0
        self.batches = 0
        self.batch_instances = 0
        self.cube_errors = 0
        self.reloads = 0
        self.reload_failures = 0
        self._buckets = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self._latency_sum = 0.0

    def observe_request(self, status: int, seconds: float, instances: int = 0) -> None:
        with self._lock:
            self.requests[status] += 1
            self.instances += instances
            self._buckets[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
            self._latency_sum += seconds

    def observe_requests(self, items) -> None:
        """Many ``(status, seconds, instances)`` at once (one lock for a whole batch of answers)."""
        with self._lock:
            for status, seconds, instances in items:
                self.requests[status] += 1
                self.instances += instances
                self._buckets[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
                self._latency_sum += seconds

    def observe_batch(self, instances: int) -> None:
        with self._lock:
            self.batches += 1
            self.batch_instances += instances

    def count(self, name: str) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "requests": dict(self.requests),
                "instances": self.instances,
                "batches": self.batches,
                "batch_instances": self.batch_instances,
                "cube_errors": self.cube_errors,
                "reloads": self.reloads,
                "reload_failures": self.reload_failures,
            }

    def render(
        self,
        model_version: str | None,
        *,
        cache: dict | None = None,
        feedback: dict | None = None,
        feedback_ring_bytes: int | None = None,
    ) -> str:
        with self._lock:
            lines = [
                "# HELP serving_requests_total Prediction requests by HTTP status.",
                "# TYPE serving_requests_total counter",
            ]
            lines += [f'serving_requests_total{{code="{c}"}} {n}' for c, n in sorted(self.requests.items())]
            lines += [
                "# HELP serving_request_seconds Prediction request latency.",
                "# TYPE serving_request_seconds histogram",
            ]
            acc = 0
            for bound, n in zip(LATENCY_BUCKETS_S, self._buckets[:-1], strict=True):  # the last bucket is +Inf
                acc += n
                lines.append(f'serving_request_seconds_bucket{{le="{bound}"}} {acc}')
            acc += self._buckets[-1]
            lines += [
                f'serving_request_seconds_bucket{{le="+Inf"}} {acc}',
                f"serving_request_seconds_sum {self._latency_sum:.6f}",
                f"serving_request_seconds_count {acc}",
            ]
            for name, value, kind, doc in (
                ("serving_instances_total", self.instances, "counter", "Instances scored."),
                ("serving_batches_total", self.batches, "counter", "Merged batches run."),
                ("serving_batch_instances_total", self.batch_instances, "counter", "Instances in merged batches."),
                ("serving_cube_errors_total", self.cube_errors, "counter", "Failed cube lookups."),
                ("serving_reloads_total", self.reloads, "counter", "Version switches."),
                ("serving_reload_failures_total", self.reload_failures, "counter", "Versions that failed to load."),
            ):
                lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", f"{name} {value}"]
            lines += [
                "# HELP serving_model_info The active version.",
                "# TYPE serving_model_info gauge",
                f'serving_model_info{{version="{model_version or ""}"}} 1',
            ]
        if cache is not None:
            for name, value, kind, doc in (
                ("serving_cache_lookups_total", cache["lookups"], "counter", "Keys looked up in the hot-key cache."),
                ("serving_cache_hits_total", cache["hits"], "counter", "Keys the cache answered (no cube lookup)."),
                ("serving_cache_hit_rate", cache["hit_rate"] or 0.0, "gauge", "Hits / lookups since start."),
                ("serving_cache_entries", cache["entries"], "gauge", "Entries held."),
                ("serving_cache_capacity", cache["capacity"], "gauge", "Entries the cache can hold."),
            ):
                lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", f"{name} {value}"]
        if feedback is not None:
            lines += [
                "# HELP serving_feedback_events_total Click feedback events by result.",
                "# TYPE serving_feedback_events_total counter",
            ]
            lines += [f'serving_feedback_events_total{{result="{k}"}} {v}' for k, v in sorted(feedback.items())]
        if feedback_ring_bytes is not None:
            lines += [
                "# HELP serving_feedback_ring_bytes Bytes of the feedback rings (fixed: their memory bound).",
                "# TYPE serving_feedback_ring_bytes gauge",
                f"serving_feedback_ring_bytes {feedback_ring_bytes}",
            ]
        return "\n".join(lines) + "\n"
