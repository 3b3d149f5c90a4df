"""The one console-script wrapper: one-line errors and the project's exit codes, never a traceback.

Every entry point (elastic-control, ctr-client, cube-*) runs its click command
through ``run_cli`` so that all of them fail the same way. Set
ELASTIC_CTR_DEBUG=1 to see tracebacks of ElasticControlError.
"""

from __future__ import annotations

import os
import signal
import sys

import click

from ctr_foundation.env_vars import DEBUG
from ctr_foundation.errors import EXIT_FAILURE, EXIT_USAGE, ElasticControlError

EXIT_SIGTERM = 128 + signal.SIGTERM


def _exit_on_sigterm(*_) -> None:
    raise SystemExit(EXIT_SIGTERM)


def run_cli(command: click.Command, prog: str, argv: list[str] | None = None) -> None:
    """Run ``command``; turn errors into ``prog: error: ...`` on stderr and an exit code.

    As PID 1 (of a container) SIGTERM ends the command (exit 143) unless the
    command installs its own handler: PID 1 with the default disposition never
    sees SIGTERM at all, and Kubernetes kills it only after the whole grace
    period (30 s by default) on every rollout, drain or job restart. Anywhere
    else the default stays (the kernel ends the process at once).
    """
    debug = _debug()
    if os.getpid() == 1 and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        command.main(args=argv, prog_name=prog, standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.UsageError as e:
        # One line, like every other error, instead of click's usage block.
        hint = f"; see `{e.ctx.command_path} -h`" if e.ctx is not None else ""
        click.echo(f"{prog}: error: {e.format_message().rstrip('.')}{hint}", err=True)
        sys.exit(EXIT_USAGE)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except ElasticControlError as e:
        if debug:
            raise
        click.echo(f"{prog}: error: {e}", err=True)
        sys.exit(e.exit_code)
    except BrokenPipeError:
        # stdout closed early (e.g. `| head`): nothing more to say.
        sys.exit(EXIT_FAILURE)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(0)


def _debug() -> bool:
    """ELASTIC_CTR_DEBUG; an unparsable value counts as off (it must never hide the real error)."""
    try:
        return bool(DEBUG.get())
    except ElasticControlError:
        return False
