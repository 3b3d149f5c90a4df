"""Model quality with the defaults, on real Criteo lines, through the product's own path.

`elastic-control data criteo` converts a slice of the real lines into hours, `elastic-control train`
(the defaults: no model or hyperparameter flag; the slot.conf the converter wrote, with its dense slots)
trains on all hours but the last, and `elastic-control
eval --json` scores the last hour from the saved pass. The peer is a scikit-learn logistic regression
on exactly the same one-hot feasigns and split (best C of a small grid, chosen on the test hour: the
peer's most favourable figure), fitted in the same test.

- default suite: small real logs (a few thousand lines, one or two passes): AUC at least the peer's, and
  calibrated (mean predicted CTR within 10% of the observed);
- slow: the 5-hour Criteo split (`data criteo --hours 5`, train hours 1-4, evaluate hour 5).
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import os
from pathlib import Path

import numpy as np
import pytest
from helpers_common import CRITEO_FILE, CRITEO_SLOTS, run_cli
from helpers_passes import train

from elastic_control.evaluation.logistic_peer import best_fit, logistic_regression
from elastic_control.metrics import auc
from elastic_control.training.settings import Hyperparameters

pytestmark = pytest.mark.skipif(not CRITEO_FILE.exists(), reason=f"real Criteo lines not found at {CRITEO_FILE}")

START = "20200101/00"


def _hour(i: int) -> str:
    return f"20200101/{i:02d}"


def _convert(root: Path, first: int, count: int, hours: int) -> Path:
    """`elastic-control data criteo` on ``count`` real lines from line ``first`` on, split into ``hours`` hours."""
    root.mkdir(parents=True, exist_ok=True)
    raw = root / "raw.txt"
    with open(CRITEO_FILE, encoding="utf-8") as f, open(raw, "w", encoding="utf-8") as out:
        out.writelines(itertools.islice(f, first, first + count))
    data = root / "data"
    result = run_cli(
        "data", "criteo", "--input", raw, "--output", data, "--hours", hours, "--start", START, timeout=600
    )
    assert result.returncode == 0, result.stderr
    return data


def _converted_slots(data: Path) -> list[str]:
    """The slot.conf lines `data criteo` wrote beside the hours (sparse 1-39, dense 40-52): what its user trains."""
    text = (data / "slot.conf").read_text()
    return [ln for ln in (raw.split("#", 1)[0].strip() for raw in text.splitlines()) if ln]


def _hour_lines(data: Path, hours: range) -> list[str]:
    out = []
    for i in hours:
        folder = data / "20200101" / f"{i:02d}"
        out += [ln for p in sorted(folder.glob("part-*")) for ln in p.read_text().splitlines() if ln]
    return out


def _evaluate(root: Path, data: Path, pass_dir: Path, hour: int) -> dict:
    config = root / "eval.config"
    config.write_text(
        f'export START_DATE_HR="{_hour(hour)}"\nexport END_DATE_HR="{_hour(hour)}"\nexport DATASET_PATH="{data}"\n'
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL_PATH", "MLFLOW_TRACKING_URI")}
    result = run_cli(
        "eval", "--model", pass_dir, "-f", config, "--no-mlflow", "--json", "--workers", 1, env=env, timeout=600
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["model"]


def _quality(root: Path, *, first: int, lines: int, hours: int, trainers: int = 2) -> tuple[dict, float]:
    """(eval metrics of the defaults' last pass on the last hour, peer LR AUC) for one slice of real lines."""
    data = _convert(root, first, lines, hours)
    slots = _converted_slots(data)
    _, _, _, passes = train(
        root / "job", data=data, slots=slots, start=START, end=_hour(hours - 2), trainers=trainers, timeout=3000
    )
    assert len(passes) == hours - 1
    meta = json.loads((passes[-1] / "meta.json").read_text())
    assert meta["model_family"] == _default_family()
    assert meta["slots"] == CRITEO_SLOTS and meta["dense_slots"] == list(range(40, 53))
    if lines <= 30_000:  # a small log: its first pass trains smaller batches, the later ones full size
        batches = [json.loads((p / "meta.json").read_text())["training"]["batch_size"] for p in passes]
        assert 16 <= batches[0] < 128 and batches[1:] == [128] * (len(passes) - 1), batches
    defaults = Hyperparameters()
    for p in passes:  # a pass is judged by its held-out lines only when it holds out enough of them
        pass_meta = json.loads((p / "meta.json").read_text())
        training, held_out = pass_meta["training"], pass_meta["metrics"]["holdout_lines"]
        assert training["judged_by_holdout"] == (held_out >= defaults.min_holdout_to_stop), (held_out, training)
        if lines <= 30_000:  # trainer 0's share of a small log's hour holds out too few lines to judge
            assert not training["judged_by_holdout"] and training["holdout_losses"] == [], (held_out, training)
            assert 1 <= training["epochs_run"] <= defaults.unjudged_pass_epochs, training
    metrics = _evaluate(root, data, passes[-1], hours - 1)
    fits = logistic_regression(_hour_lines(data, range(hours - 1)), _hour_lines(data, range(hours - 1, hours)))
    lr = best_fit(fits).auc
    print(
        f"lines {first}..{first + lines} in {hours} hours: AUC {metrics['auc']:.4f} vs LR {lr:.4f}, "
        f"calibration {metrics['calibration']:.3f}"
    )
    return metrics, lr


def _default_family() -> str:
    from elastic_control.training.settings import DEFAULT_MODEL

    return DEFAULT_MODEL


# Small real logs: one pass of 6,000 lines scored on the next 6,000; and two passes of 5,000 from
# another part of the file. The bar is "at least logistic regression", with no allowance: the dense slots
# and the bias refit put all eight slices above it (+0.005 and +0.0067 on these two, against a run-to-run
# spread of about 0.003; a miss is retried once below).
SMALL_LOGS = [(0, 12_000, 2), (60_000, 15_000, 3)]
# Six more slices of the file, `-m slow`. Trained on the sparse slots alone the defaults are 0.002-0.008 below
# logistic regression on five of them; with the converter's dense slots all eight are above it, by 0.001-0.009
# (docs/benchmarks.md, "Model quality").
MORE_SMALL_LOGS = [
    pytest.param(*s, marks=pytest.mark.slow, id=i)
    for s, i in (
        ((20_000, 8_000, 2), "1pass-4k"),
        ((30_000, 20_000, 2), "1pass-10k"),
        ((45_000, 4_000, 2), "1pass-2k"),
        ((150_000, 16_000, 2), "1pass-8k"),
        ((100_000, 15_000, 3), "2passes-5k-b"),
        ((130_000, 30_000, 3), "2passes-10k"),
    )
]


@pytest.mark.parametrize(
    ("first", "lines", "hours"),
    [pytest.param(*s, id=i) for s, i in zip(SMALL_LOGS, ["1pass-6k", "2passes-5k"], strict=True)] + MORE_SMALL_LOGS,
)
def test_small_real_log_beats_logistic_regression_and_is_calibrated(tmp_path, first, lines, hours):
    # Two asynchronous trainers give a different model each run: on these few thousand lines calibration moved
    # between 0.885 and 0.99 over the runs recorded (CHANGELOG.md), the test hour's CTR itself differing
    # from the training hour's by 4% (1pass-6k). So a miss is confirmed by a second, independent training
    # before the test fails: a configuration that is off fails both.
    problems = []
    for attempt in range(2):
        metrics, lr = _quality(tmp_path / f"run-{attempt}", first=first, lines=lines, hours=hours)
        problems = []
        if metrics["auc"] < lr:
            problems.append(f"AUC {metrics['auc']:.4f} below logistic regression's {lr:.4f}")
        if abs(metrics["calibration"] - 1) > 0.10:
            problems.append(f"mean predicted / observed CTR {metrics['calibration']:.3f}")
        if not problems:
            break
        print(f"run {attempt + 1}: {'; '.join(problems)}")
    assert not problems, "; ".join(problems) + " (in two independent trainings)"


@pytest.mark.slow
def test_criteo_split_beats_logistic_regression_by_half_a_point(tmp_path):
    """All 166,528 lines in 5 hours, train on the first four, evaluate the fifth: AUC >= LR + 0.005."""
    metrics, lr = _quality(tmp_path, first=0, lines=10**9, hours=5)
    assert metrics["auc"] >= 0.7715, f"AUC {metrics['auc']:.4f} (logistic regression {lr:.4f})"
    assert metrics["auc"] >= lr + 0.005
    assert abs(metrics["calibration"] - 1) <= 0.10


@pytest.mark.slow
def test_synthetic_gap_to_bayes_optimal(tmp_path):
    """The demo's data (26 slots, 4 training hours x 25,000 lines, seed 7, planted interactions): logistic
    regression at least 0.03 below the Bayes-optimal AUC, the defaults within 0.01 of it."""
    from elastic_control.data.hourly_writer import hour_dir
    from elastic_control.data.synth import DEFAULT_INTERACTIONS, generate, read_truth
    from elastic_control.demo.data import SYNTH_SLOTS

    start = dt.datetime(2020, 1, 1, 0)
    data = tmp_path / "data"
    generate(
        data, slots=SYNTH_SLOTS, hours=5, lines_per_hour=25_000, seed=7, start=start, interactions=DEFAULT_INTERACTIONS
    )
    _, _, _, passes = train(tmp_path / "job", data=data, slots=SYNTH_SLOTS, start=START, end=_hour(3), trainers=2,
                            timeout=3000)  # fmt: skip
    lines, truth = read_truth(hour_dir(data, start + dt.timedelta(hours=4)))
    labels = np.array([int(ln.split()[1]) for ln in lines])
    ours = _evaluate(tmp_path, data, passes[-1], 4)["auc"]
    bayes = auc(labels, truth)
    lr = best_fit(logistic_regression(_hour_lines(data, range(4)), lines)).auc
    print(f"synthetic: AUC {ours:.4f}, logistic regression {lr:.4f}, Bayes-optimal {bayes:.4f}")
    assert bayes - lr >= 0.03
    assert bayes - ours <= 0.01


@pytest.mark.slow
def test_small_hourly_passes_do_not_blow_up_in_their_later_epochs(tmp_path):
    """30,000 real lines in 5 hours of 6,000: after the first, each pass plans 4 epochs of 23 steps.

    With the dense tower's Adam at 0.001 the held-out loss of such a pass rose from its third or fourth
    epoch on, by 10-40% in one epoch (0.4635 -> 0.519 -> 0.632), which only the copy of the best epoch kept
    out of the export. Patience 4 scores every planned epoch, so every one of them is checked here.
    """
    data = _convert(tmp_path, 0, 30_000, 5)
    _, _, _, passes = train(
        tmp_path / "job",
        data=data,
        slots=_converted_slots(data),
        start=START,
        end=_hour(3),
        trainers=2,
        args=["--early-stop-patience", "4", "--min-holdout-to-stop", "0"],  # 150 held-out lines: judged all the same
        timeout=3000,
    )
    rises = []
    for p in passes[1:]:
        training = json.loads((p / "meta.json").read_text())["training"]
        losses = training["holdout_losses"]
        assert training["epochs_run"] >= 3 and len(losses) == training["epochs_run"], training
        best = int(np.argmin(losses))
        worst_after = max(losses[best:])
        if worst_after > 1.05 * losses[best]:
            rises.append(f"{p.name}: held-out losses {losses}")
    assert not rises, "; ".join(rises)
