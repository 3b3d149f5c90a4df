"""``elastic-control serve``: the prediction service (default port 8010)."""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile

import click

from ctr_foundation.env_vars import (
    CUBE_ROOT,
    CUBE_SERVERS,
    FILESERVER_URL,
    MLFLOW_TRACKING_URI,
    MODEL_PATH,
    SERVING_GRPC_PORT,
    SERVING_PORT,
    SERVING_SPLIT,
    TOKEN,
)
from ctr_foundation.errors import UsageError
from elastic_control.console import done
from elastic_control.serving.app import DEFAULT_CACHE_ENTRIES, DEFAULT_GRPC_PORT, DEFAULT_MAX_BODY, DEFAULT_PORT
from elastic_control.serving.http_server import LIMITS


def make_source(
    *,
    fileserver: str | None,
    cube_root: str | None,
    model_dir: str | None,
    cube_servers: list[str],
    cache_dir: str | None,
    lookup_timeout: float,
):
    """The version source the flags name: exactly one of file server, cube root, model dir."""
    from elastic_control.serving.versions import CubeRootSource, FileServerSource, ModelDirSource

    given = [n for n, v in (("--fileserver", fileserver), ("--cube-root", cube_root), ("--model-dir", model_dir)) if v]
    if len(given) != 1:
        raise UsageError(
            "give exactly one of --fileserver URL (or ELASTIC_CTR_FILESERVER_URL), --cube-root DIR, "
            f"--model-dir DIR; got {', '.join(given) or 'none'}"
        )
    if model_dir:
        return ModelDirSource(model_dir)
    if not cube_servers:
        raise UsageError("cube-server URLs are needed: --cube-servers URL,URL,... or ELASTIC_CTR_CUBE_SERVERS")
    if cube_root:
        return CubeRootSource(cube_root, cube_servers, lookup_timeout)
    cache = cache_dir or tempfile.mkdtemp(prefix="elastic-ctr-serving-")
    return FileServerSource(fileserver, cache, cube_servers, lookup_timeout)


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
    from elastic_control.inference.scoring import import_paddle
    from elastic_control.serving.app import ServingApp
    from elastic_control.serving.arms import SplitError, split_from_flag
    from elastic_control.serving.feedback import PredictionLog
    from elastic_control.serving.http_server import ServingServer
    from elastic_control.serving.monitor import AlertRules, Monitor

    logging.basicConfig(level=logging.INFO, format="%(asctime)s serving %(message)s")
    import_paddle()  # before our SIGTERM handler: Paddle's own would abort instead of draining
    logging.getLogger("elastic_control").setLevel(logging.INFO)  # importing paddle sets the root logger to WARNING
    try:
        low, high = AlertRules.parse_band(alert_calibration)
        split = split_from_flag(split_spec, resolve=_model_uri_resolver())
    except (ValueError, SplitError) as e:
        raise UsageError(str(e)) from e
    if cube_root is None and model_dir is None and fileserver is None:
        # Nothing on the command line: the environment, in the same order of preference.
        fileserver = FILESERVER_URL.get()
        cube_root = None if fileserver else CUBE_ROOT.get()
        model_dir = None if fileserver or cube_root else MODEL_PATH.get()
    urls = [u.strip().rstrip("/") for u in (cube_servers or "").split(",") if u.strip()]
    source = make_source(
        fileserver=fileserver,
        cube_root=cube_root,
        model_dir=model_dir,
        cube_servers=urls,
        cache_dir=cache_dir,
        lookup_timeout=lookup_timeout,
    )
    rules = AlertRules(
        calibration_low=low, calibration_high=high, coverage_floor=alert_coverage, min_feedback=alert_min_feedback
    )
    app = ServingApp(
        source,
        workers=workers,
        poll_interval=poll_interval,
        max_batch_instances=max_batch,
        cache_entries=cache_entries,
        monitor=Monitor(window_s=monitor_window, rules=rules),
        prediction_log=PredictionLog(window_s=feedback_window, capacity=feedback_capacity),
        token=TOKEN.get(),
    )
    tracking = MLFLOW_TRACKING_URI.get()
    if tracking and mlflow_every > 0:
        from elastic_control.serving.recording import MlflowRecorder

        app.monitor_hooks.append(MlflowRecorder(tracking, every=mlflow_every, source=source.describe))
    if shadow_pass:
        from elastic_control.evaluation.shadow import ShadowScorer

        app.add_after_response_hook(ShadowScorer(shadow_pass, shadow_log))
    if split.challengers:
        app.start_split = split  # applied once the first version is active (app.py)

    def listening(s):
        grpc_text = f", gRPC {s.grpc_target}" if s.grpc is not None else ""
        done(f"serving on http://{host}:{s.port}{grpc_text} from {source.describe} (pid {os.getpid()})")

    try:
        server = ServingServer(  # binds here
            app,
            host=host,
            port=port,
            max_body=max_body,
            grpc_port=None if no_grpc else grpc_port,
            drain_delay=drain_delay,
            drain_timeout=drain_timeout,
            # bodies still arriving hold at most half the cap: a flood of slow bodies leaves room for others
            limits=dataclasses.replace(
                LIMITS,
                max_connections=max_connections,
                max_unfinished_bodies=min(LIMITS.max_unfinished_bodies, max_connections // 2),
            ),
        )
        server.run_forever(on_listening=listening)
    except OSError as e:
        from ctr_foundation.errors import ComponentError

        raise ComponentError(f"serving cannot listen on {host}:{port} (gRPC {grpc_port}): {e}") from e


def _model_uri_resolver():
    """``models:/NAME@ALIAS`` -> the registered version's pass, through $MLFLOW_TRACKING_URI."""
    from ctr_foundation.model_registry import pass_of_model_uri

    return lambda uri: pass_of_model_uri(MLFLOW_TRACKING_URI.get(), uri)
