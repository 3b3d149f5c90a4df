"""``python reaper.py PID PREFIX``: wait until test process PID ends, then remove the podman containers
of run PREFIX (and of any other test process that is gone) and the network namespaces of dead runs.

PodmanRuntime starts it in a session of its own when a cluster starts and kills it when the cluster
stops; it only acts when the test process died without stopping its cluster (SIGKILL, a crash), as
nothing else would stop containers that conmon keeps running.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def main() -> None:
    owner, prefix = int(sys.argv[1]), sys.argv[2]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from pod_harness.network import pid_alive, remove_stale_namespaces
    from pod_harness.podman import remove_leftovers

    while pid_alive(owner):
        time.sleep(1)
    remove_leftovers(dict(os.environ), prefix=prefix, owner=owner)
    remove_stale_namespaces()


if __name__ == "__main__":
    main()
