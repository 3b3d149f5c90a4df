"""Feature eviction over simulated online passes: live keys and AUC with EVICT_AFTER_PASSES on and off.

    .venv/bin/python bench/bench_eviction.py            # 24 passes of 5 minutes, 1 trainer + 1 pserver
    .venv/bin/python bench/bench_eviction.py --quick    # 12 passes of 5 minutes, smaller slots

The real trainer (``elastic-control train``, real pserver) on synthetic data whose
vocabulary drifts (``data synth --drift``: VOCAB live feasigns per slot at a time, the Zipf popularity
ranks moving DRIFT feasigns along a stream of feasigns every 5-minute slot: fresh ones enter at the tail
and climb, the head's retire for good, so the feasigns ever seen keep growing as in live click logs),
laid out in sub-hour folders (``PASS_MINUTES=5``) and trained as delta passes (``DELTA_PASSES=1``), is run:

- with ``EVICT_AFTER_PASSES=N`` (default: half the passes; feasigns not pushed for N passes are removed
  from the pservers and appear as deletes in the next delta);
- without eviction (the peer), the same data, twice in the full run: the difference between those two
  runs is the run-to-run noise of asynchronous training (random initial embeddings), the floor any
  comparison of AUCs stands on.

Printed per pass: live keys (keys the pservers hold, from each pass's meta.json), rows of the delta and
its deletes; then the held-out AUC of every run's last pass on the next hour of data (scored from
the pass's whole table, as serving does), the live-key ratio and the AUC difference.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
import time
from pathlib import Path

import pyarrow  # noqa: F401  (before paddle, imported by the scoring helpers)

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_support as B  # noqa: E402
import numpy as np  # noqa: E402

from elastic_control.data.hourly_writer import hour_dir, hour_slots  # noqa: E402
from elastic_control.data.synth import generate, read_truth  # noqa: E402
from elastic_control.metrics import auc  # noqa: E402
from elastic_control.training.cli import hyperparameter_args  # noqa: E402
from elastic_control.training.settings import Hyperparameters  # noqa: E402

SLOTS = tuple(range(1, 9))
MINUTES = 5


def run(root: Path, data: Path, name: str, hours: int, evict: int | None) -> dict:
    extra = f'export PASS_MINUTES="{MINUTES}"\nexport DELTA_PASSES="1"\n'
    if evict:
        extra += f'export EVICT_AFTER_PASSES="{evict}"\n'
    config, slot_conf, models = B.write_job(root / name, data=data, slots=SLOTS, start=B.START, hours=hours)
    config.write_text(config.read_text() + extra)
    t0 = time.monotonic()
    passes = B.train(config, slot_conf, models, args=hyperparameter_args(Hyperparameters(log_every=1000)))
    seconds = time.monotonic() - t0
    metas = [json.loads((p / "meta.json").read_text()) for p in passes]
    return {"name": name, "passes": passes, "metas": metas, "seconds": seconds}


def heldout(data: Path, hours: int) -> tuple[list[str], np.ndarray]:
    """The hour after the training window (its twelve 5-minute slots)."""
    first = B.START + dt.timedelta(hours=hours)
    lines, truth = [], []
    for slot in hour_slots(first, MINUTES):
        got, p = read_truth(hour_dir(data, slot, MINUTES))
        lines += got
        truth.append(p)
    return lines, np.concatenate(truth)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="12 passes, smaller slots")
    ap.add_argument(
        "--repeat", action="store_true", help="run the peer twice (the run-to-run noise); always on in a full run"
    )
    ap.add_argument(
        "--evict-after", type=int, default=None, help="EVICT_AFTER_PASSES of the eviction run (default: passes / 2)"
    )
    ap.add_argument("--drift", type=float, default=25.0, help="popularity ranks moved per 5-minute slot")
    ap.add_argument("--vocab", type=int, default=3000, help="live feasigns per slot at a time")
    args = ap.parse_args()
    hours = 1 if args.quick else 2
    lines_per_hour = 24_000 if args.quick else 48_000  # 2000 / 4000 lines per 5-minute pass
    evict_after = args.evict_after or hours * 60 // MINUTES // 2
    with tempfile.TemporaryDirectory(prefix="bench-eviction-") as tmp:
        root = Path(tmp)
        data = root / "data"
        summary = generate(
            data,
            slots=SLOTS,
            hours=hours + 1,
            lines_per_hour=lines_per_hour,
            seed=11,
            start=B.START,
            minutes=MINUTES,
            drift=args.drift,
            vocab=args.vocab,
        )
        lines, truth = heldout(data, hours)
        labels = np.array([int(ln.split()[1]) for ln in lines])
        print(
            f"data: {summary['lines']} lines, {len(SLOTS)} slots x {args.vocab} feasigns, drift {args.drift:g} "
            f"ranks per {MINUTES}-minute slot; {hours * 60 // MINUTES} training passes, "
            f"EVICT_AFTER_PASSES={evict_after}; held out: the next hour ({len(lines)} lines, "
            f"Bayes-optimal AUC {auc(labels, truth):.4f})",
            flush=True,
        )
        runs = [run(root, data, "evict", hours, evict_after), run(root, data, "keep", hours, None)]
        if args.repeat or not args.quick:
            runs.append(run(root, data, "keep-again", hours, None))
        for r in runs:
            r["auc"] = auc(labels, B.score_pass(r["passes"][-1], lines))
        evict, keep = runs[0], runs[1]
        print(f"\n{'pass':<18} {'live (evict)':>12} {'rows':>6} {'deleted':>8} {'live (keep)':>12} {'rows':>6}")
        for me, mk in zip(evict["metas"], keep["metas"], strict=True):
            a, b = me["metrics"], mk["metrics"]
            print(
                f"{me['pass']:<18} {a['keys_live']:>12} {a['rows']:>6} {a['keys_deleted']:>8} "
                f"{b['keys_live']:>12} {b['rows']:>6}"
            )
        live_e = [m["metrics"]["keys_live"] for m in evict["metas"]]
        live_k = [m["metrics"]["keys_live"] for m in keep["metas"]]
        half = len(live_e) // 2
        print(
            f"\nlive keys at the end: {live_e[-1]} with eviction vs {live_k[-1]} without "
            f"({live_e[-1] / live_k[-1]:.2f}x); second half of the run: with eviction {min(live_e[half:])}.."
            f"{max(live_e[half:])} (growth {live_e[-1] - live_e[half]:+d}), without {live_k[half]}..{live_k[-1]} "
            f"(growth {live_k[-1] - live_k[half]:+d})"
        )
        for r in runs:
            print(f"held-out AUC {r['name']:<10} {r['auc']:.4f}  (training {r['seconds']:.0f}s)")
        print(f"AUC with eviction - without: {evict['auc'] - keep['auc']:+.4f}")
        if len(runs) > 2:
            print(f"run-to-run noise (the same run twice, no eviction): {runs[2]['auc'] - keep['auc']:+.4f}")


if __name__ == "__main__":
    main()
