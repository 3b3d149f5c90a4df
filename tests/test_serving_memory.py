"""Serving's feedback rings: their memory bound is stated in bytes, exposed, and holds once they are full."""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np

from elastic_control.serving.feedback import (
    DEFAULT_RING_BYTES,
    INSTANCE_BYTES,
    REQUEST_BYTES,
    PredictionLog,
    ring_bytes,
)
from elastic_control.serving.metrics import ServingMetrics

SLACK = 64 << 10  # the (arm, version) table, a batch's ids in flight, numpy's bookkeeping


def test_the_stated_bound_is_the_rings_bytes():
    assert DEFAULT_RING_BYTES == 2_000_000 * INSTANCE_BYTES + 1_000_000 * REQUEST_BYTES == 42_000_000
    log = PredictionLog(capacity=1000, max_requests=300)
    assert log.ring_bytes == ring_bytes(1000, 300) == 1000 * 5 + 300 * 32
    assert log.snapshot()["ring_bytes"] == log.ring_bytes
    text = ServingMetrics().render("v1", feedback=log.counts, feedback_ring_bytes=log.ring_bytes)
    assert "# TYPE serving_feedback_ring_bytes gauge" in text
    assert f"serving_feedback_ring_bytes {log.ring_bytes}\n" in text


def test_a_ring_filled_past_its_capacity_stays_within_its_stated_bytes():
    """The default rings (2,000,000 instances, 1,000,000 requests), filled past both capacities by requests
    of 1 to 3 instances from 4 arms and 20 versions: the memory traced stays within ``DEFAULT_RING_BYTES``."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        log = PredictionLog()
        sizes = [1, 2, 3] * 340  # 1,020 requests, 2,040 instances per batch
        probs = np.linspace(0.01, 0.99, sum(sizes), dtype=np.float32)
        batches = 1_100_000 // len(sizes) + 1  # 2.2M instances: both rings wrap
        for b in range(batches):
            log.record_batch(f"arm-{b % 4}", f"v{b % 20}", probs, sizes)
            if b == batches // 2:
                tracemalloc.reset_peak()
        held, peak_after = tracemalloc.get_traced_memory()
        held -= base
        peak_after -= base
        snap = log.snapshot()
        assert snap["requests_recorded"] > log.max_requests
        assert snap["requests_recorded"] * 2 > log.capacity  # 2 instances per request on average
        print(
            f"feedback rings: {held:,} bytes held after {snap['requests_recorded']:,} requests "
            f"(stated {DEFAULT_RING_BYTES:,}; {held / log.max_requests:.2f} bytes per request held, "
            f"2 instances each); peak over the second half {peak_after:,}"
        )
        assert DEFAULT_RING_BYTES <= held <= DEFAULT_RING_BYTES + SLACK, held
        assert peak_after <= DEFAULT_RING_BYTES + SLACK + (1 << 20), peak_after  # transient: one batch's ids
    finally:
        tracemalloc.stop()
