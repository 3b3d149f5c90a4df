"""``elastic-control fileserver --root DIR --port P``: run the file server in the foreground."""

from __future__ import annotations

import logging

import click

from ctr_foundation.env_vars import FILESERVER_PORT, FILESERVER_ROOT, TOKEN
from ctr_foundation.errors import ComponentError
from elastic_control.console import done, warn
from elastic_control.fileserver.server import DEFAULT_MAX_BYTES, DEFAULT_PORT, make_fileserver


@click.command("fileserver")
@click.option(
    "--root",
    default=lambda: FILESERVER_ROOT.get(),
    type=click.Path(file_okay=False),
    help="Folder to serve, created if missing [default: $ELASTIC_CTR_FILESERVER_ROOT].",
)
@click.option("--host", default="0.0.0.0", show_default=True, help="Address to bind.")
@click.option(
    "--port",
    default=lambda: FILESERVER_PORT.get(),
    type=click.IntRange(0, 65535),
    help=f"Port, 0 picks a free one [default: $ELASTIC_CTR_FILESERVER_PORT or {DEFAULT_PORT}].",
)
@click.option(
    "--max-bytes",
    default=DEFAULT_MAX_BYTES,
    show_default=True,
    type=click.IntRange(1),
    help="Largest upload accepted (413 above).",
)
@click.option(
    "--kept-logs",
    default=None,
    type=click.Path(file_okay=False),
    help="Also serve this folder, read-only and with the token, as logs/: the training pods' kept logs "
    "(the manifests mount the shared claim read-only and pass its logs/ folder).",
)
def fileserver_command(root, host, port, max_bytes, kept_logs):
    """Serve files: PUT/GET/DELETE /files/PATH; writes and reads outside cube/ need ELASTIC_CTR_TOKEN."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s fileserver %(message)s")
    if not root:
        raise click.UsageError("--root DIR is required (or set ELASTIC_CTR_FILESERVER_ROOT)")
    token = TOKEN.get()
    if not token:
        warn("ELASTIC_CTR_TOKEN is not set: the file server is read-only")
    try:
        server = make_fileserver(root=root, host=host, port=port, token=token, max_bytes=max_bytes, kept_logs=kept_logs)
    except OSError as e:
        raise ComponentError(f"file server cannot listen on {host}:{port}: {e}") from e
    bound_host, bound_port = server.server_address[:2]
    done(f"file server serving {root} on http://{bound_host}:{bound_port}")
    try:
        server.serve_forever(handle_signals=True)  # SIGTERM/SIGINT: stop accepting, close connections, exit
    finally:
        server.server_close()
