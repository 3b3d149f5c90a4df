"""Write files so that readers never see half of them: temp file, fsync, rename."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", **kwargs) -> Iterator[IO]:
    """Open a temp file beside ``path``; on success fsync and rename it over ``path``.

    On any exception the temp file is removed and ``path`` is left untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode, **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_open(path, "w", encoding="utf-8") as f:
        f.write(text)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def append_line_durably(path: str | os.PathLike, line: str) -> None:
    """Append one whole line and fsync: donefiles are append-only logs."""
    if "\n" in line:
        raise ValueError("a donefile line must not contain a newline")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # One write() of a short line with O_APPEND is not interleaved with other appenders.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode("utf-8"))
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_path(new: str | os.PathLike, final: str | os.PathLike) -> None:
    """Rename ``new`` to ``final``; an existing folder ``final`` is moved aside first, then removed.

    (``os.replace`` alone cannot put a folder over a non-empty folder.)
    """
    new, final = Path(new), Path(final)
    if new.is_dir() and final.is_dir():
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(new, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(new, final)


@contextlib.contextmanager
def staged_directory(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp directory beside ``final``; rename it to ``final`` on success.

    An existing ``final`` is replaced only after the new one is complete.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        yield tmp
        replace_path(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
