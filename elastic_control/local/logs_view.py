"""-l for the local backend: print (or follow) component logs, each line prefixed with its component.

Paddle's internal glog lines (``I1201 ... brpc_ps_client.cc:...]``) are left
out unless ``raw``; the log files under STATE/logs/ keep every line.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from ctr_foundation.errors import UsageError
from ctr_foundation.names import StateFolder
from elastic_control.backends.log_filter import is_paddle_noise
from elastic_control.local import runtime as rt
from elastic_control.local.components import FILESERVER, TRANSFER, trainer_name
from elastic_control.local.daemon import tail_lines
from elastic_control.local.spec import load_local_plan

DEFAULT_COMPONENTS = (trainer_name(0), FILESERVER, TRANSFER)
TAIL = 40
TAIL_SCAN_BYTES = 4 * 1024 * 1024  # how far back the tail looks for lines that are not Paddle noise


def tail_without_noise(path: Path, count: int, *, raw: bool = False) -> tuple[list[str], int]:
    """The last ``count`` lines of ``path`` that are not Paddle noise, and how many noise lines were among them."""
    if raw:
        return tail_lines(path, count), 0
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            block = min(size, TAIL_SCAN_BYTES)
            f.seek(size - block)
            data = f.read()
    except FileNotFoundError:
        return [], 0
    lines = data.decode("utf-8", "replace").splitlines()
    if block < size and lines:
        lines = lines[1:]  # the first one is cut
    kept, hidden = [], 0
    for line in reversed(lines):
        if len(kept) == count:
            break
        if is_paddle_noise(line):
            hidden += 1
        else:
            kept.append(line)
    return kept[::-1], hidden


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
    raw: bool = False,
) -> None:
    """Print the last ``tail`` lines of each component's log; with ``follow``, keep streaming new lines.

    Following ends on Ctrl-C, when the supervisor has stopped, or when ``stop_when()`` is true.
    Paddle's glog lines are skipped unless ``raw`` (a note says how many, and where the full log is).
    """
    out = out or sys.stdout
    names = resolve_components(layout, components)
    if rt.read_runtime(layout) is None:
        raise UsageError(
            f"nothing has been started in {layout.state}/ yet, so there are no logs: run `elastic-control -a` first"
        )
    width = max(len(n) for n in names)
    for name in names:
        path = layout.log_path(name)
        lines, hidden = tail_without_noise(path, tail, raw=raw) if tail else ([], 0)
        if not lines and not follow and not hidden:
            out.write(f"{name:<{width}} | (no output yet: {path})\n")
        if hidden:
            out.write(f"{name:<{width}} | ({hidden} lines of Paddle's internal logging hidden; all are in {path})\n")
        for line in lines:
            out.write(f"{name:<{width}} | {line}\n")
    out.flush()
    if not follow:
        return

    def write(name: str, text: str) -> None:
        if raw or not is_paddle_noise(text):
            out.write(f"{name:<{width}} | {text}\n")

    follower = LogFollower({name: layout.log_path(name) for name in names}, write)
    try:
        while True:
            follower.poll()
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


class LogFollower:
    """New complete lines of several log files, from their current ends on: ``on_line(name, text)`` for each.

    A file that shrank was rotated (a new -a): it is read again from its start.
    """

    def __init__(self, paths: dict[str, Path], on_line):
        self.paths = paths
        self.on_line = on_line
        self.offsets = {name: (p.stat().st_size if p.exists() else 0) for name, p in paths.items()}
        self.partial = {name: b"" for name in paths}

    def poll(self) -> None:
        for name, path in self.paths.items():
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                continue
            if size < self.offsets[name]:
                self.offsets[name], self.partial[name] = 0, b""
            if size == self.offsets[name]:
                continue
            with open(path, "rb") as f:
                f.seek(self.offsets[name])
                data = self.partial[name] + f.read()
                self.offsets[name] = f.tell()
            *complete, self.partial[name] = data.split(b"\n")
            for line in complete:
                self.on_line(name, line.decode("utf-8", "replace"))
