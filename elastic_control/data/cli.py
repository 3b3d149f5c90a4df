"""`elastic-control data ...`: the Criteo converter and the synthetic generator."""

from __future__ import annotations

import contextlib
import json

import click

from elastic_control.config.data_config import PASS_MINUTES_CHOICES, parse_hour
from elastic_control.config.slot_conf import load_slot_conf
from elastic_control.console import console, done, out

DEFAULT_START = "20191221/00"


def _minutes_option(fn):
    return click.option(
        "--minutes",
        type=click.Choice([str(m) for m in PASS_MINUTES_CHOICES]),
        default=None,
        callback=lambda ctx, param, value: int(value) if value else None,
        help="Sub-hour layout for PASS_MINUTES: each hour's lines go into folders YYYYMMDD/HHMM, one per "
        "MINUTES, each with its donefile.",
    )(fn)


def _hour(ctx, param, value):
    if value is None:
        return None
    return parse_hour(value, key=f"--{param.name}", source="command line")


@contextlib.contextmanager
def _progress(description: str, total: int | None):
    """A rich progress bar on stderr; yields a function advancing it."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(task, n)


@click.group("data", help="Make training data: convert raw Criteo logs, or generate synthetic hours.")
def data_group():
    pass


@data_group.command("criteo", help="Convert raw Criteo TSV (label, I1-I13, C1-C26) into slot-format hours.")
@click.option("--input", "input_path", required=True, type=click.Path(dir_okay=False), help="Raw Criteo file (.gz ok).")
@click.option("--output", required=True, type=click.Path(file_okay=False), help="DATASET_PATH to write hours into.")
@click.option(
    "--hours",
    type=click.IntRange(1, 100_000),
    default=1,
    show_default=True,
    help="Split the lines evenly into this many consecutive hours.",
)
@click.option("--start", callback=_hour, default=DEFAULT_START, show_default=True, help="First hour, YYYYMMDD/HH.")
@click.option("--parts", type=click.IntRange(1, 1024), default=2, show_default=True, help="Part files per hour.")
@_minutes_option
def criteo_command(input_path, output, hours, start, parts, minutes):
    # function-level: keeps `elastic-control --help` fast (the converter loads fsspec, ~20 ms)
    from elastic_control.data.criteo import convert_file

    with _progress(f"converting {input_path}", None) as advance:
        summary = convert_file(
            input_path, output, hours=hours, start=start, parts=parts, progress=advance, minutes=minutes
        )
    layout = f" in {minutes}-minute folders" if minutes else ""
    done(
        f"{summary['lines']} lines -> {hours} hour(s){layout} under {output} (CTR {summary['ctr']:.4f}, "
        f"{summary['bad_lines']} bad lines skipped); sparse slots 1-39, dense slots 40-52: "
        f"train with -s {summary['slot_conf']}"
    )
    out(json.dumps(summary))


@data_group.command("synth", help="Generate hours from a planted model; writes each line's true probability too.")
@click.option("--output", required=True, type=click.Path(file_okay=False), help="DATASET_PATH to write hours into.")
@click.option("--hours", type=click.IntRange(1, 100_000), default=2, show_default=True)
@click.option("--lines-per-hour", type=click.IntRange(1, 100_000_000), default=10_000, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "-s",
    "--slot_conf",
    default=None,
    type=click.Path(dir_okay=False),
    help="Slots to generate (default: slots 1-39 as in examples/slot.conf).",
)
@click.option("--start", callback=_hour, default=DEFAULT_START, show_default=True, help="First hour, YYYYMMDD/HH.")
@click.option(
    "--vocab",
    type=click.IntRange(2, 10_000_000),
    default=None,
    show_default="10 with --interactions, else 50",
    help="Distinct feasigns per slot (larger vocabularies need more lines to learn).",
)
@click.option("--parts", type=click.IntRange(1, 1024), default=2, show_default=True, help="Part files per hour.")
@click.option("--gz", is_flag=True, help="Gzip the part files.")
@_minutes_option
@click.option(
    "--drift",
    type=click.FloatRange(0, 1_000_000),
    default=0.0,
    show_default=True,
    help="Vocabulary drift: popularity ranks move this many feasigns per hour (per slot with --minutes).",
)
@click.option(
    "--interactions",
    "strength",
    metavar="STRENGTH",
    type=click.FloatRange(0, 10),
    default=0.0,
    show_default=True,
    # 0 by default: every existing script, test fixture and benchmark built on `data synth` keeps its lines.
    # The numbers in the text mirror synth.DEFAULT_INTERACTIONS, MAIN_STD, FM_SLOTS and INTERACTION_VOCAB
    # (a test compares them): importing synth here would load numpy on every CLI start.
    help="Planted pairwise interactions (0.7 is what the demo uses): first-order weights with logit standard "
    "deviation 1.3 plus a factorisation-machine term, the inner products of planted embeddings over every "
    "pair of 6 of the slots, with logit standard deviation STRENGTH; 10 feasigns per slot unless --vocab. "
    "Logistic regression cannot learn the term, a deep model can. 0: the original planted model "
    "(first-order weights and a few low-rank slot products; the same lines as before for a seed).",
)
def synth_command(output, hours, lines_per_hour, seed, slot_conf, start, vocab, parts, gz, minutes, drift, strength):
    # function-level: keeps `elastic-control --help` fast (the generator loads fsspec, ~20 ms)
    from elastic_control.data.synth import generate

    slots = load_slot_conf(slot_conf).slots if slot_conf else tuple(range(1, 40))
    with _progress(f"generating {hours} hour(s)", hours) as advance:
        summary = generate(
            output,
            slots=slots,
            hours=hours,
            lines_per_hour=lines_per_hour,
            seed=seed,
            start=start,
            parts=parts,
            compress=gz,
            vocab=vocab,
            progress=advance,
            minutes=minutes,
            drift=drift,
            interactions=strength,
        )
    layout = f" in {minutes}-minute folders" if minutes else ""
    done(
        f"{summary['lines']} lines in {hours} hour(s){layout} under {output} (CTR {summary['ctr']:.4f}, "
        f"Bayes-optimal AUC {summary['bayes_auc']:.4f})"
    )
    out(json.dumps(summary))
