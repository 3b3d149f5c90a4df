"""The hidden ``elastic-control supervise`` command: the detached supervisor's entry point.

Users never call it: ``elastic-control -a`` with the local backend starts it
(elastic_control.local.daemon) and ``delete`` stops it.
"""

from __future__ import annotations

import json
import sys

import click

from ctr_foundation.env_vars import TOKEN
from ctr_foundation.names import StateFolder
from elastic_control.cli.options import state_dir_option
from elastic_control.local.supervisor import configure_logging, run_supervisor


@click.command("supervise", hidden=True)
@state_dir_option
def supervise_command(state_dir):
    """Run the local supervisor in the foreground on STATE_DIR (started by -a)."""
    configure_logging()
    layout = StateFolder.of(state_dir)
    token_file = layout.token_file
    token = token_file.read_text().strip() if token_file.exists() else None
    secret = {TOKEN.name: token} if token else {}
    if layout.credentials_file.exists():  # HDFS_UGI: the local components' data.config reads it from the environment
        secret.update(json.loads(layout.credentials_file.read_text()))
    sys.exit(run_supervisor(layout.state, secret_env=secret))
