"""What an evaluation leaves behind: a rich table, metrics.json, scored.parquet, ROC and calibration plots."""

from __future__ import annotations

import math
from pathlib import Path

from ctr_foundation.atomic import atomic_open, atomic_write_json
from elastic_control.metrics import auc_from_counts, roc_points

METRICS_FILE = "metrics.json"
SCORED_FILE = "scored.parquet"
ROC_PLOT = "roc.png"
CALIBRATION_PLOT = "calibration.png"

HEADLINE = ("examples", "positives", "auc", "logloss", "calibration", "mean_predicted_ctr", "observed_ctr", "gauc")


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.6f}"
    return str(v)


def metrics_table(metrics: dict):
    """A rich Table: one row per metric, a column per pass (and the delta)."""
    from rich.table import Table

    names = [n for n in ("model", "baseline") if n in metrics]
    table = Table(title=f"evaluation {metrics['data']['window']['start']}..{metrics['data']['window']['end']}")
    table.add_column("metric")
    for n in names:
        table.add_column(f"{n}: {metrics[n].get('pass', '')}", justify="right")
    if "comparison" in metrics:
        table.add_column("delta", justify="right")
    keys = list(HEADLINE) + [k for k in metrics["model"] if k.startswith("ndcg@")] + ["groups", "auc_error_bound"]
    for key in keys:
        if key not in metrics["model"]:
            continue
        row = [key] + [_fmt(metrics[n].get(key)) for n in names]
        if "comparison" in metrics:
            d = metrics["comparison"].get(f"{key}_delta")
            row.append(f"{d:+.6f}" if isinstance(d, float) else "")
        table.add_row(*row)
    return table


def reliability_table(summary: dict, title: str):
    from rich.table import Table

    t = Table(title=title)
    for c in ("predicted", "count", "mean predicted", "observed CTR"):
        t.add_column(c, justify="right")
    for r in summary["reliability"]:
        if r["count"]:
            t.add_row(
                f"{r['bin'][0]:.1f}-{r['bin'][1]:.1f}",
                str(r["count"]),
                _fmt(r["mean_predicted"]),
                _fmt(r["observed_ctr"]),
            )
    return t


def write_scored_parquet(files: list[Path], dest: Path) -> int:
    """Concatenate the shares' scored rows into one Parquet file (streamed, written atomically)."""
    import pyarrow.parquet as pq

    rows = 0
    with atomic_open(dest, "wb") as f:
        writer = None
        for path in files:
            pf = pq.ParquetFile(path)
            for rb in pf.iter_batches(batch_size=1 << 20):
                if writer is None:
                    writer = pq.ParquetWriter(f, rb.schema)
                writer.write_batch(rb)
                rows += rb.num_rows
        if writer is None:
            import pyarrow as pa

            writer = pq.ParquetWriter(f, pa.schema([("label", pa.int8()), ("score", pa.float32())]))
        writer.close()
    return rows


def plot_roc(counts: dict, dest: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    for name, t in counts.items():
        fpr, tpr = roc_points(t)
        auc, _ = auc_from_counts(t)
        ax.plot(fpr, tpr, label=f"{name} (AUC {auc:.4f})" if auc is not None else name)
    ax.plot([0, 1], [0, 1], color="grey", linestyle=":")
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("true positive rate")
    ax.legend(loc="lower right")
    return _save(fig, dest)


def plot_calibration(metrics: dict, dest: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    for name in ("model", "baseline"):
        if name not in metrics:
            continue
        rows = [r for r in metrics[name]["reliability"] if r["count"]]
        ax.plot(
            [r["mean_predicted"] for r in rows],
            [r["observed_ctr"] for r in rows],
            marker="o",
            label=f"{name} (calibration {_fmt(metrics[name]['calibration'])})",
        )
    ax.plot([0, 1], [0, 1], color="grey", linestyle=":")
    ax.set_xlabel("mean predicted CTR")
    ax.set_ylabel("observed CTR")
    ax.legend(loc="upper left")
    return _save(fig, dest)


def _save(fig, dest: Path) -> Path:
    import matplotlib.pyplot as plt

    with atomic_open(dest, "wb") as f:
        fig.savefig(f, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return dest


def write_outputs(result, output: Path) -> dict[str, Path]:
    """metrics.json, scored.parquet (when rows were kept) and the two plots in ``output``."""
    output.mkdir(parents=True, exist_ok=True)
    paths = {"metrics": output / METRICS_FILE}
    atomic_write_json(paths["metrics"], result.metrics)
    if result.spec.keep_scored:
        paths["scored"] = output / SCORED_FILE
        write_scored_parquet(result.scored_files, paths["scored"])
    paths["roc"] = plot_roc(result.counts, output / ROC_PLOT)
    paths["calibration"] = plot_calibration(result.metrics, output / CALIBRATION_PLOT)
    return paths
