"""``elastic-control demo``: click code only; the work is ``demo.run.run_demo``."""

from __future__ import annotations

import click

from elastic_control.config.data_config import MAX_ADMIT_MIN_COUNT, PASS_MINUTES_CHOICES
from elastic_control.demo.run import DEFAULT_WORKDIR, run_demo


@click.command("demo", help="The whole pipeline on this machine: data, training, cube, serving, predictions and AUC.")
@click.option(
    "--workdir",
    default=DEFAULT_WORKDIR,
    show_default=True,
    type=click.Path(file_okay=False),
    help="Folder for the data, models and state of this run (cleared at the start).",
)
@click.option(
    "--hours",
    type=click.IntRange(2, 48),
    default=4,
    show_default=True,
    help="Hours of data to train on: one pass per hour (or per --pass-minutes).",
)
@click.option("--lines-per-hour", type=click.IntRange(100, 10_000_000), default=25_000, show_default=True)
@click.option("--trainers", type=click.IntRange(1, 16), default=2, show_default=True)
@click.option("--pservers", type=click.IntRange(1, 16), default=1, show_default=True)
@click.option("--shards", type=click.IntRange(1, 16), default=2, show_default=True, help="Cube shards.")
@click.option(
    "--criteo",
    type=click.Path(dir_okay=False),
    default=None,
    help="Use real Criteo lines (raw TSV) instead of synthetic data.",
)
@click.option("--seed", type=int, default=7, show_default=True, help="Seed of the synthetic data.")
@click.option(
    "--interactions",
    metavar="STRENGTH",
    type=click.FloatRange(0, 10),
    default=None,
    show_default="0.7",  # synth.DEFAULT_INTERACTIONS (a test compares them)
    help="Planted pairwise interactions in the synthetic data (`data synth --interactions`): logistic "
    "regression cannot learn them, a deep model can. 0: the original planted model.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(60),
    default=900.0,
    show_default=True,
    help="Give up (and clean up) after this many seconds.",
)
@click.option("--keep", is_flag=True, help="Leave the pipeline running at the end (stop it with `delete`).")
@click.option(
    "--deltas",
    is_flag=True,
    help="Delta passes (DELTA_PASSES=1): the first pass is a base, the others hold only what changed.",
)
@click.option(
    "--pass-minutes",
    type=click.Choice([str(m) for m in PASS_MINUTES_CHOICES]),
    default=None,
    callback=lambda ctx, param, value: int(value) if value else None,
    help="Sub-hour passes (PASS_MINUTES): data in YYYYMMDD/HHMM folders, one delta pass per MINUTES.",
)
@click.option(
    "--admit-min-count",
    type=click.IntRange(2, MAX_ADMIT_MIN_COUNT),
    default=None,
    help="Feature admission (ADMIT_MIN_COUNT): a feasign is trained and served once seen N times.",
)
@click.option(
    "--evict-after",
    type=click.IntRange(1, 100_000),
    default=None,
    help="Feature eviction (EVICT_AFTER_PASSES): feasigns unseen for N passes are removed (deletes in deltas).",
)
def demo_command(
    workdir,
    hours,
    lines_per_hour,
    trainers,
    pservers,
    shards,
    criteo,
    seed,
    interactions,
    timeout,
    keep,
    deltas,
    pass_minutes,
    admit_min_count,
    evict_after,
):
    run_demo(
        deltas=deltas,
        pass_minutes=pass_minutes,
        admit_min_count=admit_min_count,
        evict_after=evict_after,
        workdir=workdir,
        hours=hours,
        lines_per_hour=lines_per_hour,
        trainers=trainers,
        pservers=pservers,
        shards=shards,
        criteo=criteo,
        keep=keep,
        seed=seed,
        interactions=interactions,
        timeout=timeout,
    )
