"""``elastic-control serve``: the prediction service (default port 8010)."""

from __future__ import annotations

import logging
import os
import tempfile

import click

from ctr_foundation.env_vars import CUBE_ROOT, CUBE_SERVERS, FILESERVER_URL, MODEL_PATH, SERVING_PORT
from ctr_foundation.errors import UsageError
from elastic_control.console import done
from elastic_control.serving.app import DEFAULT_MAX_BODY, DEFAULT_PORT


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
    help=f"Port [default: $ELASTIC_CTR_SERVING_PORT or {DEFAULT_PORT}].",
)
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
    "--max-batch", default=2048, show_default=True, type=click.IntRange(1), help="Most instances merged into one batch."
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
    fileserver,
    cube_root,
    model_dir,
    cube_servers,
    cache_dir,
    workers,
    poll_interval,
    lookup_timeout,
    max_body,
    max_batch,
    shadow_pass,
    shadow_log,
):
    """Serve predictions: POST /v1/predict, GET /healthz, /metrics, /v1/status."""
    from elastic_control.serving.app import ServingApp
    from elastic_control.serving.http_server import ServingServer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s serving %(message)s")
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
    app = ServingApp(source, workers=workers, poll_interval=poll_interval, max_batch_instances=max_batch)
    if shadow_pass:
        from elastic_control.evaluation.shadow import ShadowScorer

        app.add_after_response_hook(ShadowScorer(shadow_pass, shadow_log))
    try:
        server = ServingServer(app, host=host, port=port, max_body=max_body)  # binds here
        server.run_forever(
            on_listening=lambda s: done(f"serving on http://{host}:{s.port} from {source.describe} (pid {os.getpid()})")
        )
    except OSError as e:
        from ctr_foundation.errors import ComponentError

        raise ComponentError(f"serving cannot listen on {host}:{port}: {e}") from e
