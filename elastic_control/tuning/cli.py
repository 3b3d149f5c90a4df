"""`elastic-control tune`: the click layer over elastic_control.tuning.search.tune and apply.apply_best."""

from __future__ import annotations

from pathlib import Path

import click

from ctr_foundation.errors import UsageError
from elastic_control.cli.options import state_dir_option
from elastic_control.console import console, done, out

EPILOG = (
    "Example: elastic-control tune -f data.config -s slot.conf --validation 20200101/04 --candidates 12 "
    "--output tune-out; then elastic-control tune --output tune-out --apply; elastic-control -a. "
    "Rerun the same command to finish an interrupted search. See docs/tune.md."
)


@click.command(
    "tune", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100}, epilog=EPILOG
)
@click.option("-f", "--datafile", help="data.config: the data and the window of hours candidates train on.")
@click.option("-s", "--slot_conf", help="slot.conf: the slots to train on.")
@click.option(
    "--validation",
    metavar="START[..END]",
    help="Hours (YYYYMMDD/HH) that judge the candidates; outside the window or at one of its ends. "
    "Default: every 5th line of each hour of the window is held out and judges.",
)
@click.option(
    "--candidates",
    type=click.IntRange(1, 10_000),
    default=12,
    show_default=True,
    help="Candidates to finish (trained and judged, or stopped early by the pruner).",
)
@click.option(
    "--parallel", type=click.IntRange(1, 256), help="Candidates training at once (default: one per two cores)."
)
@click.option("--output", required=True, type=click.Path(file_okay=False), help="Folder of the search (resumable).")
@click.option("-t", "--trainers", type=click.IntRange(1, 64), default=2, show_default=True, help="Trainers per job.")
@click.option("-p", "--pservers", type=click.IntRange(1, 64), default=1, show_default=True, help="Pservers per job.")
@click.option(
    "--max-epochs-cap", type=click.IntRange(1, 1000), help="Bound every candidate's epochs per pass (quick searches)."
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    metavar="SECONDS",
    help="Time budget: no candidate starts after it (those running finish); the leaderboard holds what finished.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the TPE sampler.")
@click.option("--mlflow", "mlflow_uri", metavar="URI", help="Record the search here (default: $MLFLOW_TRACKING_URI).")
@click.option(
    "--references/--no-references",
    default=True,
    show_default=True,
    help="Judge logistic regression and the plan's current pass on the same lines.",
)
@click.option(
    "--refit/--no-refit",
    default=True,
    show_default=True,
    help="When the candidates trained on less than the window (held-out lines, or validation hours at its end), "
    "train the winner once more on the whole window; its pass becomes best.pass.",
)
@click.option(
    "--apply",
    "apply_best",
    is_flag=True,
    help="Put the winner's settings into the plan (alone: from --output's leaderboard.json).",
)
@click.option(
    "--render-only",
    is_flag=True,
    help="With a Kubernetes plan: write every candidate's Volcano jobs under --output/kube/ and submit nothing "
    "(without it, tune submits each candidate's jobs to the plan's queue and follows them).",
)
@state_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print the leaderboard as JSON on stdout.")
def tune_command(
    datafile,
    slot_conf,
    validation,
    candidates,
    parallel,
    output,
    trainers,
    pservers,
    max_epochs_cap,
    timeout,
    seed,
    mlflow_uri,
    references,
    refit,
    apply_best,
    render_only,
    state_dir,
    as_json,
):
    """Search training settings: every candidate a real parameter-server job, judged on held-out lines."""
    import json
    import shlex

    if not datafile:
        if not apply_best:
            raise UsageError(
                "-f DATA_CONFIG and -s SLOT_CONF are required to search (alone, --apply needs only --output)"
            )
        _apply(output, state_dir)
        return
    if not slot_conf:
        raise UsageError("-s SLOT_CONF is required with -f (the slots every candidate trains on)")
    import pyarrow  # noqa: F401  (before paddle, which the evaluation loads)

    # function-level: keeps `elastic-control --help` fast (the tuning engine loads psutil, jinja2, the backends)
    from elastic_control.tuning.search import kube_plan, render_for_kube, tune

    plan = kube_plan(state_dir)
    if plan is not None and render_only:
        rendered = render_for_kube(
            plan, data_config=datafile, output=output, validation=validation, candidates=candidates, seed=seed
        )
        for files in rendered:
            done("rendered " + ", ".join(str(p) for p in files.values() if isinstance(p, Path)))
        console.print(
            f"the plan runs on Kubernetes: {len(rendered)} candidate job(s) rendered under {output}/kube/ "
            "(--render-only: apply each training job, then its evaluation jobs)"
        )
        return
    board = tune(
        data_config=datafile,
        slot_conf=slot_conf,
        output=output,
        validation=validation,
        candidates=candidates,
        parallel=parallel,
        trainers=trainers,
        pservers=pservers,
        max_epochs_cap=max_epochs_cap,
        timeout=timeout,
        seed=seed,
        state_dir=state_dir,
        mlflow_uri=mlflow_uri,
        references=references,
        plan=plan,
        refit=refit,
    )
    # function-level: keeps `elastic-control --help` fast (the tuning engine loads psutil, jinja2, the backends)
    from elastic_control.tuning.leaderboard import table

    if as_json:
        out(json.dumps(board, sort_keys=True))
    else:
        from rich.console import Console

        # Not a terminal (a log, a pipe): wide enough that the settings column stays readable.
        wide = console if console.is_terminal else Console(stderr=True, width=160, highlight=False)
        wide.print(table(board))
    if not board["best"]:
        raise UsageError(f"no candidate finished: see the worker.log files under {output}/candidates/")
    best = board["best"]
    done(
        f"best: candidate {best['candidate']}, validation AUC {best['validation']['auc']:.5f}, "
        f"pass {best['judged_pass']} ({best['why']})"
    )
    if (best["refit"] or {}).get("pass"):
        window = best["refit"]["window"]
        done(f"retrained on the whole window {window['start']}..{window['end']}: pass {best['pass']} (best.pass)")
    if apply_best:
        _apply(output, state_dir)
    else:
        console.print(
            f"to train with it: elastic-control tune --output {shlex.quote(str(output))} --apply && elastic-control -a"
        )


def _apply(output, state_dir) -> None:
    # function-level: keeps `elastic-control --help` fast (the tuning engine loads psutil, jinja2, the backends)
    from elastic_control.tuning.apply import apply_best

    changed = apply_best(output=output, state_dir=state_dir)
    done(
        f"plan {changed['plan']}: training flags {' '.join(changed['training_args'])}, "
        f"PASS_HOURS={changed['pass_hours']} (elastic-control -a trains with them)"
    )
