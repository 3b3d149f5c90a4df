"""Exit codes of ``elastic-control status``: one per pipeline health, beside the project's error codes.

1 and 2 stay what they are for every command (ctr_foundation/errors.py): an
error, and a usage error (a bad flag, no plan yet). The health codes come
after them so a script can tell "status could not be read" from "the
pipeline is not healthy".
"""

from __future__ import annotations

from ctr_foundation.errors import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from elastic_control.backends import status as st

EXIT_HEALTHY = EXIT_OK  # 0: every component running (or its work completed)
EXIT_ERROR = EXIT_FAILURE  # 1: the status could not be read (e.g. the cluster does not answer)
EXIT_USAGE_ERROR = EXIT_USAGE  # 2: a bad flag, or nothing configured (no plan: run -r first)
EXIT_DEGRADED = 3  # running, but a component is degraded, hung, missing or restarting
EXIT_FAILED = 4  # the pipeline, its training job or a component failed
EXIT_NOT_RUNNING = 5  # nothing runs: never started, stopped, deleted, or its supervisor is gone
EXIT_STARTING = 6  # running, nothing wrong, but not every component is ready yet (e.g. no model yet)

HEALTH_EXIT_CODES = {
    st.HEALTH_HEALTHY: EXIT_HEALTHY,
    st.HEALTH_DEGRADED: EXIT_DEGRADED,
    st.HEALTH_FAILED: EXIT_FAILED,
    st.HEALTH_NOT_RUNNING: EXIT_NOT_RUNNING,
    st.HEALTH_STARTING: EXIT_STARTING,
}

STATUS_EXIT_HELP = (
    f"Exit codes: {EXIT_HEALTHY} healthy, {EXIT_ERROR} error (status unreadable), "
    f"{EXIT_USAGE_ERROR} usage error (or no plan: run -r first), {EXIT_DEGRADED} degraded, {EXIT_FAILED} failed, "
    f"{EXIT_NOT_RUNNING} not running, {EXIT_STARTING} starting (not every component ready yet)."
)


def health_exit_code(health: str) -> int:
    """The exit code of one of ``backends.status.HEALTH_WORDS``."""
    return HEALTH_EXIT_CODES[health]
