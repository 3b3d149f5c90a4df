"""Training benchmark: throughput (1 vs 2 trainers), reader parse rate vs bare pyarrow CSV, and quality.

    .venv/bin/python bench/bench_training.py [--quick]

Prints:
- examples/s of 1 trainer and of 2 trainers (1 pserver) on the same synthetic data;
- the reader's parse rate (lines/s) beside a bare pyarrow CSV parse of the same file (the limit);
- held-out AUC vs the Bayes-optimal AUC on synthetic data;
- held-out AUC on real Criteo lines vs a scikit-learn logistic regression on hashed features, same split.
"""

from __future__ import annotations

import argparse
import datetime as dt
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
from elastic_control.metrics import auc, log_loss  # noqa: E402

SLOTS = tuple(range(1, 9))


def throughput(root: Path, hours: int, lines: int, trainers: int) -> tuple[float, Path]:
    """examples/s summed over trainers (training time of the passes, as the trainers report it); the last pass."""
    from ctr_foundation.records import read_donefile

    config, slot_conf, models = B.write_job(
        root / f"t{trainers}", data=root / "data", slots=SLOTS, start=B.START, hours=hours
    )
    passes = B.train(config, slot_conf, models, trainers=trainers, args=["--log-every", "1000"])
    rates = [e.metrics["examples_per_sec"] for e in read_donefile(models)]
    return float(np.mean(rates)), passes[-1]


def labels_of(lines: list[str]) -> np.ndarray:
    return np.array([int(ln.split()[1]) for ln in lines])


def parse_rate(path: Path) -> tuple[float, float]:
    """(reader lines/s, bare pyarrow CSV lines/s) over the same text file."""
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
    t = time.perf_counter()
    got = sum(len(b) for b in data.iter_batches(part))
    ours = time.perf_counter() - t
    assert got == n, (got, n)
    # The limit: pyarrow's multithreaded CSV reader splitting the same bytes into lines (one string
    # column: no tokenising, no integer conversion, no validation).
    t = time.perf_counter()
    table = pacsv.read_csv(
        path,
        read_options=pacsv.ReadOptions(column_names=["line"]),
        parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False),
        convert_options=pacsv.ConvertOptions(column_types={"line": pyarrow.string()}),
    )
    bare = time.perf_counter() - t
    return n / ours, table.num_rows / bare


def logistic_regression_auc(train_lines: list[str], test_lines: list[str]) -> float:
    """scikit-learn logistic regression on hashed (slot, feasign) features."""
    from sklearn.feature_extraction import FeatureHasher
    from sklearn.linear_model import LogisticRegression

    def feats(lines):
        return [[f"{tok.split(':')[1]}_{tok.split(':')[0]}" for tok in ln.split()[2:]] for ln in lines]

    hasher = FeatureHasher(n_features=2**20, input_type="string", alternate_sign=False)
    x_train, x_test = hasher.transform(feats(train_lines)), hasher.transform(feats(test_lines))
    model = LogisticRegression(C=0.1, max_iter=300, solver="liblinear")
    model.fit(x_train, labels_of(train_lines))
    return auc(labels_of(test_lines), model.predict_proba(x_test)[:, 1])


def read_hour_lines(folder: Path) -> list[str]:
    return [ln for p in sorted(folder.glob("part-*")) for ln in p.read_text().splitlines() if ln]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (about a minute or two)")
    args = ap.parse_args()
    hours, lines = (2, 5000) if args.quick else (4, 25_000)
    with tempfile.TemporaryDirectory(prefix="bench-training-") as tmp:
        root = Path(tmp)
        summary = generate(
            root / "data", slots=SLOTS, hours=hours + 1, lines_per_hour=lines, seed=1, start=B.START, vocab=50
        )
        print(
            f"synthetic data: {hours} training hours x {lines} lines, {len(SLOTS)} slots "
            f"(+1 held-out hour); CTR {summary['ctr']:.3f}"
        )

        reader, bare = parse_rate(hour_dir(root / "data", B.START) / "part-00000")
        print(
            f"reader parse rate: {reader:,.0f} lines/s; bare pyarrow CSV split: {bare:,.0f} lines/s "
            f"(reader = {reader / bare:.2f}x of the limit)"
        )

        one, _ = throughput(root, hours, lines, 1)
        two, last_pass = throughput(root, hours, lines, 2)
        print(
            f"training throughput: 1 trainer {one:,.0f} examples/s; 2 trainers + 1 pserver {two:,.0f} examples/s "
            f"({two / one:.2f}x) on 2 shared cores"
        )

        held = hour_dir(root / "data", B.START + dt.timedelta(hours=hours))
        test_lines, truth = read_truth(held)
        labels = labels_of(test_lines)
        model_auc = auc(labels, B.score_pass(last_pass, test_lines))
        bayes = auc(labels, truth)
        print(
            f"synthetic held-out AUC {model_auc:.4f} vs Bayes-optimal {bayes:.4f} (gap {bayes - model_auc:.4f}, "
            f"ratio {model_auc / bayes:.3f})"
        )

        if not B.CRITEO_FILE.exists():
            print(f"Criteo comparison skipped: {B.CRITEO_FILE} not found")
            return
        from elastic_control.data.criteo import convert_file

        c_hours = 4
        convert_file(B.CRITEO_FILE, root / "criteo", hours=c_hours, start=B.START)
        train_hours = 1 if args.quick else c_hours - 1
        cjob = B.write_job(
            root / "criteo-job", data=root / "criteo", slots=B.CRITEO_SLOTS, start=B.START, hours=train_hours
        )
        cpass = B.train(*cjob, trainers=2, args=["--log-every", "1000"])[-1]
        test_lines = read_hour_lines(hour_dir(root / "criteo", B.START + dt.timedelta(hours=c_hours - 1)))
        train_lines = [
            ln
            for h in range(train_hours)
            for ln in read_hour_lines(hour_dir(root / "criteo", B.START + dt.timedelta(hours=h)))
        ]
        labels = labels_of(test_lines)
        probs = B.score_pass(cpass, test_lines)
        ours = auc(labels, probs)
        lr = logistic_regression_auc(train_lines, test_lines)
        const = log_loss(labels, np.full(len(labels), labels_of(train_lines).mean()))
        print(
            f"Criteo ({len(train_lines)} train / {len(test_lines)} test lines): AUC {ours:.4f}, log loss "
            f"{log_loss(labels, probs):.4f} (positive-rate constant {const:.4f}); scikit-learn logistic "
            f"regression on hashed features AUC {lr:.4f} (ours = {ours / lr:.3f}x)"
        )


if __name__ == "__main__":
    main()
