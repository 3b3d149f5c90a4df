"""Live quality per A/B arm and model version, over a sliding time window, with alerts.

For each (arm, version) serving keeps time buckets (``window_s / buckets`` seconds each) of:
predictions (count, sum of probabilities), joined click feedback (count, clicks, sums of p, p², p·y,
log loss and its square, and score histograms of positives and negatives for the AUC), and per slot
the keys looked up and the keys cube did not know. ``summary`` folds the buckets of the last window
into the figures ``/metrics``, ``/v1/monitor``, ``status`` and the A/B report show:

- mean prediction over every prediction; over joined feedback: observed CTR, mean prediction,
  calibration = mean prediction / observed CTR, log loss (predictions clipped to float32 epsilon,
  as offline evaluation does) and AUC (ties within a histogram bin of 1/400 in logit counted 1/2:
  within ~1e-3 of the exact ROC AUC on CTR scores);
- feature coverage: per slot the share of keys cube did not know.

Alerts (``AlertRules``): calibration outside a band once an arm has enough joined feedback, and a
slot whose known-key share falls under a floor once it has enough keys.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from elastic_control.metrics import ScoreCounts, auc_from_counts


def _histogram_auc(pos: np.ndarray, neg: np.ndarray) -> float | None:
    """AUC of per-bin click/no-click counts in score order (the one AUC: elastic_control.metrics)."""
    return auc_from_counts(ScoreCounts(np.arange(len(pos), dtype=np.uint32), pos, neg))[0]


AUC_BINS = 9600
LOGIT_RANGE = 12.0  # scores are binned by logit in [-12, 12]
EPS = float(np.finfo(np.float32).eps)


@dataclass(frozen=True)
class AlertRules:
    calibration_low: float = 0.8
    calibration_high: float = 1.25
    coverage_floor: float = 0.5  # least share of a slot's keys cube must know
    min_feedback: int = 500  # joined events in the window before calibration is judged
    min_keys: int = 1000  # keys of a slot in the window before its coverage is judged

    @classmethod
    def parse_band(cls, text: str) -> tuple[float, float]:
        lo, sep, hi = text.partition("..")
        try:
            low, high = float(lo), float(hi)
        except ValueError:
            raise ValueError(f"calibration band {text!r} must look like LOW..HIGH, e.g. 0.8..1.25") from None
        if not sep or not 0 < low < 1 < high:
            raise ValueError(f"calibration band {text!r} must have 0 < LOW < 1 < HIGH")
        return low, high


def logit_bins(p: np.ndarray) -> np.ndarray:
    p = np.clip(np.asarray(p, np.float64), 1e-12, 1 - 1e-12)
    z = np.log(p) - np.log1p(-p)
    b = np.floor((z + LOGIT_RANGE) * (AUC_BINS / (2 * LOGIT_RANGE))).astype(np.int64)
    return np.clip(b, 0, AUC_BINS - 1)


class _Bucket:
    __slots__ = (
        "predictions",
        "pred_sum",
        "fb",
        "clicks",
        "fb_p",
        "fb_p2",
        "fb_py",
        "ll",
        "ll2",
        "pos",
        "neg",
        "slot_keys",
        "slot_unknown",
    )

    def __init__(self, num_slots: int):
        self.predictions = 0
        self.pred_sum = 0.0
        self.fb = 0
        self.clicks = 0
        self.fb_p = self.fb_p2 = self.fb_py = self.ll = self.ll2 = 0.0
        self.pos: np.ndarray | None = None  # score histograms, allocated with the first feedback
        self.neg: np.ndarray | None = None
        self.slot_keys = np.zeros(num_slots, np.int64)
        self.slot_unknown = np.zeros(num_slots, np.int64)


class _Series:
    def __init__(self, arm: str, version: str, slots: Sequence[int]):
        self.arm, self.version, self.slots = arm, version, tuple(slots)
        self.buckets: deque[tuple[int, _Bucket]] = deque()
        self.total_predictions = 0
        self.total_feedback = 0
        self.last_seen = time.time()

    def bucket(self, index: int) -> _Bucket:
        if not self.buckets or self.buckets[-1][0] != index:
            self.buckets.append((index, _Bucket(len(self.slots))))
        return self.buckets[-1][1]


class Monitor:
    def __init__(self, *, window_s: float = 600.0, buckets: int = 10, rules: AlertRules | None = None):
        self.window_s = float(window_s)
        self.bucket_s = self.window_s / buckets
        self.nbuckets = buckets
        self.rules = rules or AlertRules()
        self._series: dict[tuple[str, str], _Series] = {}
        self._lock = threading.Lock()

    def _index(self, now: float) -> int:
        return int(now // self.bucket_s)

    def _get(self, arm: str, version: str, slots: Sequence[int] = ()) -> _Series:
        s = self._series.get((arm, version))
        if s is None:
            s = self._series[(arm, version)] = _Series(arm, version, slots)
        return s

    def observe_predictions(
        self,
        arm: str,
        version: str,
        slots: Sequence[int],
        probabilities: np.ndarray,
        slot_keys: np.ndarray,
        slot_unknown: np.ndarray,
        now: float | None = None,
    ) -> None:
        """One scored batch of an arm: its probabilities and, per slot position, keys looked up / not known."""
        now = time.time() if now is None else now
        with self._lock:
            s = self._get(arm, version, slots)
            if len(s.slots) != len(slots):  # first seen through feedback: learn the slots now
                s.slots = tuple(slots)
                s.buckets.clear()
            b = s.bucket(self._index(now))
            b.predictions += len(probabilities)
            b.pred_sum += float(np.sum(probabilities, dtype=np.float64))
            b.slot_keys += slot_keys
            b.slot_unknown += slot_unknown
            s.total_predictions += len(probabilities)
            s.last_seen = now

    def observe_feedback(
        self, arm: str, version: str, probabilities: np.ndarray, clicks: np.ndarray, now: float | None = None
    ) -> None:
        now = time.time() if now is None else now
        p = np.asarray(probabilities, np.float64)
        y = np.asarray(clicks, np.int64)
        pc = np.clip(p, EPS, 1 - EPS)
        ll = -(y * np.log(pc) + (1 - y) * np.log1p(-pc))
        bins = logit_bins(p)
        with self._lock:
            s = self._get(arm, version)
            b = s.bucket(self._index(now))
            b.fb += len(p)
            b.clicks += int(y.sum())
            b.fb_p += float(p.sum())
            b.fb_p2 += float((p * p).sum())
            b.fb_py += float((p * y).sum())
            b.ll += float(ll.sum())
            b.ll2 += float((ll * ll).sum())
            if b.pos is None:
                b.pos, b.neg = np.zeros(AUC_BINS, np.int64), np.zeros(AUC_BINS, np.int64)
            b.pos += np.bincount(bins[y == 1], minlength=AUC_BINS)
            b.neg += np.bincount(bins[y == 0], minlength=AUC_BINS)
            s.total_feedback += len(p)
            s.last_seen = now

    def summary(self, now: float | None = None) -> list[dict]:
        """Per (arm, version): the window's figures (see the module docstring); plain JSON."""
        now = time.time() if now is None else now
        oldest = self._index(now) - self.nbuckets + 1
        out = []
        with self._lock:
            for key, s in list(self._series.items()):
                while s.buckets and s.buckets[0][0] < oldest:
                    s.buckets.popleft()
                if not s.buckets and now - s.last_seen > self.window_s:
                    del self._series[key]  # an arm/version with nothing left in the window
                    continue
                out.append(_fold(s))
        return sorted(out, key=lambda d: (d["arm"], d["version"]))

    def alerts(self, summary: list[dict] | None = None) -> list[dict]:
        summary = self.summary() if summary is None else summary
        rules = self.rules
        found = []
        for s in summary:
            fb = s["feedback"]
            cal = fb["calibration"]
            if fb["count"] >= rules.min_feedback and cal is not None:
                if not rules.calibration_low <= cal <= rules.calibration_high:
                    found.append(
                        {
                            "kind": "calibration",
                            "arm": s["arm"],
                            "version": s["version"],
                            "value": cal,
                            "threshold": [rules.calibration_low, rules.calibration_high],
                            "message": (
                                f"arm {s['arm']} ({s['version']}): calibration {cal:.3f} outside "
                                f"{rules.calibration_low}..{rules.calibration_high} over {fb['count']} clicks fed back"
                            ),
                        }
                    )
            for slot, c in s["coverage"]["slots"].items():
                if c["keys"] >= rules.min_keys and 1 - c["unknown_share"] < rules.coverage_floor:
                    found.append(
                        {
                            "kind": "coverage",
                            "arm": s["arm"],
                            "version": s["version"],
                            "slot": slot,
                            "value": 1 - c["unknown_share"],
                            "threshold": rules.coverage_floor,
                            "message": (
                                f"arm {s['arm']} ({s['version']}): slot {slot} known-key share "
                                f"{1 - c['unknown_share']:.3f} below {rules.coverage_floor} over {c['keys']} keys"
                            ),
                        }
                    )
        return found


def _fold(s: _Series) -> dict:
    predictions = pred_sum = fb = clicks = 0
    fb_p = fb_p2 = fb_py = ll = ll2 = 0.0
    pos = np.zeros(AUC_BINS, np.int64)
    neg = np.zeros(AUC_BINS, np.int64)
    keys = np.zeros(len(s.slots), np.int64)
    unknown = np.zeros(len(s.slots), np.int64)
    for _, b in s.buckets:
        predictions += b.predictions
        pred_sum += b.pred_sum
        fb += b.fb
        clicks += b.clicks
        fb_p += b.fb_p
        fb_p2 += b.fb_p2
        fb_py += b.fb_py
        ll += b.ll
        ll2 += b.ll2
        if b.pos is not None:
            pos += b.pos
            neg += b.neg
        if len(b.slot_keys) == len(keys):
            keys += b.slot_keys
            unknown += b.slot_unknown
    ctr = clicks / fb if fb else None
    mean_fb = fb_p / fb if fb else None
    total_keys = int(keys.sum())
    return {
        "arm": s.arm,
        "version": s.version,
        "predictions": {
            "count": predictions,
            "mean": pred_sum / predictions if predictions else None,
            "total": s.total_predictions,
        },
        "feedback": {
            "count": fb,
            "clicks": clicks,
            "observed_ctr": ctr,
            "mean_prediction": mean_fb,
            "calibration": (mean_fb / ctr) if ctr else None,
            "logloss": ll / fb if fb else None,
            "auc": _histogram_auc(pos, neg),
            "total": s.total_feedback,
            # raw sums, for confidence intervals (A/B report)
            "sums": {"p": fb_p, "p2": fb_p2, "py": fb_py, "logloss": ll, "logloss2": ll2},
        },
        "coverage": {
            "keys": total_keys,
            "unknown_share": (int(unknown.sum()) / total_keys) if total_keys else None,
            "slots": {
                str(slot): {"keys": int(k), "unknown_share": (int(u) / int(k)) if k else None}
                for slot, k, u in zip(s.slots, keys.tolist(), unknown.tolist(), strict=True)
            },
        },
    }


def prometheus_lines(summary: list[dict], alerts: list[dict], weights: dict[str, float]) -> list[str]:
    """The window's figures as Prometheus gauges labelled by arm and version (and slot)."""
    lines: list[str] = []

    def family(name: str, kind: str, doc: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP {name} {doc}", f"# TYPE {name} {kind}"])
        lines.extend(f"{name}{{{labels}}} {_num(v)}" for labels, v in samples)

    def lab(s: dict, **extra) -> str:
        pairs = {"arm": s["arm"], "version": s["version"], **extra}
        return ",".join(f'{k}="{_escape(str(v))}"' for k, v in pairs.items())

    fields = [
        (
            "serving_arm_predictions_total",
            "counter",
            "Predictions answered by arm and version.",
            "predictions",
            "total",
        ),
        ("serving_arm_window_predictions", "gauge", "Predictions in the window.", "predictions", "count"),
        ("serving_arm_window_mean_prediction", "gauge", "Mean predicted CTR in the window.", "predictions", "mean"),
        ("serving_arm_feedback_total", "counter", "Click feedback events joined.", "feedback", "total"),
        ("serving_arm_window_feedback", "gauge", "Joined feedback events in the window.", "feedback", "count"),
        ("serving_arm_window_clicks", "gauge", "Clicks among them.", "feedback", "clicks"),
        ("serving_arm_window_observed_ctr", "gauge", "Observed CTR of joined feedback.", "feedback", "observed_ctr"),
        (
            "serving_arm_window_calibration",
            "gauge",
            "Mean prediction / observed CTR of joined feedback.",
            "feedback",
            "calibration",
        ),
        ("serving_arm_window_logloss", "gauge", "Log loss of joined feedback.", "feedback", "logloss"),
        ("serving_arm_window_auc", "gauge", "AUC of joined feedback.", "feedback", "auc"),
    ]
    for name, kind, doc, group, key in fields:
        family(name, kind, doc, [(lab(s), s[group][key]) for s in summary if s[group][key] is not None])
    family(
        "serving_arm_window_unknown_key_share",
        "gauge",
        "Share of a slot's keys cube did not know, in the window (feature coverage).",
        [
            (lab(s, slot=slot), c["unknown_share"])
            for s in summary
            for slot, c in s["coverage"]["slots"].items()
            if c["unknown_share"] is not None
        ],
    )
    family(
        "serving_split_weight",
        "gauge",
        "A/B split weight of each arm.",
        [(f'arm="{a}"', w) for a, w in weights.items()],
    )
    family(
        "serving_alert",
        "gauge",
        "1 for each alert in force (calibration band, coverage floor).",
        [
            (
                ",".join(
                    f'{k}="{_escape(str(a[k]))}"' for k in ("kind", "arm", "version", "slot") if a.get(k) is not None
                ),
                1,
            )
            for a in alerts
        ],
    )
    return lines


def _num(v: float) -> str:
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return "NaN"
    return repr(float(v)) if isinstance(v, float) else str(v)


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
