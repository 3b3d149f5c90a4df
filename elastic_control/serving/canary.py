"""An automated canary: ramp a challenger's share of traffic in steps, judge each step on live feedback.

The controller drives serving's split API only (``PUT /v1/split``, ``POST /v1/split/end``, ``DELETE
/v1/split``) and reads ``GET /v1/monitor`` (the per-arm figures over joined click feedback) and ``GET
/metrics`` (requests by HTTP status), so it runs wherever it can reach serving: beside a local pipeline or
against a Kubernetes Service. For each step (a challenger share in percent) it sets the split, then
watches for the verdict window:

- calibration: the challenger's mean prediction / observed CTR outside ``calibration_band`` once it has
  ``min_feedback`` joined events;
- log loss: the challenger's above the control arm's by more than ``max_logloss_rise`` (both with
  ``min_feedback`` joined events);
- AUC: the challenger's below the control arm's by more than ``max_auc_drop`` once each arm has
  ``min_clicks`` clicks (and as many non-clicks) joined;
- error rate: serving's share of 5xx answers among prediction requests during the step above
  ``max_error_rate`` (serving counts answers by status, not by arm).

A failed criterion aborts at once (within the window): the split is deleted, the control arm serves
everything again. A step whose window passes with every criterion met (or not yet judgeable, when
``require_feedback`` is off) moves on; after the last step (100) the challenger is promoted with
``POST /v1/split/end {"winner": ARM}``. Every step and verdict goes to ``on_record`` (the CLI appends
them to the state folder's canary.jsonl, which ``history`` reads, and logs them to MLflow).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import requests

from elastic_control.serving.arms import CONTROL, SplitError

log = logging.getLogger("elastic_control.serving.canary")
DEFAULT_RAMP = (5.0, 25.0, 50.0, 100.0)
_REQUESTS = re.compile(r'^serving_requests_total\{code="(\d+)"\}\s+([0-9.eE+]+)', re.M)


class CanaryError(Exception):
    """Serving refused or did not answer a split change (the canary cannot go on)."""


def parse_ramp(text: str) -> tuple[float, ...]:
    """``"5,25,50,100"`` -> (5.0, 25.0, 50.0, 100.0): increasing percentages in (0, 100]."""
    try:
        steps = tuple(float(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise SplitError(f"--ramp {text!r}: expected increasing percentages, e.g. 5,25,50,100") from None
    if not steps or any(not 0 < s <= 100 for s in steps) or any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
        raise SplitError(f"--ramp {text!r}: expected increasing percentages in (0, 100], e.g. 5,25,50,100")
    return steps


@dataclass(frozen=True)
class Criteria:
    calibration_band: tuple[float, float] = (0.8, 1.25)
    max_logloss_rise: float = 0.02
    max_auc_drop: float = 0.02
    max_error_rate: float = 0.01
    min_feedback: int = 500  # joined events of an arm before calibration and log loss are judged
    min_clicks: int = 50  # clicks (and non-clicks) of each arm before the AUCs are compared
    require_feedback: bool = True  # a step whose window ends before the challenger could be judged is extended

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Verdict:
    ok: bool | None  # None: not enough joined feedback to judge yet
    failed: list[str] = field(default_factory=list)
    figures: dict = field(default_factory=dict)


def judge(monitor: dict, challenger_arm: str, version: str, criteria: Criteria, error_rate: float | None) -> Verdict:
    """The verdict on ``monitor`` (serving's /v1/monitor document) for the challenger against the control arm."""
    series = monitor.get("series") or []
    mine = next((s for s in series if s["arm"] == challenger_arm and s["version"] == version), None)
    arms = {a["name"]: a for a in monitor.get("arms") or []}
    control_name = next((n for n, a in arms.items() if a.get("pinned") is False or n == CONTROL), CONTROL)
    control_version = (arms.get(control_name) or {}).get("model_version")
    theirs = next((s for s in series if s["arm"] == control_name and s["version"] == control_version), None)
    fb = (mine or {}).get("feedback") or {}
    cfb = (theirs or {}).get("feedback") or {}
    figures = {
        "challenger": {k: fb.get(k) for k in ("count", "clicks", "calibration", "logloss", "auc")},
        "control": {k: cfb.get(k) for k in ("count", "clicks", "calibration", "logloss", "auc")},
        "error_rate": error_rate,
    }
    failed, judged = [], False
    if error_rate is not None and error_rate > criteria.max_error_rate:
        failed.append(f"error rate {error_rate:.4f} above {criteria.max_error_rate}")
    n = fb.get("count") or 0
    if n >= criteria.min_feedback:
        judged = True
        cal, (low, high) = fb.get("calibration"), criteria.calibration_band
        if cal is not None and not low <= cal <= high:
            failed.append(f"calibration {cal:.3f} outside {low}..{high} over {n} joined events")
        ll, cll = fb.get("logloss"), cfb.get("logloss")
        if ll is not None and cll is not None and (cfb.get("count") or 0) >= criteria.min_feedback:
            if ll - cll > criteria.max_logloss_rise:
                rise = criteria.max_logloss_rise
                failed.append(f"log loss {ll:.4f} above the control's {cll:.4f} by more than {rise}")
    if _enough_clicks(fb, criteria.min_clicks) and _enough_clicks(cfb, criteria.min_clicks):
        auc, cauc = fb.get("auc"), cfb.get("auc")
        if auc is not None and cauc is not None and cauc - auc > criteria.max_auc_drop:
            failed.append(f"AUC {auc:.4f} below the control's {cauc:.4f} by more than {criteria.max_auc_drop}")
    if failed:
        return Verdict(False, failed, figures)
    return Verdict(True if judged else None, [], figures)


def _enough_clicks(fb: dict, least: int) -> bool:
    clicks, count = fb.get("clicks") or 0, fb.get("count") or 0
    return clicks >= least and count - clicks >= least


class ServingSplitApi:
    """The few calls the canary makes to serving."""

    def __init__(self, url: str, token: str | None, timeout: float = 120.0):
        self.url, self.timeout = url.rstrip("/"), timeout
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        try:
            r = requests.request(method, self.url + path, json=body, headers=self.headers, timeout=self.timeout)
        except requests.RequestException as e:
            raise CanaryError(f"serving at {self.url} did not answer {method} {path}: {e}") from e
        if r.status_code != 200:
            raise CanaryError(f"serving refused {method} {path} (HTTP {r.status_code}): {r.text.strip()[:300]}")
        return r.json()

    def put_split(self, challenger_arm: str, version: str, percent: float) -> dict:
        arms = [
            {"name": CONTROL, "weight": 100.0 - percent},
            {"name": challenger_arm, "weight": percent, "version": version},
        ]
        return self._call("PUT", "/v1/split", {"arms": arms})

    def promote(self, arm: str) -> dict:
        return self._call("POST", "/v1/split/end", {"winner": arm})

    def abort(self) -> dict:
        return self._call("DELETE", "/v1/split")

    def monitor(self) -> dict:
        return self._call("GET", "/v1/monitor")

    def request_counts(self) -> tuple[int, int]:
        """(prediction requests answered, of them 5xx) so far."""
        try:
            text = requests.get(self.url + "/metrics", headers=self.headers, timeout=self.timeout).text
        except requests.RequestException as e:
            raise CanaryError(f"serving at {self.url} did not answer GET /metrics: {e}") from e
        total = errors = 0
        for code, n in _REQUESTS.findall(text):
            total += int(float(n))
            if code.startswith("5"):
                errors += int(float(n))
        return total, errors


@dataclass
class CanaryResult:
    outcome: str  # promoted | aborted | failed
    version: str
    arm: str
    steps: list[dict]
    reason: str = ""

    def to_json(self) -> dict:
        return asdict(self)


class Canary:
    """One canary run: ``run()`` ramps, judges, then promotes or aborts (see the module docstring)."""

    def __init__(
        self,
        api: ServingSplitApi,
        version: str,
        *,
        arm: str = "challenger",
        ramp: tuple[float, ...] = DEFAULT_RAMP,
        window_s: float = 300.0,
        max_wait_s: float | None = None,
        poll_s: float = 2.0,
        criteria: Criteria | None = None,
        on_record: Callable[[dict], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.api, self.version, self.arm, self.ramp = api, version, arm, ramp
        self.window_s, self.poll_s = window_s, poll_s
        self.max_wait_s = max_wait_s if max_wait_s is not None else 4 * window_s  # judgeable by then, or abort
        self.criteria = criteria or Criteria()
        self.on_record = on_record or (lambda _r: None)
        self.clock, self.sleep = clock, sleep
        self.steps: list[dict] = []

    def _record(self, event: str, **fields) -> dict:
        rec = {"event": event, "version": self.version, "arm": self.arm, "at": time.time(), **fields}
        self.on_record(rec)
        log.info("canary %s: %s", event, {k: v for k, v in fields.items() if k != "figures"})
        return rec

    def run(self) -> CanaryResult:
        self._record("started", ramp=list(self.ramp), window_s=self.window_s, criteria=self.criteria.to_json())
        try:
            for percent in self.ramp:
                verdict = self._step(percent)
                if verdict.ok is False or verdict.ok is None:
                    reason = "; ".join(verdict.failed) or (
                        f"not enough joined feedback to judge the challenger within {self.max_wait_s:g}s"
                    )
                    self.api.abort()
                    self._record("aborted", percent=percent, reason=reason, figures=verdict.figures)
                    return CanaryResult("aborted", self.version, self.arm, self.steps, reason)
            self.api.promote(self.arm)
            self._record("promoted", percent=100.0)
            return CanaryResult("promoted", self.version, self.arm, self.steps)
        except CanaryError as e:
            try:
                self.api.abort()
            except CanaryError:
                pass
            self._record("failed", reason=str(e))
            return CanaryResult("failed", self.version, self.arm, self.steps, str(e))

    def _step(self, percent: float) -> Verdict:
        self.api.put_split(self.arm, self.version, percent)
        started = self.clock()
        total0, errors0 = self.api.request_counts()
        self._record("step", percent=percent)
        verdict = Verdict(None)
        while True:
            self.sleep(self.poll_s)
            total, errors = self.api.request_counts()
            rate = (errors - errors0) / (total - total0) if total > total0 else None
            verdict = judge(self.api.monitor(), self.arm, self.version, self.criteria, rate)
            elapsed = self.clock() - started
            if verdict.ok is False:
                break
            if elapsed >= self.window_s and (verdict.ok or not self.criteria.require_feedback):
                break
            if elapsed >= self.max_wait_s:
                break
        outcome = {True: "passed", False: "failed", None: "undecided"}[verdict.ok]
        if verdict.ok is None and not self.criteria.require_feedback and self.clock() - started < self.max_wait_s:
            outcome, verdict.ok = "passed", True  # judged on errors only, as asked
        step = {"percent": percent, "verdict": outcome, "seconds": round(self.clock() - started, 2)}
        step.update(failed=verdict.failed, figures=verdict.figures)
        self.steps.append(step)
        self._record("verdict", **step)
        return verdict
