"""Per-batch cost of the defaults' per-key inputs: one search of the pass's keys against one search each.

    .venv/bin/python bench/bench_feed.py [--lines 33000] [--history 10000000] [--batches 200]

A training batch's per-key inputs with the defaults (wide_deep: the count-scaled L2's 1 / count, the
decay rule's rate factor, the wide prior's anchor and weight) are each a function of the key.
``feeding.feed_keys`` finds the batch's distinct keys once, and all four share one search of the
pass's counts (``KeyCounts.index``). The peer searches five times, as the inputs once did: the pass's
counts for the L2 scale and for the rate factor, every key the trainer had seen in earlier passes (a
table that grows all job long) for the rate factor, and the pass's keys seen before twice for the
prior. This prints, per batch of real Criteo lines (an hour of the 5-hour Criteo split, 39 slots):

- the floor both need: ``np.unique`` of the batch's keys (the distinct keys and where each goes);
- the four inputs as they are computed now (the product's objects, on that one search);
- the five searches of the peer (reimplemented here as the peer), with the earlier passes' keys being
  this pass's (a job's second hour) and then ``--history`` more (a long online job);

and the ratios, measured in the same run (medians of three repetitions). Then, with feature admission
(``ADMIT_MIN_COUNT``), the training mask of each batch (``admission.TrainingAdmission``: occurrences fed
since the export, in an array aligned with the pass's keys) against a dict of counts (the peer), in a
first pass (no key admitted yet) and in a second one (the first pass's keys exported with their counts).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_support as B  # noqa: E402

from elastic_control.data.line_batch import batch_keys, parse_lines, slice_batch  # noqa: E402
from elastic_control.training.admission import TrainingAdmission  # noqa: E402
from elastic_control.training.key_state import KeyState  # noqa: E402
from elastic_control.training.pass_stream import KeyCounts  # noqa: E402
from elastic_control.training.rate_decay import RateDecay  # noqa: E402
from elastic_control.training.settings import DEFAULT_WIDE_PRIOR, Hyperparameters  # noqa: E402
from elastic_control.training.wide_prior import WidePrior  # noqa: E402


def criteo_batches(lines: int, batch: int) -> list[np.ndarray]:
    """The keys (slot after slot, as the training feed has them) of each batch of ``lines`` real lines."""
    parsed, bad = parse_lines(B.criteo_slot_lines(0, lines))
    assert not bad, bad[:3]
    return [
        batch_keys(slice_batch(parsed, start, start + batch), B.CRITEO_SLOTS, None)[0]
        for start in range(0, len(parsed) - batch + 1, batch)
    ]


def before(distinct, counts: KeyCounts, seen: KeyCounts, known_keys, anchors, weights, progress, scale, l2):
    """The peer: the per-key inputs by five searches, one per table and input."""

    def find(table, keys):
        idx = np.minimum(np.searchsorted(table, keys), len(table) - 1)
        return idx, table[idx] == keys

    idx, hit = find(counts.keys, distinct)
    l2_scale = (1.0 / np.maximum(np.where(hit, counts.counts[idx], 0), 1)).astype(np.float32)
    s_idx, s_hit = find(seen.keys, distinct)
    e_idx, e_hit = find(counts.keys, distinct)
    own = np.where(s_hit, seen.counts[s_idx], 0) + progress * np.where(e_hit, counts.counts[e_idx], 0)
    rate = (1.0 / np.sqrt(1.0 + own * scale)).astype(np.float32)
    a_idx, a_hit = find(known_keys, distinct)
    anchor = np.where(a_hit, anchors[a_idx], 0).astype(np.float32)
    w_idx, w_hit = find(known_keys, distinct)
    weight = np.where(w_hit, weights[w_idx], l2).astype(np.float32)
    return l2_scale, rate, anchor, weight


def measure(batches, counts: KeyCounts, history: KeyCounts, hyper: Hyperparameters, trainers: int = 2) -> dict:
    decay = RateDecay(hyper.decay_sightings, trainers)
    decay.seen.absorb(history)
    prior = WidePrior(DEFAULT_WIDE_PRIOR, hyper.l2_wide)
    prior.seen.absorb(history)
    prior.start_pass(counts, lambda k: np.full(len(k), 0.01, np.float32))
    decay.start_epoch(counts, share_lines=len(batches) * 128)
    decay.fed(len(batches) * 64)  # mid-epoch
    # The peer's own tables, as the code before kept them: the known keys with their anchors and weights.
    earlier = history.lookup(counts.keys)
    known = earlier > 0
    known_keys, anchors = counts.keys[known], np.full(int(known.sum()), 0.01, np.float32)
    weights = (hyper.l2_wide + DEFAULT_WIDE_PRIOR * earlier[known]).astype(np.float32)
    progress, scale = 0.5, trainers / hyper.decay_sightings

    def floor(keys):
        return np.unique(keys, return_inverse=True)

    def now(keys):
        distinct, where = np.unique(keys, return_inverse=True)
        distinct.flags.writeable = False
        return [fn(distinct)[where] for fn in (counts.inverse, decay.factors, prior.anchors, prior.weights)]

    def then(keys):
        distinct, where = np.unique(keys, return_inverse=True)
        args = (counts, decay.seen, known_keys, anchors, weights, progress, scale, hyper.l2_wide)
        return [v[where] for v in before(distinct, *args)]

    # Same numbers both ways (a check, not timed).
    for keys in batches[:20]:
        for a, b in zip(now(keys), then(keys), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6)
    out = {}
    for label, fn in (("floor", floor), ("now", now), ("before", then)):
        reps = []
        for _ in range(3):
            t = time.perf_counter()
            for keys in batches:
                fn(keys)
            reps.append((time.perf_counter() - t) / len(batches) * 1e3)
        out[label] = float(np.median(reps))
    return out


class DictAdmission(TrainingAdmission):
    """The peer: the training admission mask from a dict of occurrences fed."""

    def start_pass(self, pass_counts=None) -> None:
        self.seen: dict[int, int] = {}

    def admitted(self, keys: np.ndarray) -> np.ndarray:
        keys = np.asarray(keys, np.uint64)
        out = self.state.is_admitted(keys)
        rest = np.flatnonzero(~out)
        if len(rest) == 0:
            return out
        uniq, inverse, counts = np.unique(keys[rest], return_inverse=True, return_counts=True)
        mine = np.array([self.seen.get(k, 0) for k in uniq.tolist()], np.float64)
        out[rest] = ((self.state.shows_of(uniq) + mine) >= self.min_count)[inverse]
        for k, c in zip(uniq.tolist(), counts.tolist(), strict=True):
            self.seen[k] = self.seen.get(k, 0) + c
        return out


def measure_admission(batches, counts: KeyCounts, state: KeyState, min_count: int) -> dict:
    """ms per batch of each mask over ``batches`` (every batch once per repetition, as a pass feeds them)."""
    masks = {"now": TrainingAdmission(state, min_count), "before": DictAdmission(state, min_count)}
    for mask in masks.values():  # same masks both ways (a check, not timed)
        mask.start_pass(counts)
    admitted = []
    for keys in batches:
        mask = masks["now"].admitted(keys)
        np.testing.assert_array_equal(mask, masks["before"].admitted(keys))
        admitted.append(mask.mean())
    out = {}
    for label, mask in masks.items():
        reps = []
        for _ in range(3):
            mask.start_pass(counts)
            t = time.perf_counter()
            for keys in batches:
                mask.admitted(keys)
            reps.append((time.perf_counter() - t) / len(batches) * 1e3)
        out[label] = float(np.median(reps))
    out["admitted"] = float(np.mean(admitted))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=33_000, help="real Criteo lines: one hour of the Criteo split")
    ap.add_argument("--history", type=int, default=10_000_000, help="keys seen in earlier passes (a long job)")
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=Hyperparameters().batch_size)
    args = ap.parse_args()
    batches = criteo_batches(args.lines, args.batch_size)
    counts = KeyCounts()
    for keys in batches:
        counts.add(keys)
    print(
        f"{len(batches)} batches of {args.batch_size} real Criteo lines, {len(counts):,} distinct keys in the pass; "
        f"a batch: {np.mean([len(k) for k in batches]):,.0f} keys, "
        f"{np.mean([len(np.unique(k)) for k in batches]):,.0f} distinct",
        flush=True,
    )
    rng = np.random.default_rng(0)
    timed = batches[: args.batches]
    hyper = Hyperparameters()
    second_hour = KeyCounts()
    second_hour.absorb(counts)
    long_job = KeyCounts()
    long_job.absorb(counts)
    extra = KeyCounts()
    extra.add(rng.integers(0, 2**63, size=args.history, dtype=np.uint64))
    long_job.absorb(extra)
    for label, history in (("a job's second hour", second_hour), (f"after {len(long_job):,} keys seen", long_job)):
        ms = measure(timed, counts, history, hyper)
        print(
            f"{label}: per batch, np.unique alone (the floor) {ms['floor']:.3f} ms; the four per-key inputs "
            f"now {ms['now']:.3f} ms, as before {ms['before']:.3f} ms (now {ms['before'] / ms['now']:.2f}x faster; "
            f"above the floor: {ms['now'] - ms['floor']:.3f} ms against {ms['before'] - ms['floor']:.3f} ms)",
            flush=True,
        )
    min_count = 5
    exported = KeyState()
    exported.observe(counts.keys, counts.counts >= min_count, counts.counts)
    for label, state in (("a first pass", KeyState()), ("a second pass", exported)):
        ms = measure_admission(timed, counts, state, min_count)
        print(
            f"admission (ADMIT_MIN_COUNT={min_count}), {label} ({ms['admitted']:.0%} of the keys fed admitted): "
            f"the training mask per batch now {ms['now']:.3f} ms, with the dict before {ms['before']:.3f} ms "
            f"(now {ms['before'] / ms['now']:.2f}x faster)",
            flush=True,
        )


if __name__ == "__main__":
    main()
