"""`status` and `delete`: act on whatever -r planned and -a started."""

from __future__ import annotations

import click

from elastic_control.cli.options import state_dir_option


@click.command(help="Show every component's state (probed now), training progress, cube and serving versions.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole status as one JSON document.")
@state_dir_option
def status(as_json, state_dir):
    from elastic_control import api
    from elastic_control.cli.status_view import print_status, print_status_json
    from elastic_control.console import console

    with console.status("probing every component"):
        document = api.status(state_dir=state_dir)
    (print_status_json if as_json else print_status)(document)


@click.command(help="Stop and remove everything -a started (data and models stay).")
@state_dir_option
def delete(state_dir):
    from elastic_control import api

    api.delete(state_dir=state_dir)
