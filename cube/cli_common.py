"""Shared entry-point wrapper: one-line errors and the project's exit codes, never a traceback."""
from __future__ import annotations

import os
import sys

import click

from elastic_control.errors import EXIT_USAGE, ElasticControlError


def run_cli(command: click.Command, prog: str, argv: list[str] | None = None) -> None:
    """Run a click command; ElasticControlError -> ``prog: error: ...`` and its exit code."""
    debug = os.environ.get("ELASTIC_CTR_DEBUG", "").lower() in ("1", "true", "yes")
    try:
        command.main(args=argv, prog_name=prog, standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(EXIT_USAGE if isinstance(e, click.UsageError) else e.exit_code)
    except ElasticControlError as e:
        if debug:
            raise
        click.echo(f"{prog}: error: {e}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(0)
