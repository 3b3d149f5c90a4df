"""The prediction service as one call: ``serve(ServingConfig(...))`` (what ``elastic-control serve`` runs).

The config holds every setting of the command line with the same defaults, so a program (a test, an
embedding service) starts serving without click, as ``cube.server.serve`` starts a cube-server.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ctr_foundation.env_vars import CUBE_ROOT, FILESERVER_URL, MLFLOW_TRACKING_URI, MODEL_PATH, TOKEN
from ctr_foundation.errors import ComponentError, UsageError
from ctr_foundation.model_registry import CHALLENGER, AliasSetter, is_server_uri, pass_of_model_uri
from elastic_control.inference.scoring import import_paddle
from elastic_control.serving.app import (
    DEFAULT_CACHE_ENTRIES,
    DEFAULT_GRPC_PORT,
    DEFAULT_MAX_BODY,
    DEFAULT_PORT,
    ServingApp,
)
from elastic_control.serving.arms import SplitError, split_from_flag
from elastic_control.serving.batcher import DEFAULT_BATCH_DELAY
from elastic_control.serving.feedback import PredictionLog
from elastic_control.serving.http_server import LIMITS, ServingServer
from elastic_control.serving.instances import warm_up_line_parse
from elastic_control.serving.monitor import AlertRules, Monitor
from elastic_control.serving.recording import MlflowRecorder
from elastic_control.serving.versions import CubeRootSource, FileServerSource, ModelDirSource


@dataclass(frozen=True)
class ServingConfig:
    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT  # 0: any free port
    grpc_port: int | None = DEFAULT_GRPC_PORT  # None: HTTP only
    # Where versions come from: exactly one of these three (none: the environment's, in this order).
    fileserver: str | None = None  # follow its cube/current.json
    cube_root: str | None = None  # a local cube root
    model_dir: str | None = None  # MODEL_PATH's newest pass, its table in memory (no cube)
    cube_servers: tuple[str, ...] = ()  # shard order
    cache_dir: str | None = None  # where dense models are downloaded (default: a fresh temporary folder)
    workers: int = 2  # batch worker threads
    poll_interval: float = 1.0  # seconds between version checks
    lookup_timeout: float = 5.0  # cube lookups (s)
    max_body: int = DEFAULT_MAX_BODY
    max_connections: int = LIMITS.max_connections
    max_batch: int = 2048  # most instances merged into one batch
    batch_delay: float = DEFAULT_BATCH_DELAY  # seconds a request may wait for others while requests are in flight
    cache_entries: int = DEFAULT_CACHE_ENTRIES  # hot-key embedding cache rows (0: none)
    split: str | None = None  # NAME=VERSION:PERCENT[,...], applied once the first version is active
    feedback_window: float = 900.0
    feedback_capacity: int = 2_000_000
    monitor_window: float = 600.0
    alert_calibration: str = "0.8..1.25"
    alert_coverage: float = 0.5
    alert_min_feedback: int = 500
    mlflow_uri: str | None = None  # live metrics recorded here every ``mlflow_every`` seconds (0: never)
    mlflow_every: float = 60.0
    drain_delay: float = 0.0
    drain_timeout: float = 30.0
    token: str | None = None  # guards the mutating endpoints

    def with_environment(self) -> ServingConfig:
        """Nothing naming a version source: the environment's (file server, else cube root, else MODEL_PATH);
        the token and the MLflow URI from the environment where not given."""
        c = self
        if c.cube_root is None and c.model_dir is None and c.fileserver is None:
            fileserver = FILESERVER_URL.get()
            cube_root = None if fileserver else CUBE_ROOT.get()
            model_dir = None if fileserver or cube_root else MODEL_PATH.get()
            c = dataclasses.replace(c, fileserver=fileserver, cube_root=cube_root, model_dir=model_dir)
        return dataclasses.replace(
            c, token=c.token or TOKEN.get(), mlflow_uri=c.mlflow_uri or MLFLOW_TRACKING_URI.get()
        )


def make_source(config: ServingConfig):
    """The version source the config names: exactly one of file server, cube root, model dir."""
    named = (("--fileserver", config.fileserver), ("--cube-root", config.cube_root), ("--model-dir", config.model_dir))
    given = [n for n, v in named if v]
    if len(given) != 1:
        raise UsageError(
            "give exactly one of --fileserver URL (or ELASTIC_CTR_FILESERVER_URL), --cube-root DIR, "
            f"--model-dir DIR; got {', '.join(given) or 'none'}"
        )
    if config.model_dir:
        return ModelDirSource(config.model_dir)
    if not config.cube_servers:
        raise UsageError("cube-server URLs are needed: --cube-servers URL,URL,... or ELASTIC_CTR_CUBE_SERVERS")
    if config.cube_root:
        return CubeRootSource(config.cube_root, list(config.cube_servers), config.lookup_timeout)
    cache = config.cache_dir or tempfile.mkdtemp(prefix="elastic-ctr-serving-")
    return FileServerSource(config.fileserver, cache, list(config.cube_servers), config.lookup_timeout)


def build_app(config: ServingConfig, *, after_response_hooks: Sequence = ()):
    """The ServingApp with its monitor, feedback log, split, MLflow recorder and ``after_response_hooks``
    (e.g. evaluation/shadow.py's scorer, which sits above serving); UsageError naming a bad setting."""
    try:
        low, high = AlertRules.parse_band(config.alert_calibration)
        split = split_from_flag(config.split, resolve=_model_uri_resolver(config.mlflow_uri))
    except (ValueError, SplitError) as e:
        raise UsageError(str(e)) from e
    source = make_source(config)
    rules = AlertRules(
        calibration_low=low,
        calibration_high=high,
        coverage_floor=config.alert_coverage,
        min_feedback=config.alert_min_feedback,
    )
    app = ServingApp(
        source,
        workers=config.workers,
        poll_interval=config.poll_interval,
        max_batch_instances=config.max_batch,
        batch_delay=config.batch_delay,
        cache_entries=config.cache_entries,
        monitor=Monitor(window_s=config.monitor_window, rules=rules),
        prediction_log=PredictionLog(window_s=config.feedback_window, capacity=config.feedback_capacity),
        token=config.token,
    )
    if config.mlflow_uri and config.mlflow_every > 0:
        app.monitor_hooks.append(MlflowRecorder(config.mlflow_uri, every=config.mlflow_every, source=source.describe))
    if is_server_uri(config.mlflow_uri):
        app.split_hooks.append(challenger_alias(config.mlflow_uri))
    for hook in after_response_hooks:
        app.add_after_response_hook(hook)
    if split.challengers:
        app.start_split = split  # applied once the first version is active (app.py)
    return app


def serve(config: ServingConfig, *, on_listening: Callable | None = None, after_response_hooks: Sequence = ()) -> None:
    """Serve until SIGTERM (then drain): HTTP, and gRPC unless ``grpc_port`` is None."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s serving %(message)s")
    import_paddle()  # before our SIGTERM handler: Paddle's own would abort instead of draining
    logging.getLogger("elastic_control").setLevel(logging.INFO)  # importing paddle sets the root logger to WARNING
    config = config.with_environment()
    app = build_app(config, after_response_hooks=after_response_hooks)
    warm_up_line_parse()  # before listening: the first request would otherwise wait for its compilation
    try:
        server = ServingServer(  # binds here
            app,
            host=config.host,
            port=config.port,
            max_body=config.max_body,
            grpc_port=config.grpc_port,
            drain_delay=config.drain_delay,
            drain_timeout=config.drain_timeout,
            # bodies still arriving hold at most half the cap: a flood of slow bodies leaves room for others
            limits=dataclasses.replace(
                LIMITS,
                max_connections=config.max_connections,
                max_unfinished_bodies=min(LIMITS.max_unfinished_bodies, config.max_connections // 2),
            ),
        )
        server.run_forever(on_listening=lambda s: on_listening(s, app) if on_listening else None)
    except OSError as e:
        raise ComponentError(
            f"serving cannot listen on {config.host}:{config.port} (gRPC {config.grpc_port}): {e}"
        ) from e


def listening_message(config: ServingConfig, server, app) -> str:
    grpc_text = f", gRPC {server.grpc_target}" if server.grpc is not None else ""
    return f"serving on http://{config.host}:{server.port}{grpc_text} from {app.source.describe} (pid {os.getpid()})"


def challenger_alias(tracking_uri: str, *, patience: float = 600.0) -> Callable:
    """A split hook: the registered version of the split's (first) challenger gets the ``challenger`` alias,
    however the split was set (--split, PUT /v1/split, a canary), as cube-transfer's rollouts set ``champion``.
    In a thread of its own, retried for ``patience`` seconds (the pass may not be registered yet)."""
    setter = AliasSetter(tracking_uri, CHALLENGER, patience=patience)

    def hook(split) -> None:
        setter.point_at(split.challengers[0].version)

    hook.setter = setter  # for tests and --once runs: setter.wait()
    return hook


def _model_uri_resolver(mlflow_uri: str | None):
    """``models:/NAME@ALIAS`` -> the registered version's pass, through the MLflow server."""
    return lambda uri: pass_of_model_uri(mlflow_uri, uri)
