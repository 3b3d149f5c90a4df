"""-l for the local backend: print (or follow) component logs, each line prefixed with its component.

Paddle's internal glog lines (``I1201 ... brpc_ps_client.cc:...]``) are left
out unless ``raw``; the log files under STATE/logs/ keep every line.

``since`` keeps the lines written after a moment. Lines that carry a time (the
components' logging, the supervisor's notes, glog) are judged by it; a line
without one (a trainer's print, a traceback) was written no later than the
next line that has one, or than the file's last change, and is kept unless
that bound is older than ``since``: a recent line is never left out.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from ctr_foundation.errors import UsageError
from ctr_foundation.names import StateFolder
from elastic_control.local import runtime as rt
from elastic_control.local.components import FILESERVER, TRANSFER, trainer_name
from elastic_control.local.spec import load_local_plan
from elastic_control.training.log_filter import is_paddle_noise

DEFAULT_COMPONENTS = (trainer_name(0), FILESERVER, TRANSFER)
TAIL = 40
TAIL_SCAN_BYTES = 4 * 1024 * 1024  # how far back the tail looks for lines that are not Paddle noise
SINCE_SCAN_BYTES = 256 * 1024 * 1024  # how far back --since looks
_BLOCK = 64 * 1024

# "2024-05-01 12:00:00,123 ...", "[supervisor 2024-05-01 12:00:00] ...", "2024-05-01T12:00:00 ..."
_DATE_TIME = re.compile(r"^\[?(?:supervisor )?(\d{4}-\d{2}-\d{2})[ T](\d{2}:\d{2}:\d{2})")
# glog: "I0501 12:00:00.123456 ..." (no year)
_GLOG = re.compile(r"^[IWEF](\d{2})(\d{2}) (\d{2}:\d{2}:\d{2})")


def line_time(line: str, *, now: float | None = None) -> float | None:
    """The epoch time a log line says it was written (local time), or None if it says none."""
    m = _DATE_TIME.match(line)
    try:
        if m:
            return dt.datetime.strptime(f"{m[1]} {m[2]}", "%Y-%m-%d %H:%M:%S").timestamp()
        m = _GLOG.match(line)
        if m:
            now = time.time() if now is None else now
            year = dt.datetime.fromtimestamp(now).year
            when = dt.datetime.strptime(f"{year}-{m[1]}-{m[2]} {m[3]}", "%Y-%m-%d %H:%M:%S")
            if when.timestamp() > now + 86400:  # December's line read in January
                when = when.replace(year=year - 1)
            return when.timestamp()
    except ValueError:
        return None
    return None


def lines_backward(path: Path, *, max_bytes: int) -> Iterator[str]:
    """The lines of ``path`` from its last one back, reading at most ``max_bytes`` (a line cut there is left
    out); nothing if it does not exist."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below; a generator holds it between lines
    except FileNotFoundError:
        return
    with f:
        end = pos = f.seek(0, os.SEEK_END)
        carry, first = b"", True
        while pos > 0 and end - pos < max_bytes:
            step = min(_BLOCK, pos, max_bytes - (end - pos))
            pos -= step
            f.seek(pos)
            parts = (f.read(step) + carry).split(b"\n")
            if first and parts[-1] == b"":
                parts.pop()  # the file's final newline
            first = False
            carry = parts[0]
            for part in reversed(parts[1:]):
                yield part.decode("utf-8", "replace")
        if pos == 0 and (carry or not first):
            yield carry.decode("utf-8", "replace")


def recent_lines(
    path: Path, *, count: int | None = None, since: float | None = None, raw: bool = False
) -> tuple[list[str], int]:
    """The last ``count`` lines of ``path`` (all with None) written at or after the epoch time ``since``,
    without Paddle noise unless ``raw``; and how many noise lines were left out among them."""
    if count == 0:
        return [], 0
    try:
        bound = path.stat().st_mtime  # no line was written after the file's last change
    except FileNotFoundError:
        return [], 0
    kept, hidden = [], 0
    budget = SINCE_SCAN_BYTES if since is not None else TAIL_SCAN_BYTES
    for line in lines_backward(path, max_bytes=budget):
        if since is not None:
            bound = line_time(line) or bound
            if bound < since:
                break
        if not raw and is_paddle_noise(line):
            hidden += 1
            continue
        kept.append(line)
        if count is not None and len(kept) == count:
            break
    return kept[::-1], hidden


def tail_without_noise(path: Path, count: int, *, raw: bool = False) -> tuple[list[str], int]:
    """The last ``count`` lines of ``path`` that are not Paddle noise, and how many noise lines were among them."""
    return recent_lines(path, count=count, raw=raw)


def known_components(layout: StateFolder) -> list[str]:
    """The names -l takes: every planned component, and the supervisor."""
    plan = load_local_plan(layout.components_file)
    return [c.name for c in plan.components] + ["supervisor"]


def resolve_components(layout: StateFolder, components: list[str] | None) -> list[str]:
    known = known_components(layout)
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
    tail: int | None = TAIL,
    since: float | None = None,
    out=None,
    poll: float = 0.3,
    stop_when=None,
    raw: bool = False,
) -> None:
    """Print the last ``tail`` lines of each component's log (every line with None) written at or after
    the epoch time ``since``; with ``follow``, keep streaming new lines.

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
        lines, hidden = recent_lines(path, count=tail, since=since, raw=raw)
        if not lines and not follow and not hidden and tail != 0:
            why = f"nothing since {_clock(since)}" if since is not None and path.exists() else "no output yet"
            out.write(f"{name:<{width}} | ({why}: {path})\n")
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


def _clock(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch).strftime("%Y-%m-%d %H:%M:%S")


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
