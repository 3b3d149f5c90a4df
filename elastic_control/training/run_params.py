"""What MLflow records as a training run's params: the settings every role resolved, the model, the job."""

from __future__ import annotations

from elastic_control.config.data_config import format_hour


def run_params(settings, spec, hello: dict) -> dict:
    """``settings``: the role's RoleSettings; ``spec``: its ModelSpec; ``hello``: the coordinator's (resume)."""
    return {
        "model_family": spec.family,
        "epochs": settings.epochs,
        "early_stop": settings.early_stop,
        "restore_best_epoch": settings.hyper.restore_best_epoch is not False,
        "refit_bias": settings.hyper.refit_bias is not False,
        "early_stop_patience": settings.hyper.early_stop_patience,
        "min_holdout_to_stop": settings.hyper.min_holdout_to_stop,
        "unjudged_pass_epochs": settings.hyper.unjudged_pass_epochs,
        "sparse_learning_rate": spec.sparse_learning_rate,
        "wide_learning_rate": spec.wide_learning_rate,
        "sparse_optimizer": spec.sparse_optimizer,
        "wide_optimizer": spec.wide_optimizer,
        "decay_sightings": spec.decay_sightings if spec.uses_decay else "",
        "l2_embedding": spec.l2_embedding,
        "l2_wide": spec.l2_wide,
        "wide_prior": spec.wide_prior if spec.uses_wide_prior else "",
        "slots": ",".join(map(str, spec.slots)),
        "num_slots": len(spec.slots),
        "dense_slots": ",".join(map(str, spec.dense_slots)),
        "embedding_dim": spec.embedding_dim,
        "hidden": "-".join(map(str, spec.hidden)),
        "trainers": settings.trainers,
        "pservers": settings.pservers,
        "learning_rate": spec.learning_rate,
        "batch_size": settings.hyper.batch_size,
        "min_batches_first_pass": settings.hyper.min_batches_first_pass,
        "window_hours": settings.window_hours,
        "sparse_dim": spec.sparse_dim,
        "window_start": format_hour(settings.data_config.start),
        "window_end": format_hour(settings.data_config.end),
        "dataset": settings.data_config.dataset_root,
        "online": settings.data_config.online,
        "resumed_after": hello.get("last_pass") or "",
        **_incremental(settings.data_config),
    }


def _incremental(c) -> dict:
    if not c.incremental:
        return {}
    return {
        "delta_passes": c.delta_passes,
        "base_every": c.base_every,
        "admit_min_count": c.admit_min_count or 0,
        "evict_after_passes": c.evict_after_passes or 0,
        "pass_minutes": c.pass_minutes or 60,
    }
