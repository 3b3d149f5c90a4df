"""`status` and `delete`: act on whatever -r planned and -a started."""

from __future__ import annotations

import contextlib
import sys

import click

from ctr_foundation.errors import ElasticControlError
from elastic_control.backends import status as st
from elastic_control.cli.exit_codes import EXIT_USAGE_ERROR, STATUS_EXIT_HELP, health_exit_code
from elastic_control.cli.options import state_dir_option
from elastic_control.cli.status_view import DOCUMENT_OUTPUTS, OUTPUTS, print_error_document, render_status, watch_status


class _StatusCommand(click.Command):
    """`status`: under ``-o json|yaml`` a usage error (a bad flag value) is a document on stdout too."""

    def make_context(self, info_name, args, parent=None, **extra):
        given = list(args)  # parsing consumes ``args``
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as e:
            output = requested_output(given)
            if output in DOCUMENT_OUTPUTS:
                print_error_document(e.format_message(), "UsageError", output)
                sys.exit(EXIT_USAGE_ERROR)
            raise


def requested_output(args: list[str]) -> str | None:
    """The output `status` was asked for in ``args`` (``--json``, ``-o X``, ``-oX``, ``--output[=]X``), if any."""
    found = None
    for i, arg in enumerate(args):
        nxt = args[i + 1] if i + 1 < len(args) else None
        if arg == "--json":
            found = "json"
        elif arg in ("-o", "--output"):
            found = nxt
        elif arg.startswith("--output="):
            found = arg.split("=", 1)[1]
        elif arg.startswith("-o") and not arg.startswith("--"):
            found = arg[2:]
    return found


@click.command(
    cls=_StatusCommand,
    help="Show every component's state (probed now), training progress, cube and serving versions.\n\n"
    + STATUS_EXIT_HELP
    + " With --watch: the code of the last status shown.",
    epilog="Examples: elastic-control status -o wide; elastic-control status -o json | jq .health; "
    "elastic-control status --watch --interval 5.",
)
@click.option(
    "-o",
    "--output",
    type=click.Choice(OUTPUTS),
    default=None,
    help="text: one line per component, cut to the terminal's width [default]; wide: every cell whole; "
    "json, yaml: the whole status document (errors too: {error, kind} on stdout).",
)
@click.option("--json", "as_json", is_flag=True, help="Same as -o json.")
@click.option("-w", "--watch", is_flag=True, help="Show the status again every --interval seconds until Ctrl-C.")
@click.option(
    "--interval",
    type=click.FloatRange(min=0.2),
    default=2.0,
    show_default=True,
    metavar="SECONDS",
    help="With --watch: seconds between two updates.",
)
@state_dir_option
def status(output, as_json, watch, interval, state_dir):
    if as_json and output not in (None, "json"):
        raise click.UsageError(f"--json and -o {output} ask for different outputs; give one of them")
    output = "json" if as_json else output or "text"
    with document_errors(output):
        last = show_status(state_dir=state_dir, output=output, watch=watch, interval=interval)
    # SystemExit: click's main(standalone_mode=False), which run_cli uses, would swallow click's Exit.
    sys.exit(health_exit_code(st.pipeline_health(last)[0]))


def show_status(
    *, state_dir: str, output: str = "text", watch: bool = False, interval: float = 2.0, updates: int | None = None
):
    """Read the status and print it as ``output``; with ``watch``, again every ``interval`` seconds until
    Ctrl-C (or ``updates`` times). The last status shown."""
    # function-level: keeps `elastic-control --help` and `status --help` fast (api loads both backends,
    # console loads rich)
    from elastic_control import api
    from elastic_control.console import console

    def read():
        # The spinner goes to stderr; not on a screen that --watch redraws.
        if watch:
            return api.status(state_dir=state_dir)
        with console.status("probing every component"):
            return api.status(state_dir=state_dir)

    if watch:
        return watch_status(read, output=output, interval=interval, updates=updates)
    document = read()
    render_status(document, output)
    return document


@contextlib.contextmanager
def document_errors(output: str):
    """Under ``-o json|yaml``: an ElasticControlError becomes ``{"error", "kind"}`` on stdout, same exit code."""
    if output not in DOCUMENT_OUTPUTS:
        yield
        return
    try:
        yield
    except ElasticControlError as e:
        print_error_document(str(e), type(e).__name__, output)
        sys.exit(e.exit_code)


@click.command(help="Stop and remove everything -a started (data and models stay).")
@state_dir_option
def delete(state_dir):
    # function-level: keeps `elastic-control --help` fast (api loads both backends)
    from elastic_control import api

    api.delete(state_dir=state_dir)
