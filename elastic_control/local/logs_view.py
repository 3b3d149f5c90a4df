"""-l for the local backend: print (or follow) component logs, each line prefixed with its component."""

from __future__ import annotations

import sys
import time

from ctr_foundation.errors import UsageError
from ctr_foundation.names import StateFolder
from elastic_control.local import runtime as rt
from elastic_control.local.components import FILESERVER, TRANSFER, trainer_name
from elastic_control.local.daemon import tail_lines
from elastic_control.local.spec import load_local_plan

DEFAULT_COMPONENTS = (trainer_name(0), FILESERVER, TRANSFER)
TAIL = 40


def resolve_components(layout: StateFolder, components: list[str] | None) -> list[str]:
    plan = load_local_plan(layout.components_file)
    known = [c.name for c in plan.components] + ["supervisor"]
    wanted = list(components or DEFAULT_COMPONENTS)
    unknown = [c for c in wanted if c not in known]
    if unknown:
        raise UsageError(f"unknown component(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return wanted


def show_logs(
    layout: StateFolder,
    *,
    follow: bool = False,
    components: list[str] | None = None,
    tail: int = TAIL,
    out=None,
    poll: float = 0.3,
    stop_when=None,
) -> None:
    """Print the last ``tail`` lines of each component's log; with ``follow``, keep streaming new lines.

    Following ends on Ctrl-C, when the supervisor has stopped, or when ``stop_when()`` is true.
    """
    out = out or sys.stdout
    names = resolve_components(layout, components)
    if rt.read_runtime(layout) is None:
        raise UsageError(
            f"nothing has been started in {layout.state}/ yet, so there are no logs: run `elastic-control -a` first"
        )
    width = max(len(n) for n in names)
    offsets = {}
    for name in names:
        path = layout.log_path(name)
        lines = tail_lines(path, tail)
        if not lines and not follow:
            out.write(f"{name:<{width}} | (no output yet: {path})\n")
        for line in lines:
            out.write(f"{name:<{width}} | {line}\n")
        offsets[name] = path.stat().st_size if path.exists() else 0
    out.flush()
    if not follow:
        return
    partial = {n: b"" for n in names}
    try:
        while True:
            for name in names:
                path = layout.log_path(name)
                try:
                    size = path.stat().st_size
                except FileNotFoundError:
                    continue
                if size < offsets[name]:  # rotated by a new -a
                    offsets[name], partial[name] = 0, b""
                if size == offsets[name]:
                    continue
                with open(path, "rb") as f:
                    f.seek(offsets[name])
                    data = partial[name] + f.read()
                    offsets[name] = f.tell()
                *complete, partial[name] = data.split(b"\n")
                for line in complete:
                    out.write(f"{name:<{width}} | {line.decode('utf-8', 'replace')}\n")
            out.flush()
            if stop_when is not None and stop_when():
                return
            if not rt.supervisor_info(layout).alive:
                out.write(f"{'':<{width}} | (the pipeline is not running; stopped following)\n")
                out.flush()
                return
            time.sleep(poll)
    except KeyboardInterrupt:
        return
