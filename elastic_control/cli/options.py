"""Options shared by several commands, declared once."""

from __future__ import annotations

import click

from ctr_foundation.env_vars import STATE_DIR


def _state_dir_fallback(ctx: click.Context, param: click.Parameter, value: str | None) -> str:
    """A subcommand without its own --state-dir uses the group's (`elastic-control --state-dir X status`)."""
    if value is not None:
        return value
    parent = ctx.find_object(dict) or {}
    return parent.get("state_dir") or STATE_DIR.get()


state_dir_option = click.option(
    "--state-dir",
    default=None,
    show_default=".elastic-ctr or $ELASTIC_CTR_STATE_DIR",
    callback=_state_dir_fallback,
    type=click.Path(file_okay=False),
    help="State folder: rendered plan and manifests, local runtime, logs.",
)


def positive_int(lo: int, hi: int) -> click.IntRange:
    return click.IntRange(lo, hi)
