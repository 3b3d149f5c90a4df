"""Map a request path onto the file server's root, refusing every way out of it.

Refused: ``..`` and ``.`` components (also percent-encoded), empty components
(``//etc/passwd`` is an absolute path in disguise), backslashes, NUL bytes,
percent-encoded slashes, names longer than a file system takes, and anything
whose real path (symlinks resolved) lies outside the root.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote

# Staged uploads live here (same filesystem as the root, so the final rename
# is atomic); the folder is invisible and unreachable through the API.
STAGING_DIR = ".fileserver-staging"

_ENCODED_SEPARATOR = re.compile(r"%(2f|5c|00)", re.IGNORECASE)
MAX_NAME_BYTES = 255  # what file systems take (NAME_MAX)
MAX_PATH_BYTES = 1024


class UnsafePath(ValueError):
    """The request path would leave the root, or is not a valid relative path."""


def split_request_path(raw: str) -> tuple[list[str], bool]:
    """Decode the part after ``/files/`` into safe components and whether it names a folder.

    ``raw`` is still percent-encoded (as in the request line, query removed).
    """
    if _ENCODED_SEPARATOR.search(raw):
        raise UnsafePath("percent-encoded '/', '\\' or NUL in the path")
    try:
        decoded = unquote(raw, errors="strict")
    except UnicodeDecodeError:
        raise UnsafePath("the path is not valid UTF-8") from None
    if "\\" in decoded or "\x00" in decoded:
        raise UnsafePath("backslash or NUL in the path")
    is_dir = decoded == "" or decoded.endswith("/")
    body = decoded[:-1] if decoded.endswith("/") else decoded
    if body == "":
        return [], True
    parts = body.split("/")
    for part in parts:
        if part in ("", ".", ".."):
            raise UnsafePath(f"path component {part!r} is not allowed (no absolute paths, '.' or '..')")
        if len(part.encode()) > MAX_NAME_BYTES:
            raise UnsafePath(f"a path component is longer than {MAX_NAME_BYTES} bytes")
    if len(body.encode()) > MAX_PATH_BYTES:
        raise UnsafePath(f"the path is longer than {MAX_PATH_BYTES} bytes")
    if parts[0] == STAGING_DIR:
        raise UnsafePath(f"{STAGING_DIR} is reserved")
    return parts, is_dir


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root + os.sep)


def resolve_under_root(root: Path, parts: list[str]) -> Path:
    """The filesystem path for ``parts``; raise UnsafePath if its real location escapes ``root``.

    The target itself may not exist yet (uploads): then its deepest existing
    ancestor is checked, which covers symlinked folders on the way.
    """
    real_root = os.path.realpath(root)
    target = Path(real_root, *parts)
    probe = target
    while not os.path.lexists(probe) and probe != Path(real_root):
        probe = probe.parent
    if not _inside(os.path.realpath(probe), real_root):
        raise UnsafePath("the path resolves outside the served root (symlink)")
    return target
