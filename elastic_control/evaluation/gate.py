"""The promotion gate: is a candidate pass good enough to replace the active one?

cube-transfer calls ``evaluate_candidate(candidate, active_or_None, rule)``
before a rollout when a gate is configured; a failed gate keeps the active
version and records the pass as rejected.

Rule syntax (comma-separated clauses, all must hold)::

    auc_drop<=0.002          candidate AUC >= active AUC - 0.002 (skipped without an active pass)
    logloss_rise<=0.01       candidate log loss <= active log loss + 0.01 (skipped without an active pass)
    calibration=0.9..1.1     candidate predicted CTR / observed CTR within [0.9, 1.1]
    auc>=0.7                 absolute floor on the candidate's AUC
    min_examples>=1000       at least this many hold-out examples, else the gate fails
    holdout_hours=1          hold-out window length in hours (default 1)

Hold-out data: the ``holdout_hours`` hours right after the candidate's
training window (meta.json ``window.end`` + 1 hour onwards), read with the
data.config the gate is given (default: ``ELASTIC_CTR_DATA_CONFIG``), so the
candidate is judged on hours it never trained on. If those hours are not
complete yet, the last ``holdout_hours`` complete hours up to and including the
window end are used instead and the decision says so (they are then training
data of the candidate: a weaker check, but never a silent pass).
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass, field
from pathlib import Path

from ctr_foundation.env_vars import DATA_CONFIG
from ctr_foundation.errors import ConfigError, DataError, UsageError
from ctr_foundation.pass_format import load_pass
from elastic_control.config.data_config import load_data_config, parse_slot
from elastic_control.data.readers import HourlyData
from elastic_control.evaluation.parallel import evaluate
from elastic_control.evaluation.shares import EvalSpec
from elastic_control.evaluation.tracking import log_gate_decision

_NUMBER = r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?"
_CLAUSE = re.compile(rf"^\s*([a-z_]+)\s*(<=|>=|=)\s*({_NUMBER})(?:\s*\.\.\s*({_NUMBER}))?\s*$")
_KNOWN = {
    "auc_drop": "<=",
    "logloss_rise": "<=",
    "calibration": "=",
    "auc": ">=",
    "min_examples": ">=",
    "holdout_hours": "=",
}


@dataclass(frozen=True)
class GateRule:
    auc_drop: float | None = None
    logloss_rise: float | None = None
    calibration: tuple[float, float] | None = None
    auc: float | None = None
    min_examples: int = 1
    holdout_hours: int = 1
    text: str = ""

    @classmethod
    def parse(cls, text: str) -> GateRule:
        """Parse 'auc_drop<=0.002,calibration=0.9..1.1'; ConfigError naming the bad clause."""
        values: dict = {}
        if not text or not text.strip():
            raise ConfigError("the gate rule is empty (e.g. 'auc_drop<=0.002,calibration=0.9..1.1')")
        for clause in text.split(","):
            m = _CLAUSE.match(clause)
            if not m:
                raise ConfigError(
                    f"gate rule clause {clause.strip()!r} is not NAME<=X, NAME>=X, NAME=X or NAME=A..B "
                    f"(names: {', '.join(_KNOWN)})"
                )
            name, op, a, b = m.groups()
            if name not in _KNOWN:
                import difflib

                close = difflib.get_close_matches(name, _KNOWN, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f" (known: {', '.join(_KNOWN)})"
                raise ConfigError(f"unknown gate rule {name!r}{hint}")
            if op != _KNOWN[name]:
                raise ConfigError(
                    f"gate rule {name!r} takes {_KNOWN[name]!r}, e.g. "
                    f"{name}{_KNOWN[name]}{'0.9..1.1' if name == 'calibration' else '1'}"
                )
            try:
                lo = float(a)
                hi = float(b) if b is not None else None
            except ValueError:
                raise ConfigError(f"gate rule {clause.strip()!r}: not a number") from None
            if name == "calibration":
                if hi is None or not 0 < lo <= hi:
                    raise ConfigError(f"gate rule {clause.strip()!r}: calibration needs a range A..B with 0 < A <= B")
                values[name] = (lo, hi)
            elif hi is not None:
                raise ConfigError(f"gate rule {clause.strip()!r}: only calibration takes a range")
            elif name in ("min_examples", "holdout_hours"):
                if lo != int(lo) or lo < 1:
                    raise ConfigError(f"gate rule {clause.strip()!r}: {name} must be a positive integer")
                values[name] = int(lo)
            else:
                if lo < 0 and name != "auc":
                    raise ConfigError(f"gate rule {clause.strip()!r}: {name} must be >= 0")
                values[name] = lo
        return cls(**values, text=text.strip())


@dataclass
class GateDecision:
    passed: bool
    reason: str
    metrics: dict = field(default_factory=dict)


def holdout_window(candidate_meta: dict, config, hours: int, ready) -> tuple[dt.datetime, dt.datetime, bool]:
    """(start, end, after_training): the hours after the candidate's window, or the last ones of it.

    With PASS_MINUTES the hours are counted in sub-hour slots (``hours * 60 / PASS_MINUTES`` of them) and
    the candidate's window end is a slot (``YYYYMMDD/HHMM``).
    """
    try:
        end = parse_slot(candidate_meta["window"]["end"], key="meta.json window.end")
    except (KeyError, TypeError):
        raise DataError("the candidate's meta.json has no window.end: cannot choose hold-out hours") from None
    step = config.step if config is not None else dt.timedelta(hours=1)
    n = hours * (dt.timedelta(hours=1) // step)
    after = [end + step * (i + 1) for i in range(n)]
    if all(ready(h) for h in after):
        return after[0], after[-1], True
    within = [end - step * i for i in range(n)][::-1]
    return within[0], within[-1], False


def evaluate_candidate(
    candidate_pass_dir,
    active_pass_dir_or_None,
    rule,
    *,
    data_config=None,
    workers: int | None = None,
    record: bool = True,
) -> GateDecision:
    """Evaluate the candidate (and the active pass) on hold-out hours and apply ``rule``.

    ``rule`` is a GateRule or its text. ``data_config`` defaults to the
    ELASTIC_CTR_DATA_CONFIG file. Bad input (unparsable rule, no data config)
    raises; a candidate that cannot be scored on the hold-out data fails the gate.
    The decision is recorded in MLflow unless ``record`` is False.
    """
    rule = rule if isinstance(rule, GateRule) else GateRule.parse(rule)
    data_config = data_config or DATA_CONFIG.get()
    if not data_config:
        raise UsageError("the gate needs the data.config of the hold-out data (set ELASTIC_CTR_DATA_CONFIG)")
    candidate = load_pass(candidate_pass_dir)
    active = str(active_pass_dir_or_None) if active_pass_dir_or_None else None
    if active and Path(active).resolve() == candidate.path.resolve():
        active = None
    config = load_data_config(data_config)

    def ready(hour: dt.datetime) -> bool:
        return HourlyData(config).is_ready(hour)

    start, end, after_training = holdout_window(candidate.meta, config, rule.holdout_hours, ready)
    window = f"{config.format_slot(start)}..{config.format_slot(end)}"
    note = "" if after_training else " (no complete hour after the training window yet: judged on its last hours)"
    try:
        spec = EvalSpec.create(
            model=str(candidate.path),
            data_config=data_config,
            shares=workers or 1,
            baseline=active,
            start=config.format_slot(start),
            end=config.format_slot(end),
        )
        result = evaluate(spec, workers=workers or 1)
        metrics = result.metrics
    except DataError as e:
        decision = GateDecision(False, f"hold-out {window}{note}: cannot evaluate: {e}", {})
    else:
        metrics["holdout"] = {
            "start": config.format_slot(start),
            "end": config.format_slot(end),
            "after_training": after_training,
        }
        decision = apply_rule(rule, metrics)
        decision.reason = f"hold-out {window}{note}: {decision.reason}"
    if record:
        log_gate_decision(decision, str(candidate.path), active, rule.text)
    return decision


def apply_rule(rule: GateRule, metrics: dict) -> GateDecision:
    """Judge evaluation metrics (model and, if present, baseline) against a rule."""
    m, base = metrics["model"], metrics.get("baseline")
    failures, checks = [], []

    def check(ok: bool, text: str):
        (checks if ok else failures).append(text)

    check(m["examples"] >= rule.min_examples, f"examples {m['examples']} >= {rule.min_examples}")
    if m.get("auc") is None and (rule.auc is not None or rule.auc_drop is not None):
        failures.append("AUC undefined on the hold-out data (one class only)")
    if rule.auc is not None and m.get("auc") is not None:
        check(m["auc"] >= rule.auc, f"auc {m['auc']:.6f} >= {rule.auc}")
    if rule.calibration is not None:
        lo, hi = rule.calibration
        c = m.get("calibration")
        check(
            c is not None and lo <= c <= hi,
            f"calibration {c:.4f} in {lo}..{hi}" if c is not None else "calibration undefined (no clicks)",
        )
    if base is not None:
        if rule.auc_drop is not None and m.get("auc") is not None and base.get("auc") is not None:
            drop = base["auc"] - m["auc"]
            check(
                drop <= rule.auc_drop,
                f"auc drop {drop:+.6f} (active {base['auc']:.6f} -> candidate {m['auc']:.6f}) <= {rule.auc_drop}",
            )
        if rule.logloss_rise is not None:
            rise = m["logloss"] - base["logloss"]
            check(rise <= rule.logloss_rise, f"logloss rise {rise:+.6f} <= {rule.logloss_rise}")
    else:
        checks.append("no active pass to compare with")
    if failures:
        return GateDecision(False, "rejected: " + "; ".join(failures), metrics)
    return GateDecision(True, "promoted: " + "; ".join(checks), metrics)
