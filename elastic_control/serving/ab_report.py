"""``elastic-control ab-report``: the A/B arms compared from serving's live metrics, with 95% intervals.

Reads ``/v1/monitor`` (the sliding window of joined click feedback per arm and version) and reports,
per arm: predictions, feedback events, observed CTR (Wilson interval), calibration = mean prediction
/ observed CTR (delta-method interval), log loss (normal interval) and AUC (Hanley-McNeil interval);
then each challenger against the control arm: the differences of CTR, calibration, log loss and AUC
with their intervals, and whether each interval excludes 0. ``report(monitor)`` is the pure function
(status views can call it too); the command prints a table, or ``--json``.
"""

from __future__ import annotations

import json
import math

import click

from client.api import ServingClient, resolve_client_settings
from ctr_foundation.env_vars import STATE_DIR

Z = 1.959963984540054  # two-sided 95%


def _interval(value: float | None, se: float | None) -> list[float] | None:
    if value is None or se is None or not math.isfinite(se):
        return None
    return [value - Z * se, value + Z * se]


def wilson(clicks: int, n: int) -> list[float] | None:
    if n == 0:
        return None
    p = clicks / n
    denom = 1 + Z * Z / n
    centre = (p + Z * Z / (2 * n)) / denom
    half = Z * math.sqrt(p * (1 - p) / n + Z * Z / (4 * n * n)) / denom
    return [centre - half, centre + half]


def arm_figures(series: dict) -> dict:
    """One arm/version's window: point estimates, standard errors and 95% intervals."""
    fb = series["feedback"]
    n, clicks, sums = fb["count"], fb["clicks"], fb["sums"]
    out = {
        "arm": series["arm"],
        "version": series["version"],
        "predictions": series["predictions"]["count"],
        "mean_prediction": series["predictions"]["mean"],
        "feedback": n,
        "clicks": clicks,
        "ctr": fb["observed_ctr"],
        "ctr_ci": wilson(clicks, n),
        "ctr_se": math.sqrt(fb["observed_ctr"] * (1 - fb["observed_ctr"]) / n) if n else None,
        "calibration": fb["calibration"],
        "calibration_se": None,
        "logloss": fb["logloss"],
        "logloss_se": None,
        "auc": fb["auc"],
        "auc_se": None,
    }
    if n >= 2:
        p_mean, y_mean = sums["p"] / n, clicks / n
        var_p = max(sums["p2"] / n - p_mean**2, 0.0)
        cov_py = sums["py"] / n - p_mean * y_mean
        var_y = y_mean * (1 - y_mean)
        if y_mean > 0 and p_mean > 0:
            r = p_mean / y_mean
            rel = var_p / p_mean**2 + var_y / y_mean**2 - 2 * cov_py / (p_mean * y_mean)
            out["calibration_se"] = r * math.sqrt(max(rel, 0.0) / n)
        ll_mean = sums["logloss"] / n
        out["logloss_se"] = math.sqrt(max(sums["logloss2"] / n - ll_mean**2, 0.0) / n)
        auc = fb["auc"]
        pos, neg = clicks, n - clicks
        if auc is not None and pos and neg:
            q1, q2 = auc / (2 - auc), 2 * auc * auc / (1 + auc)
            var = (auc * (1 - auc) + (pos - 1) * (q1 - auc * auc) + (neg - 1) * (q2 - auc * auc)) / (pos * neg)
            out["auc_se"] = math.sqrt(max(var, 0.0))
    out["calibration_ci"] = _interval(out["calibration"], out["calibration_se"])
    out["logloss_ci"] = _interval(out["logloss"], out["logloss_se"])
    out["auc_ci"] = _interval(out["auc"], out["auc_se"])
    return out


def _difference(a: dict, b: dict, key: str) -> dict:
    va, vb, sa, sb = a.get(key), b.get(key), a.get(f"{key}_se"), b.get(f"{key}_se")
    if va is None or vb is None:
        return {"difference": None, "ci": None, "excludes_zero": None}
    diff = va - vb
    ci = _interval(diff, math.sqrt(sa * sa + sb * sb)) if sa is not None and sb is not None else None
    return {"difference": diff, "ci": ci, "excludes_zero": None if ci is None else not ci[0] <= 0 <= ci[1]}


def report(monitor: dict) -> dict:
    """The A/B report of a ``/v1/monitor`` document: arms in force, their figures and the comparisons."""
    in_force = {(a["name"], a["model_version"]): a for a in monitor.get("arms", [])}
    arms = []
    for s in monitor.get("series", []):
        if (s["arm"], s["version"]) in in_force:
            fig = arm_figures(s)
            fig["weight"] = in_force[(s["arm"], s["version"])]["weight"]
            fig["pinned"] = in_force[(s["arm"], s["version"])]["pinned"]
            arms.append(fig)
    control = next((a for a in arms if not a["pinned"]), None)
    comparisons = []
    for a in arms:
        if control is None or a is control:
            continue
        comparisons.append(
            {
                "challenger": a["arm"],
                "control": control["arm"],
                **{key: _difference(a, control, key) for key in ("ctr", "calibration", "logloss", "auc")},
            }
        )
    return {
        "window_seconds": monitor.get("window_seconds"),
        "arms": arms,
        "comparisons": comparisons,
        "alerts": monitor.get("alerts", []),
    }


def _fmt(value, ci=None, digits=4) -> str:
    if value is None:
        return "-"
    text = f"{value:.{digits}f}"
    if ci:
        text += f" [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"
    return text


def render(rep: dict) -> str:
    lines = [f"A/B report over the last {rep['window_seconds']:.0f} s of feedback (95% intervals)"]
    lines.append(f"{'arm':<12} {'version':<20} {'weight':>6} {'preds':>8} {'clicks/fb':>13}  figures")
    for a in rep["arms"]:
        lines.append(
            f"{a['arm']:<12} {a['version']:<20} {a['weight']:>6.2f} {a['predictions']:>8} "
            f"{a['clicks']:>6}/{a['feedback']:<6}  ctr {_fmt(a['ctr'], a['ctr_ci'])}  "
            f"cal {_fmt(a['calibration'], a['calibration_ci'], 3)}  "
            f"ll {_fmt(a['logloss'], a['logloss_ci'])}  auc {_fmt(a['auc'], a['auc_ci'])}"
        )
    for c in rep["comparisons"]:
        parts = []
        for key in ("ctr", "calibration", "logloss", "auc"):
            d = c[key]
            mark = "*" if d["excludes_zero"] else ""
            parts.append(f"{key} {_fmt(d['difference'], d['ci'])}{mark}")
        lines.append(f"{c['challenger']} - {c['control']}: " + "  ".join(parts))
    if rep["comparisons"]:
        lines.append("* the interval excludes 0")
    elif len(rep["arms"]) < 2:
        lines.append("no split in force: one arm, nothing to compare")
    for alert in rep["alerts"]:
        lines.append(f"ALERT {alert['message']}")
    return "\n".join(lines)


@click.command("ab-report", context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--serving", "serving_url", default=None, help="Serving URL (default: $ELASTIC_CTR_SERVING_URL, client.json)."
)
@click.option("--state-dir", default=None, type=click.Path(file_okay=False), help="State folder holding client.json.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON document.")
@click.pass_context
def ab_report_command(ctx, serving_url, state_dir, as_json):
    """Compare the A/B arms on live click feedback (serving's /v1/monitor), with 95% confidence intervals."""
    parent = ctx.find_root().obj
    state = state_dir or (parent.get("state_dir") if isinstance(parent, dict) else None) or STATE_DIR.get()
    settings = resolve_client_settings(state_dir=state, serving_url=serving_url)
    rep = report(ServingClient(settings.serving_url).monitor())
    click.echo(json.dumps(rep, indent=2) if as_json else render(rep))
