"""``history``, ``rollback`` and ``canary``: every rollout listed, going back, and automated canaries.

Where they look: cube-transfer's rollout journal (``CUBE_ROOT/transfer-state.json`` locally, else its
``GET /v1/status``), the local supervisor's ``rollouts.json`` (when serving first answered with each
version) and the state folder's ``canary.jsonl`` (every canary step and verdict). Locally the URLs and the
token come from the state folder; on Kubernetes cube-transfer and serving are reached through the API
server's Service proxy with the plan's kubeconfig context (the token in the header the proxy passes on),
unless ``--transfer-url`` / ``--serving-url`` name them (e.g. through ``kubectl port-forward``); the canary
needs ``--serving-url`` there (it talks to serving many times a second).
"""

from __future__ import annotations

import datetime as dt
import json
import time
from pathlib import Path

import click
import requests

from ctr_foundation import env_vars
from ctr_foundation.errors import ComponentError, UsageError
from ctr_foundation.http_auth import auth_headers
from ctr_foundation.model_registry import (
    CHALLENGER,
    CHAMPION,
    AliasSetter,
    RegistryError,
    is_model_uri,
    is_server_uri,
    pass_of_model_uri,
)
from ctr_foundation.names import StateFolder
from elastic_control.cli.options import state_dir_option
from elastic_control.console import warn
from elastic_control.local.rollouts import read_rollouts, version_from_status
from elastic_control.local.spec import load_local_plan
from elastic_control.plan import load_plan
from elastic_control.serving.arms import SplitError
from elastic_control.serving.canary import Canary, Criteria, ServingSplitApi, parse_ramp
from elastic_control.serving.monitor import AlertRules

CANARY_FILE = "canary.jsonl"
JOURNAL_FILE = "transfer-state.json"


class DirectService:
    """A service reached at its URL (a local pipeline's, or a flag's)."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")

    def __str__(self) -> str:
        return self.url

    def request(
        self, method: str, path: str, *, token: str | None = None, body: dict | None = None, timeout: float = 5.0
    ) -> tuple[int | None, dict | None, str]:
        """(HTTP status or None, the answer's JSON object or None, why there is none)."""
        try:
            r = requests.request(method, self.url + path, json=body, headers=auth_headers(token), timeout=timeout)
        except requests.RequestException as e:
            return None, None, f"no answer ({type(e).__name__}: {e})"
        try:
            doc = r.json()
        except ValueError:
            doc = {"error": r.text.strip()[:300]}
        return (r.status_code, doc, "") if isinstance(doc, dict) else (r.status_code, None, "not a JSON object")


def _service(where) -> DirectService | None:
    return DirectService(where) if isinstance(where, str) else where


def _endpoints(state_dir: str, serving_url: str | None, transfer_url: str | None) -> dict:
    """{"serving", "transfer" (DirectService or the cluster's ProxiedService, or None), "token", "cube_root",
    "layout"} from the flags and the state folder."""
    layout = StateFolder.of(state_dir)
    out = {
        "serving": _service(serving_url),
        "transfer": _service(transfer_url),
        "token": None,
        "cube_root": None,
        "layout": layout,
    }
    try:
        plan = load_plan(state_dir)
        out["token"] = plan.token()
    except (UsageError, OSError):
        return out
    if plan.backend == "local":
        try:
            local = load_local_plan(layout.components_file)
        except (OSError, ValueError, KeyError):
            return out
        out["serving"] = out["serving"] or _service(local.serving_url)
        out["transfer"] = out["transfer"] or _service(local.transfer_url)
        out["cube_root"] = layout.cube_root
    elif not (out["serving"] and out["transfer"]):
        # function-level: loads the kubernetes client (~0.7 s), which a local pipeline never needs
        from elastic_control.kube.deploy import connect
        from elastic_control.kube.service_probe import ProxiedService

        connect(plan)  # the plan's context, refused if it now points at another cluster
        ns, job = plan.namespace, plan.job_name
        out["serving"] = out["serving"] or ProxiedService(ns, f"{job}-serving")
        out["transfer"] = out["transfer"] or ProxiedService(ns, f"{job}-cube-transfer")
    return out


# ---- history ---------------------------------------------------------------------------------------------


def transfer_history(ends: dict) -> list[dict]:
    """cube-transfer's records (every one from its journal locally; the last 20 over HTTP)."""
    if ends["cube_root"] is not None and (Path(ends["cube_root"]) / JOURNAL_FILE).exists():
        try:
            return json.loads((Path(ends["cube_root"]) / JOURNAL_FILE).read_text()).get("history") or []
        except (OSError, json.JSONDecodeError):
            pass
    if ends["transfer"]:
        status, doc, reason = _service(ends["transfer"]).request("GET", "/v1/status")
        if status != 200 or doc is None:  # what else is recorded is still worth showing
            warn(f"cube-transfer at {ends['transfer']} gave no history: {reason or f'HTTP {status}'}")
            return []
        return doc.get("history") or []
    return []


def read_canary_records(layout: StateFolder) -> list[dict]:
    path = layout.state / CANARY_FILE
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def history_rows(transfer: list[dict], served: list[dict], canary: list[dict]) -> list[dict]:
    """One row per rollout, oldest first: {version, at, seconds, by, result, served_at, freshness_s, detail}."""
    rows = []
    served_left = list(served)
    for rec in transfer:
        at = rec.get("at")
        row = {
            "version": rec.get("version"),
            "at": at,
            "seconds": rec.get("total_s"),
            "by": rec.get("by") or "cube-transfer",
            "result": rec.get("result"),
            "served_at": None,
            "freshness_s": rec.get("freshness_s"),
            "detail": rec.get("reason") or rec.get("error") or "",
        }
        if rec.get("rolled_back_from"):
            row["detail"] = f"from {rec['rolled_back_from']}"
        if row["result"] == "active":
            candidates = [s for s in served_left if s.get("version") == row["version"]]
            match = next((s for s in candidates if (s.get("served_at") or 0) >= (at or 0) - 5), None)
            if match is not None:
                served_left.remove(match)
                row["served_at"] = match.get("served_at")
        rows.append(row)
    for rec in canary:
        if rec.get("event") not in ("started", "verdict", "promoted", "aborted", "failed"):
            continue
        detail = {
            "started": lambda r: (
                f"ramp {','.join(format(p, 'g') for p in r.get('ramp', []))}, window {r.get('window_s', 0):g}s"
            ),
            "verdict": lambda r: (
                f"{r.get('percent', 0):g}%: {r.get('verdict')}"
                + (f" ({'; '.join(r['failed'])})" if r.get("failed") else "")
            ),
            "promoted": lambda r: "challenger serves everything",
            "aborted": lambda r: f"at {r.get('percent', 0):g}%: {r.get('reason', '')}",
            "failed": lambda r: r.get("reason", ""),
        }[rec["event"]](rec)
        rows.append(
            {
                "version": rec.get("version"),
                "at": rec.get("at"),
                "seconds": rec.get("seconds"),
                "by": "split",
                "result": "canary " + rec["event"],
                "served_at": None,
                "freshness_s": None,
                "detail": detail,
            }
        )
    rows.sort(key=lambda r: r["at"] or 0)
    return rows


def _when(t: float | None) -> str:
    if t is None:
        return "-"
    return dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def history_text(rows: list[dict]) -> str:
    head = ("WHEN", "VERSION", "BY", "RESULT", "SECONDS", "DETAIL")
    table = [head]
    for r in rows:
        secs = "-" if r["seconds"] is None else f"{r['seconds']:.1f}"
        table.append((_when(r["at"]), r["version"] or "-", r["by"], r["result"] or "-", secs, r["detail"][:80]))
    widths = [max(len(str(row[i])) for row in table) for i in range(len(head) - 1)]
    return "\n".join(
        "  ".join(str(c).ljust(w) for c, w in zip(row[:-1], widths, strict=True)) + "  " + str(row[-1]) for row in table
    )


@click.command("history", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-o", "--output", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option(
    "--transfer-url",
    default=None,
    help="cube-transfer's URL [default: the local plan's; on Kubernetes its Service, through the API server].",
)
@state_dir_option
def history_command(output, transfer_url, state_dir):
    """Every rollout, oldest first: version, when, how long, by whom (cube-transfer, rollback, split)."""
    ends = _endpoints(state_dir, None, transfer_url)
    rows = history_rows(transfer_history(ends), read_rollouts(ends["layout"]), read_canary_records(ends["layout"]))
    if output == "json":
        click.echo(json.dumps({"rollouts": rows}, indent=1))
    elif rows:
        click.echo(history_text(rows))
    else:
        click.echo("no rollouts recorded yet")


# ---- rollback --------------------------------------------------------------------------------------------


def rollback(transfer, token: str | None, version: str | None, timeout: float = 600.0) -> dict:
    """POST /v1/rollback to cube-transfer (a URL, DirectService or ProxiedService): its answer."""
    transfer = _service(transfer)
    body = {"version": version} if version else {}
    status, answer, reason = transfer.request("POST", "/v1/rollback", token=token, body=body, timeout=timeout)
    if status is None:
        raise ComponentError(f"cube-transfer at {transfer} did not answer: {reason}")
    error = (answer or {}).get("error") or reason
    if status == 400:
        raise UsageError(error)
    if status != 200 or answer is None:
        raise ComponentError(f"rollback refused (HTTP {status}): {error}")
    return answer


def wait_served(serving, version: str, timeout: float) -> float | None:
    """Seconds until serving (a URL, DirectService or ProxiedService) answers with ``version`` (None: not
    within ``timeout``)."""
    serving = _service(serving)
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        status, doc, _ = serving.request("GET", "/v1/status", timeout=2.0)
        if status == 200 and version_from_status(doc) == version:
            return round(time.monotonic() - t0, 2)
        time.sleep(0.2)
    return None


@click.command("rollback", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("version", required=False)
@click.option(
    "--transfer-url",
    default=None,
    help="cube-transfer's URL [default: the local plan's; on Kubernetes its Service, through the API server].",
)
@click.option(
    "--serving-url",
    default=None,
    help="Serving's URL, to wait until it follows [default: the plan's; on Kubernetes its Service].",
)
@click.option("--wait", "wait_s", type=float, default=60.0, show_default=True, help="Seconds to wait for serving.")
@click.option("-o", "--output", type=click.Choice(["text", "json"]), default="text", show_default=True)
@state_dir_option
def rollback_command(version, transfer_url, serving_url, wait_s, output, state_dir):
    """Make VERSION (default: the previous version) active again through cube-transfer's two-phase switch."""
    ends = _endpoints(state_dir, serving_url, transfer_url)
    if not ends["transfer"]:
        raise UsageError("no cube-transfer to ask: no plan in the state folder; pass --transfer-url")
    answer = rollback(ends["transfer"], ends["token"], version)
    target = answer["version"]
    followed = wait_served(ends["serving"], target, wait_s) if ends["serving"] else None
    answer["serving_followed_s"] = followed
    if output == "json":
        click.echo(json.dumps(answer, indent=1))
    elif answer.get("unchanged"):
        click.echo(f"{target} is already the active version: nothing to do")
    else:
        where = f"; serving answers with it after {followed}s" if followed is not None else ""
        click.echo(f"rolled back from {answer.get('from')} to {target} in {answer.get('total_s', 0):.1f}s{where}")
    if ends["serving"] and followed is None and not answer.get("unchanged"):
        raise ComponentError(f"cube serves {target}, but serving did not answer with it within {wait_s:g}s")


# ---- canary ----------------------------------------------------------------------------------------------


class CanaryRecorder:
    """Appends each canary record to STATE/canary.jsonl and, with a tracking server, logs it to MLflow."""

    def __init__(self, layout: StateFolder, tracking_uri: str | None):
        self.path = layout.state / CANARY_FILE
        self.tracking_uri = tracking_uri
        self.run_id: str | None = None
        self.mlflow_error: str | None = None

    def __call__(self, rec: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec, sort_keys=True) + "\n")
        if self.tracking_uri:
            try:
                self._mlflow(rec)
            except Exception as e:  # noqa: BLE001 - MLflow never stops a canary
                self.mlflow_error = f"{type(e).__name__}: {e}"

    def _mlflow(self, rec: dict) -> None:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(self.tracking_uri)
        if self.run_id is None:
            exp = client.get_experiment_by_name("elastic-ctr-canary")
            exp_id = exp.experiment_id if exp else client.create_experiment("elastic-ctr-canary")
            run = client.create_run(exp_id, run_name=f"canary {rec['version']}", tags={"pass": rec["version"]})
            self.run_id = run.info.run_id
        ts = int(rec["at"] * 1000)
        if rec["event"] == "verdict":
            step = int(rec["percent"])
            client.log_metric(self.run_id, "canary_share_percent", rec["percent"], ts, step)
            client.log_metric(self.run_id, "canary_step_passed", 1.0 if rec["verdict"] == "passed" else 0.0, ts, step)
            for arm in ("challenger", "control"):
                for k, v in (rec.get("figures", {}).get(arm) or {}).items():
                    if isinstance(v, (int, float)):
                        client.log_metric(self.run_id, f"{arm}_{k}", float(v), ts, step)
        elif rec["event"] in ("promoted", "aborted", "failed"):
            client.set_tag(self.run_id, "outcome", rec["event"])
            if rec.get("reason"):
                client.set_tag(self.run_id, "reason", rec["reason"][:5000])
            client.set_terminated(self.run_id, "FINISHED" if rec["event"] == "promoted" else "FAILED")


@click.command("canary", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("version")
@click.option("--ramp", default="5,25,50,100", show_default=True, help="The challenger's share per step, in percent.")
@click.option("--window", "window_s", type=click.FloatRange(0.1), default=300.0, show_default=True,
              help="Verdict window per step (seconds).")  # fmt: skip
@click.option("--max-wait", "max_wait_s", type=click.FloatRange(0.1), default=None,
              help="Longest wait for enough joined feedback per step, then abort [default: 4 x window].")  # fmt: skip
@click.option("--arm", default="challenger", show_default=True, help="The challenger arm's name.")
@click.option("--poll", "poll_s", type=click.FloatRange(0.05), default=2.0, show_default=True,
              help="Seconds between looks at the monitor.")  # fmt: skip
@click.option("--calibration-band", default="0.8..1.25", show_default=True, help="Abort outside LOW..HIGH.")
@click.option("--max-logloss-rise", type=float, default=0.02, show_default=True, help="Against the control arm.")
@click.option("--max-auc-drop", type=float, default=0.02, show_default=True, help="Against the control arm.")
@click.option("--max-error-rate", type=float, default=0.01, show_default=True, help="Share of 5xx answers.")
@click.option("--min-feedback", type=click.IntRange(1), default=500, show_default=True,
              help="Joined events before calibration and log loss are judged.")  # fmt: skip
@click.option("--min-clicks", type=click.IntRange(1), default=50, show_default=True,
              help="Clicks (and non-clicks) per arm before the AUCs are compared.")  # fmt: skip
@click.option("--serving-url", default=None, help="Serving's URL (default: the local plan's).")
@click.option("-o", "--output", type=click.Choice(["text", "json"]), default="text", show_default=True)
@state_dir_option
def canary_command(
    version, ramp, window_s, max_wait_s, arm, poll_s, calibration_band, max_logloss_rise, max_auc_drop,
    max_error_rate, min_feedback, min_clicks, serving_url, output, state_dir,
):  # fmt: skip
    """Ramp VERSION (a pass, or models:/NAME@ALIAS) as an A/B challenger step by step, judging each step on
    live click feedback; abort (the control arm serves everything) when a criterion fails, promote at 100."""
    tracking = env_vars.MLFLOW_TRACKING_URI.get()
    try:
        steps = parse_ramp(ramp)
        band = AlertRules.parse_band(calibration_band)
        if is_model_uri(version):
            version = pass_of_model_uri(tracking, version)
    except (SplitError, ValueError, RegistryError) as e:
        raise UsageError(str(e)) from e
    ends = _endpoints(state_dir, serving_url, None)
    if not isinstance(ends["serving"], DirectService):
        raise UsageError(
            "no serving URL: run it on a local pipeline or pass --serving-url (on Kubernetes, e.g. through "
            "`kubectl port-forward service/JOB-serving 8010`)"
        )
    criteria = Criteria(
        calibration_band=band,
        max_logloss_rise=max_logloss_rise,
        max_auc_drop=max_auc_drop,
        max_error_rate=max_error_rate,
        min_feedback=min_feedback,
        min_clicks=min_clicks,
    )
    recorder = CanaryRecorder(ends["layout"], tracking if is_server_uri(tracking) else None)
    aliases = {}
    if is_server_uri(tracking):
        aliases = {a: AliasSetter(tracking, a, patience=30.0) for a in (CHALLENGER, CHAMPION)}
        aliases[CHALLENGER].point_at(version)
    canary = Canary(
        ServingSplitApi(ends["serving"].url, ends["token"]),
        version,
        arm=arm,
        ramp=steps,
        window_s=window_s,
        max_wait_s=max_wait_s,
        poll_s=poll_s,
        criteria=criteria,
        on_record=recorder,
    )
    result = canary.run()
    if aliases:
        if result.outcome == "promoted":
            aliases[CHAMPION].point_at(version)
        for setter in aliases.values():
            setter.wait(timeout=setter.patience + 10)
    doc = result.to_json()
    doc["mlflow_error"] = recorder.mlflow_error
    if output == "json":
        click.echo(json.dumps(doc, indent=1))
    else:
        for s in result.steps:
            click.echo(f"{s['percent']:g}%: {s['verdict']} after {s['seconds']:.1f}s" + (
                f" ({'; '.join(s['failed'])})" if s["failed"] else ""))  # fmt: skip
        click.echo(f"canary {result.outcome}: {version}" + (f": {result.reason}" if result.reason else ""))
    if result.outcome != "promoted":
        raise click.exceptions.Exit(1)
