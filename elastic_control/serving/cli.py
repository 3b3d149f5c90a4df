"""``elastic-control serve``: the prediction service (default port 8010)."""

from __future__ import annotations

import click

from ctr_foundation.env_vars import (
    CUBE_SERVERS,
    SERVING_GRPC_PORT,
    SERVING_PORT,
    SERVING_SPLIT,
)
from elastic_control.console import done
from elastic_control.inference.scoring import import_paddle
from elastic_control.serving.app import DEFAULT_CACHE_ENTRIES, DEFAULT_GRPC_PORT, DEFAULT_MAX_BODY, DEFAULT_PORT
from elastic_control.serving.batcher import DEFAULT_BATCH_DELAY
from elastic_control.serving.http_server import LIMITS
from elastic_control.serving.service import ServingConfig, listening_message, serve


@click.command("serve")
@click.option("--host", default="0.0.0.0", show_default=True)
@click.option(
    "--port",
    default=lambda: SERVING_PORT.get(),
    type=click.IntRange(0, 65535),
    help=f"HTTP port, 0 = any free one [default: $ELASTIC_CTR_SERVING_PORT or {DEFAULT_PORT}].",
)
@click.option(
    "--grpc-port",
    default=lambda: SERVING_GRPC_PORT.get(),
    type=click.IntRange(0, 65535),
    help=f"gRPC port, 0 = any free one [default: $ELASTIC_CTR_SERVING_GRPC_PORT or {DEFAULT_GRPC_PORT}].",
)
@click.option("--no-grpc", is_flag=True, help="Serve HTTP only.")
@click.option(
    "--fileserver",
    default=None,
    help="File server URL: follow its cube/current.json [default: $ELASTIC_CTR_FILESERVER_URL].",
)
@click.option(
    "--cube-root",
    default=None,
    type=click.Path(file_okay=False),
    help="Local cube root instead of the file server (current.json, VERSION/dense/).",
)
@click.option(
    "--model-dir",
    default=None,
    type=click.Path(file_okay=False),
    help="Serve MODEL_PATH's newest pass with its table in memory (no cube).",
)
@click.option(
    "--cube-servers", default=lambda: CUBE_SERVERS.get(), help="Comma-separated cube-server URLs, shard order."
)
@click.option("--cache-dir", default=None, type=click.Path(file_okay=False), help="Where dense models are downloaded.")
@click.option("--workers", default=2, show_default=True, type=click.IntRange(1, 64), help="Batch worker threads.")
@click.option(
    "--poll-interval",
    default=1.0,
    show_default=True,
    type=click.FloatRange(0.05),
    help="Seconds between version checks.",
)
@click.option(
    "--lookup-timeout", default=5.0, show_default=True, type=click.FloatRange(0.01), help="Cube lookup timeout (s)."
)
@click.option(
    "--max-body",
    default=DEFAULT_MAX_BODY,
    show_default=True,
    type=click.IntRange(1024),
    help="Largest request body (413 above).",
)
@click.option(
    "--max-connections",
    default=LIMITS.max_connections,
    show_default=True,
    type=click.IntRange(8),
    help="HTTP connection cap (over it, the oldest connection between requests is closed, else 503).",
)
@click.option(
    "--max-batch", default=2048, show_default=True, type=click.IntRange(1), help="Most instances merged into one batch."
)
@click.option(
    "--batch-delay",
    default=DEFAULT_BATCH_DELAY * 1000,
    show_default=True,
    type=click.FloatRange(0, 1000),
    help="Milliseconds a request arriving while others are in flight may wait for more to join its batch "
    "(0: never wait). A request arriving at an idle server never waits.",
)
@click.option(
    "--cache-entries",
    default=DEFAULT_CACHE_ENTRIES,
    show_default=True,
    type=click.IntRange(0),
    help="Hot-key embedding cache size in rows (0 = no cache).",
)
@click.option(
    "--split",
    "split_spec",
    default=lambda: SERVING_SPLIT.get(),
    help="A/B split at start: NAME=VERSION:PERCENT[,...] (challengers; control gets the rest) "
    "[default: $ELASTIC_CTR_SERVING_SPLIT]. Change it live with PUT /v1/split.",
)
@click.option(
    "--feedback-window",
    default=900.0,
    show_default=True,
    type=click.FloatRange(1),
    help="Seconds a prediction waits for its click feedback.",
)
@click.option(
    "--feedback-capacity",
    default=2_000_000,
    show_default=True,
    type=click.IntRange(1),
    help="Predicted instances remembered for feedback (bounded memory; the oldest go first).",
)
@click.option(
    "--monitor-window",
    default=600.0,
    show_default=True,
    type=click.FloatRange(10),
    help="Sliding window of live metrics (s).",
)
@click.option(
    "--alert-calibration",
    default="0.8..1.25",
    show_default=True,
    help="Calibration band LOW..HIGH (mean prediction / observed CTR); outside it is an alert.",
)
@click.option(
    "--alert-coverage",
    default=0.5,
    show_default=True,
    type=click.FloatRange(0, 1),
    help="Least share of a slot's keys cube must know; below it is an alert.",
)
@click.option(
    "--alert-min-feedback",
    default=500,
    show_default=True,
    type=click.IntRange(1),
    help="Joined feedback events in the window before calibration is judged.",
)
@click.option(
    "--mlflow-every",
    default=60.0,
    show_default=True,
    type=click.FloatRange(0),
    help="Seconds between live metrics recorded to MLflow ($MLFLOW_TRACKING_URI; 0 = never).",
)
@click.option(
    "--drain-delay",
    default=0.0,
    show_default=True,
    type=click.FloatRange(0),
    help="On SIGTERM: seconds to keep accepting with readiness false (time for a Service to drop the endpoint).",
)
@click.option(
    "--drain-timeout",
    default=30.0,
    show_default=True,
    type=click.FloatRange(0),
    help="On SIGTERM: most seconds to finish the requests already accepted.",
)
@click.option(
    "--shadow",
    "shadow_pass",
    default=None,
    type=click.Path(file_okay=False),
    help="Candidate pass folder to shadow-score beside the active version (evaluation/shadow.py).",
)
@click.option(
    "--shadow-log",
    default="shadow.jsonl",
    show_default=True,
    type=click.Path(dir_okay=False),
    help="JSONL log of active and candidate scores; summarise with `elastic-control eval shadow-report`.",
)
def serve_command(
    host,
    port,
    grpc_port,
    no_grpc,
    fileserver,
    cube_root,
    model_dir,
    cube_servers,
    cache_dir,
    workers,
    poll_interval,
    lookup_timeout,
    max_body,
    max_connections,
    max_batch,
    batch_delay,
    cache_entries,
    split_spec,
    feedback_window,
    feedback_capacity,
    monitor_window,
    alert_calibration,
    alert_coverage,
    alert_min_feedback,
    mlflow_every,
    drain_delay,
    drain_timeout,
    shadow_pass,
    shadow_log,
):
    """Serve predictions: HTTP POST /v1/predict and /v1/feedback, gRPC Predict and Feedback; /v1/monitor,
    /v1/split, /healthz, /readyz, /metrics, /v1/status."""
    config = ServingConfig(
        host=host,
        port=port,
        grpc_port=None if no_grpc else grpc_port,
        fileserver=fileserver,
        cube_root=cube_root,
        model_dir=model_dir,
        cube_servers=tuple(u.strip().rstrip("/") for u in (cube_servers or "").split(",") if u.strip()),
        cache_dir=cache_dir,
        workers=workers,
        poll_interval=poll_interval,
        lookup_timeout=lookup_timeout,
        max_body=max_body,
        max_connections=max_connections,
        max_batch=max_batch,
        batch_delay=batch_delay / 1000,
        cache_entries=cache_entries,
        split=split_spec,
        feedback_window=feedback_window,
        feedback_capacity=feedback_capacity,
        monitor_window=monitor_window,
        alert_calibration=alert_calibration,
        alert_coverage=alert_coverage,
        alert_min_feedback=alert_min_feedback,
        mlflow_every=mlflow_every,
        drain_delay=drain_delay,
        drain_timeout=drain_timeout,
    )
    hooks = []
    if shadow_pass:
        # function-level: keeps `elastic-control --help` fast (shadow loads pass_scorer, ~20 ms)
        from elastic_control.evaluation.shadow import ShadowScorer

        import_paddle()  # the scorer loads the pass: pyarrow before paddle, as serve() does
        hooks.append(ShadowScorer(shadow_pass, shadow_log))
    serve(
        config,
        on_listening=lambda server, app: done(listening_message(config, server, app)),
        after_response_hooks=hooks,
    )
