"""Gate rules: parsing, errors that say how to fix them, and decisions on given metrics."""

from __future__ import annotations

import datetime as dt

import pytest

from ctr_foundation.errors import ConfigError, DataError
from elastic_control.evaluation.gate import GateRule, apply_rule, holdout_window


def test_parse_full_rule():
    r = GateRule.parse(
        "auc_drop<=0.002, calibration=0.9..1.1,logloss_rise<=0.01,auc>=0.6,min_examples>=100,holdout_hours=2"
    )
    assert r.auc_drop == 0.002 and r.calibration == (0.9, 1.1) and r.logloss_rise == 0.01
    assert r.auc == 0.6 and r.min_examples == 100 and r.holdout_hours == 2


@pytest.mark.parametrize(
    "text,match",
    [
        ("", "empty"),
        ("auc_dorp<=0.1", "did you mean 'auc_drop'"),
        ("auc_drop>=0.1", "takes '<='"),
        ("calibration=1.1", "range"),
        ("calibration=1.2..1.1", "0 < A <= B"),
        ("auc_drop<=0.1..0.2", "only calibration"),
        ("holdout_hours=1.5", "positive integer"),
        ("auc_drop", "NAME<=X"),
    ],
)
def test_bad_rules_are_config_errors(text, match):
    with pytest.raises(ConfigError, match=match):
        GateRule.parse(text)


def _m(auc, logloss=0.5, calibration=1.0, examples=1000):
    return {"auc": auc, "logloss": logloss, "calibration": calibration, "examples": examples}


def test_decisions():
    rule = GateRule.parse("auc_drop<=0.002,calibration=0.9..1.1,logloss_rise<=0.01")
    assert apply_rule(rule, {"model": _m(0.7490), "baseline": _m(0.75)}).passed
    d = apply_rule(rule, {"model": _m(0.7470), "baseline": _m(0.75)})
    assert not d.passed and "auc drop" in d.reason
    d = apply_rule(rule, {"model": _m(0.76, calibration=1.2), "baseline": _m(0.75)})
    assert not d.passed and "calibration" in d.reason
    d = apply_rule(rule, {"model": _m(0.76, logloss=0.6), "baseline": _m(0.75)})
    assert not d.passed and "logloss" in d.reason
    assert apply_rule(rule, {"model": _m(0.5)}).passed  # nothing to compare with: calibration only
    d = apply_rule(GateRule.parse("min_examples>=5000"), {"model": _m(0.8)})
    assert not d.passed and "examples" in d.reason
    d = apply_rule(GateRule.parse("auc>=0.6"), {"model": _m(None)})
    assert not d.passed and "one class" in d.reason


def test_holdout_window_prefers_hours_after_training():
    meta = {"window": {"start": "20200101/00", "end": "20200101/05"}}
    ready = {dt.datetime(2020, 1, 1, h) for h in range(0, 8)}
    s, e, after = holdout_window(meta, None, 2, lambda t: t in ready)
    assert (s, e, after) == (dt.datetime(2020, 1, 1, 6), dt.datetime(2020, 1, 1, 7), True)
    s, e, after = holdout_window(meta, None, 3, lambda t: t in ready)
    assert (s, e, after) == (dt.datetime(2020, 1, 1, 3), dt.datetime(2020, 1, 1, 5), False)
    with pytest.raises(DataError, match="window.end"):
        holdout_window({}, None, 1, lambda t: True)
