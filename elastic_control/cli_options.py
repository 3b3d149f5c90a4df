"""Options shared by several commands, declared once."""
from __future__ import annotations

import click

from elastic_control.env_vars import STATE_DIR

state_dir_option = click.option(
    "--state-dir", default=lambda: STATE_DIR.get(), show_default=".elastic-ctr",
    type=click.Path(file_okay=False), help="State folder: rendered plan and manifests, local runtime, logs.")


def positive_int(lo: int, hi: int) -> click.IntRange:
    return click.IntRange(lo, hi)
