"""`elastic-control eval`: offline metrics of a pass, its worker/merge entries for a cluster job, shadow reports."""

from __future__ import annotations

from pathlib import Path

import click

from ctr_foundation.errors import UsageError
from elastic_control.cli.options import state_dir_option
from elastic_control.console import console, done, info, out
from elastic_control.evaluation.report import metrics_table, reliability_table, write_outputs
from elastic_control.evaluation.tracking import log_evaluation
from elastic_control.plan import load_plan


def _finish(result, output: str | None, mlflow: bool, as_json: bool) -> None:
    import json

    try:
        artifacts = None
        if output:
            artifacts = write_outputs(result, Path(output))
        if as_json:
            out(json.dumps(result.metrics, sort_keys=True))
        else:
            console.print(metrics_table(result.metrics))
            console.print(reliability_table(result.metrics["model"], "reliability (model)"))
        data = result.metrics["data"]
        if data["bad_lines"]:
            info(f"{data['bad_lines']} of {data['lines']} lines were malformed and skipped")
        if output:
            done(f"wrote {', '.join(str(p) for p in artifacts.values())}")
        if mlflow:
            run_id = log_evaluation(result, artifacts)
            if run_id:
                done(f"recorded in MLflow (run {run_id})")
    finally:
        result.cleanup()


@click.group(
    "eval",
    invoke_without_command=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="On Kubernetes: `eval submit --model PASS --workers W` runs W workers "
    "(`eval ... --shard I/W --partial-out DIR`) as a Volcano job, then one "
    "`eval merge --partial-out DIR`; see docs/contracts.md.",
)
@click.option("--model", "model", type=click.Path(file_okay=False), help="Pass folder to evaluate.")
@click.option("--baseline", type=click.Path(file_okay=False), help="Pass folder to compare with (e.g. the active one).")
@click.option(
    "-f", "--datafile", default="data.config", show_default=True, help="data.config: data location and window."
)
@click.option("--output", type=click.Path(file_okay=False), help="Write metrics.json, scored.parquet and plots here.")
@click.option("--group-slot", type=int, help="Slot whose feasign names the group (user/query): grouped AUC, NDCG@k.")
@click.option("--ndcg-k", type=click.IntRange(1, 10000), default=10, show_default=True, help="k of NDCG@k.")
@click.option("--workers", type=click.IntRange(1, 512), help="Worker processes (default: all cores).")
@click.option("--start", help="First hour YYYYMMDD/HH, or slot YYYYMMDD/HHMM (default: START_DATE_HR).")
@click.option("--end", help="Last hour YYYYMMDD/HH, or slot YYYYMMDD/HHMM (default: END_DATE_HR).")
@click.option("--shard", help="Run only share I of W (a cluster worker) and write its partial to --partial-out.")
@click.option(
    "--partial-out",
    type=click.Path(file_okay=False),
    help="Folder of per-share partials (kept; complete shares are reused on a rerun).",
)
@click.option("--mlflow/--no-mlflow", default=True, show_default=True, help="Record the evaluation in MLflow.")
@click.option("--json", "as_json", is_flag=True, help="Print metrics as JSON on stdout instead of tables.")
@click.pass_context
def eval_command(
    ctx, model, baseline, datafile, output, group_slot, ndcg_k, workers, start, end, shard, partial_out, mlflow, as_json
):
    """Score a pass offline on a data window: AUC, log loss, calibration, grouped AUC and NDCG@k."""
    if ctx.invoked_subcommand is not None:
        return
    # function-level: keeps `elastic-control --help` fast (the evaluation engine loads fsspec, multiprocessing)
    from elastic_control.evaluation.parallel import default_workers, evaluate
    from elastic_control.evaluation.shares import EvalSpec, parse_shard, run_share

    if not model:
        raise UsageError("--model PASS_DIR is required (the pass folder to evaluate)")
    if shard:
        index, shares = parse_shard(shard)
        if not partial_out:
            raise UsageError("--shard needs --partial-out DIR (where the share's partial is written)")
    else:
        shares = workers or default_workers()
    spec = EvalSpec.create(
        model=model,
        data_config=datafile,
        shares=shares,
        baseline=baseline,
        start=start,
        end=end,
        group_slot=group_slot,
        ndcg_k=ndcg_k,
        keep_scored=bool(output or partial_out),
    )
    if shard:
        # function-level: keeps `elastic-control --help` fast (the evaluation engine loads fsspec, multiprocessing)
        from elastic_control.evaluation.shares import read_share

        # A restarted cluster worker (Volcano restarts the whole worker task) keeps a share already done.
        previous = read_share(partial_out, index, shares)
        if previous and previous["spec"]["fingerprint"] == spec.fingerprint():
            done(f"share {index}/{shares} is already complete in {partial_out}; kept")
            return
        result = run_share(spec, index, partial_out)
        done(f"share {index}/{shares}: {result['examples']} examples scored in {result['seconds']}s -> {partial_out}")
        return
    result = evaluate(spec, workers=shares, partials=partial_out, progress=info)
    _finish(result, output, mlflow, as_json)


@eval_command.command("merge")
@click.option(
    "--partial-out",
    "partials",
    required=True,
    type=click.Path(file_okay=False),
    help="The folder the shares wrote their partials to.",
)
@click.option("--output", type=click.Path(file_okay=False), help="Write metrics.json, scored.parquet and plots here.")
@click.option("--mlflow/--no-mlflow", default=True, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def merge_command(partials, output, mlflow, as_json):
    """Merge the share partials of a cluster evaluation (fails naming the shares still missing)."""
    # function-level: keeps `elastic-control --help` fast (the evaluation engine loads fsspec, multiprocessing)
    from elastic_control.evaluation.parallel import merge_partials

    _finish(merge_partials(partials), output, mlflow, as_json)


@eval_command.command("submit")
@click.option(
    "--model",
    required=True,
    help="Pass to evaluate: its name under the pods' MODEL_PATH, or an absolute path inside the pods.",
)
@click.option("--baseline", help="Pass to compare with (name or absolute path in the pods).")
@click.option("--workers", type=click.IntRange(1, 512), help="Worker pods (default: the plan's trainer count).")
@click.option("--group-slot", type=int, help="Slot whose feasign names the group: grouped AUC, NDCG@k.")
@click.option("--ndcg-k", type=click.IntRange(1, 10000), default=10, show_default=True, help="k of NDCG@k.")
@click.option("--start", help="First hour YYYYMMDD/HH (default: START_DATE_HR of the deployment's data.config).")
@click.option("--end", help="Last hour YYYYMMDD/HH (default: END_DATE_HR).")
@click.option(
    "--run",
    "run",
    help="Name of this evaluation (default: a hash of the flags, so a resubmission reuses the complete shares).",
)
@click.option(
    "--timeout",
    type=click.FloatRange(1),
    default=86400,
    show_default=True,
    help="Seconds to wait for each of the two jobs.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the merged metrics as JSON on stdout.")
@click.option("--poll-interval", type=click.FloatRange(0.05), default=2.0, hidden=True)
@state_dir_option
def submit_command(
    model, baseline, workers, group_slot, ndcg_k, start, end, run, timeout, as_json, poll_interval, state_dir
):
    """Run the evaluation where the plan runs: on Kubernetes a Volcano job of W workers then the merge; locally
    W worker processes on the pipeline's data and MODEL_PATH, results in STATE/eval/RUN/."""
    import json

    # function-level: keeps `elastic-control --help` fast (api, kube.eval_job: both backends, jinja2)
    from elastic_control import api
    from elastic_control.kube.eval_job import EvalJobRequest

    plan = load_plan(state_dir)
    request = EvalJobRequest(
        model=model,
        baseline=baseline,
        workers=workers or plan.resources.trainers,
        group_slot=group_slot,
        ndcg_k=ndcg_k,
        start=start,
        end=end,
        run=run,
    )
    metrics = api.submit_evaluation(state_dir=state_dir, request=request, timeout=timeout, poll=poll_interval)
    if as_json:
        out(json.dumps(metrics, sort_keys=True))
    else:
        console.print(metrics_table(metrics))


@eval_command.command("gate")
@click.option("--candidate", required=True, type=click.Path(file_okay=False), help="The candidate pass folder.")
@click.option("--active", default=None, type=click.Path(file_okay=False), help="The active pass folder, if any.")
@click.option("--rule", required=True, help="Gate rule, e.g. 'auc_drop<=0.002,calibration=0.9..1.1'.")
@click.option(
    "-f", "--datafile", default=None, help="data.config of the hold-out hours [default: $ELASTIC_CTR_DATA_CONFIG]."
)
@click.option("--json", "as_json", is_flag=True, help="Print the decision as one JSON line (what cube-transfer reads).")
def gate_command(candidate, active, rule, datafile, as_json):
    """Decide the promotion gate for CANDIDATE against ACTIVE on the fresh hold-out hours.

    Exit 0 with the decision (passed or not); exit 1 when no decision could be made.
    """
    import json

    # function-level: keeps `elastic-control --help` fast (the evaluation engine loads fsspec, multiprocessing)
    from elastic_control.evaluation.gate import evaluate_candidate

    decision = evaluate_candidate(candidate, active, rule, data_config=datafile)
    body = {"passed": bool(decision.passed), "reason": str(decision.reason), "metrics": dict(decision.metrics)}
    if as_json:
        out(json.dumps(body, sort_keys=True, default=float))
    else:
        verdict = "promoted" if decision.passed else "rejected"
        out(f"{verdict}: {decision.reason}")


@eval_command.command("shadow-report")
@click.argument("log", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True)
def shadow_report_command(log, as_json):
    """Summarise a shadow-scoring log: active vs candidate scores on live requests."""
    import json

    # function-level: keeps `elastic-control --help` fast (shadow loads pass_scorer, ~20 ms)
    from elastic_control.evaluation.shadow import shadow_report, shadow_report_table

    report = shadow_report(log)
    if as_json:
        out(json.dumps(report, sort_keys=True))
    else:
        console.print(shadow_report_table(report))
