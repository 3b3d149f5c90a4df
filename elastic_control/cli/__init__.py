"""The ``elastic-control`` command line: click code only, calling ``elastic_control.api``."""

from elastic_control.cli.main import main

__all__ = ["main"]
