"""`status` and `delete`: act on whatever -r planned and -a started."""

from __future__ import annotations

import click

from elastic_control.cli.options import state_dir_option


@click.command(help="Show every component's state, training progress and the active model/cube version.")
@state_dir_option
def status(state_dir):
    from elastic_control import api

    api.status(state_dir=state_dir)


@click.command(help="Stop and remove everything -a started (data and models stay).")
@state_dir_option
def delete(state_dir):
    from elastic_control import api

    api.delete(state_dir=state_dir)
