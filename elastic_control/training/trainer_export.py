"""Trainer 0 writes a pass (every trainer waiting at the barrier): its metrics over every trainer, the
sparse table and dense model, the golden lines scored by the training program, meta.json, the donefile
line, and the MLflow metrics and registered model version (training/pass_export.py writes the folder)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from elastic_control.data.line_batch import concat_batches
from elastic_control.data.readers import HourPartition
from elastic_control.metrics import auc, log_loss
from elastic_control.training import pass_export
from elastic_control.training.families import row_layout
from elastic_control.training.model import saved_rule

if TYPE_CHECKING:
    from elastic_control.training.trainer import PassStats, Trainer


def export_pass(trainer: Trainer, part: HourPartition, stats: PassStats, everyone: dict) -> str:
    """Write the pass (trainer 0, every trainer waiting); returns its folder."""
    trainer.ps.pull_dense()
    held_out = concat_batches(stats.golden)
    golden_count = min(len(held_out), trainer.s.hyper.golden_lines)
    examples = sum(int(d["examples"]) for d in everyone.values())
    bad = sum(int(d["bad_lines"]) for d in everyone.values())
    train_loss = stats.loss_sum / max(stats.examples, 1)
    metrics = {
        "examples": examples,
        "bad_lines": bad,
        "train_loss": train_loss,
        "train_auc": trainer.window.auc(),
        "golden_lines": golden_count,
        "holdout_lines": len(held_out),
        "epochs": stats.epochs,
        "examples_per_sec": examples / max(max(float(d["seconds"]) for d in everyone.values()), 1e-9),
    }
    snapshot = {}
    scored: dict = {}

    timings = {}
    plan = trainer.incremental.plan() if trainer.incremental else None

    def save_sparse(path):
        t = time.monotonic()
        # Only the sparse table: fleet.save_persistables would also write the
        # dense table as text (seconds, and nobody reads it: dense/ has it).
        worker, table_id = trainer.ps.sparse_table()
        if plan is None:
            worker.save_one_model(table_id, str(path), 0)
        else:  # base or delta, admission, eviction: training/delta_export.py
            metrics.update(trainer.incremental.export(worker, table_id, trainer.sparse_shards, path.parent, plan))
        timings["sparse"] = time.monotonic() - t

    def save_dense(prefix):
        timings["dense"] = time.monotonic()
        snapshot.update(trainer.ps.dense_snapshot())
        trainer.paddle.static.save_inference_model(
            str(prefix),
            [trainer.net.infer_input],
            [trainer.net.infer_prob],
            trainer.exe,
            program=trainer.net.infer_program,
        )
        pass_export.clear_op_callstacks(f"{prefix}.pdmodel")

    def score_golden():
        timings["dense"] = time.monotonic() - timings["dense"]
        t = time.monotonic()
        probs = trainer.score(held_out) if len(held_out) else np.zeros(0)
        timings["golden"] = time.monotonic() - t
        after = trainer.ps.dense_snapshot()
        if any(not np.array_equal(after[k], v) for k, v in snapshot.items()):
            raise RuntimeError("dense parameters changed during the export; refusing an inconsistent pass")
        scored["probs"] = probs
        if len(held_out):
            metrics["auc"] = auc(held_out.clicks, probs)
            metrics["logloss"] = log_loss(held_out.clicks, probs)
            metrics["calibration"] = float(probs.mean() / max(held_out.clicks.mean(), 1e-12))
        lines = [held_out.line_at(i) for i in range(golden_count)]
        return pass_export.golden_rows(lines, probs[:golden_count])

    meta = {
        "slots": list(trainer.spec.slots),
        "embedding_dim": trainer.spec.embedding_dim,
        "sparse_dim": trainer.spec.sparse_dim,
        "sparse_layout": pass_export.sparse_layout_json(
            trainer.spec.embedding_dim,
            optimizer=saved_rule(trainer.spec.sparse_optimizer),
            embed_optimizer=saved_rule(trainer.spec.wide_optimizer),
        ),
        "model_family": trainer.spec.family,
        "row_layout": row_layout(trainer.spec.family, trainer.spec.embedding_dim),
        **(
            {"dense_slots": list(trainer.spec.dense_slots), "dense_norm": trainer.dense_norm.to_json()}
            if trainer.dense_norm
            else {}
        ),
        "training": {
            "epochs": trainer.s.epochs,
            "epochs_run": stats.epochs,
            "holdout_losses": [round(v, 6) for v in stats.holdout_losses],
            "best_epoch": stats.best_epoch,
            "restored_epoch": stats.restored_epoch,
            "early_stop": trainer.s.early_stop,
            "judged_by_holdout": bool(trainer.s.early_stop) and stats.judged,
            "batch_size": stats.batch_size,
            "window_hours": trainer.s.window_hours,
            "window_lines": stats.context_lines,
            "bias_shift": None if stats.bias_shift is None else round(stats.bias_shift, 6),
        },
        "trainers": trainer.s.trainers,
        "pservers": trainer.s.pservers,
        "metrics": metrics,
        "model": trainer.spec.to_json(),
        **(plan.meta() if plan else {}),
    }
    entry = pass_export.write_pass(
        trainer.s.model_path,
        hour_start=part.hour,
        hour_end=part.last,
        save_sparse=save_sparse,
        save_dense=save_dense,
        score_golden=score_golden,
        meta=meta,
        minutes=trainer.s.data_config.pass_minutes,
    )
    if trainer.incremental:
        trainer.incremental.exported(entry.path)
        trainer.log(incremental_summary(entry.pass_name, plan, metrics))
    trainer.log("export timings: " + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items()))
    trainer.log(
        f"exported {entry.pass_name}: held-out AUC {metrics.get('auc', float('nan')):.4f} on "
        f"{len(held_out)} held-out lines, train AUC {metrics['train_auc']:.4f}"
    )
    if trainer.tracker:
        t = time.monotonic()
        pass_metrics = {f"pass_{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}
        trainer.tracker.log_metrics(pass_metrics, trainer.global_step)
        trainer.tracker.register_pass(
            entry.path,
            pass_name=entry.pass_name,
            window=entry.window,
            metrics={k: metrics[k] for k in ("auc", "train_auc", "examples") if k in metrics},
            family=trainer.spec.family,
        )
        trainer.log(f"MLflow: logged and registered {entry.pass_name} in {time.monotonic() - t:.1f}s")
    return entry.path


def incremental_summary(name: str, plan, m: dict) -> str:
    kind = f"delta on {plan.parent}" if plan.kind == "delta" else "base"
    return (
        f"{name} ({kind}): {m['rows']} rows, {m['keys_deleted']} deleted; keys live {m['keys_live']}, "
        f"admitted {m['keys_admitted']}, new {m['keys_new']}, newly admitted {m['keys_newly_admitted']}, "
        f"evicted {m['keys_evicted']}"
    )
