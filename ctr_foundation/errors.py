"""One exception tree for the whole tool.

Library code raises these (always ``raise ... from e`` when wrapping); only the
CLI turns them into one-line messages and exit codes. Set ELASTIC_CTR_DEBUG=1
to see tracebacks.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


class ElasticControlError(Exception):
    """Base of every error ElasticCTR reports to a user."""

    exit_code = EXIT_FAILURE


class UsageError(ElasticControlError):
    """The user asked for something invalid (bad flag value, wrong order of steps)."""

    exit_code = EXIT_USAGE


class ConfigError(UsageError):
    """A configuration file or value is invalid; the message names file, line and value."""

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None):
        where = ""
        if path is not None:
            where = f"{path}:{line}: " if line is not None else f"{path}: "
        super().__init__(where + message)
        self.path = path
        self.line = line


class DataError(ElasticControlError):
    """Input data is unusable (too many malformed lines, missing partitions)."""


class ClusterUnavailableError(ElasticControlError):
    """No Kubernetes cluster could be reached, or a prerequisite (Volcano) is missing."""


class ApplyError(ElasticControlError):
    """Creating or replacing a resource failed."""

    def __init__(self, message: str, *, kind: str = "", namespace: str = "", name: str = ""):
        super().__init__(f"{kind} {namespace}/{name}: {message}" if kind else message)
        self.kind, self.namespace, self.name = kind, namespace, name


class ComponentError(ElasticControlError):
    """A running component (pserver, trainer, cube, serving) failed."""
