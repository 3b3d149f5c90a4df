"""The image, emulated from the Dockerfile: its ENV, USER, WORKDIR, CMD and the user it creates.

The harness has no image: the containers run this checkout's `.venv` (where the
Dockerfile's `pip install` puts the same console scripts). What the Dockerfile
says about the environment is read from the Dockerfile itself, so a change there
(a variable, the uid) is what the harness runs with.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class Image:
    env: dict[str, str]
    uid: int | None
    user_name: str | None
    home: str | None
    workdir: str
    cmd: list[str]
    entrypoint: list[str] = field(default_factory=list)

    def passwd_line(self) -> str | None:
        if self.uid is None or not self.user_name:
            return None
        return f"{self.user_name}:x:{self.uid}:{self.uid}::{self.home}:/bin/sh"

    def group_line(self) -> str | None:
        if self.uid is None or not self.user_name:
            return None
        return f"{self.user_name}:x:{self.uid}:"


def _instructions(text: str) -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def _exec_form(rest: str) -> list[str]:
    return json.loads(rest) if rest.startswith("[") else ["/bin/sh", "-c", rest]


def load_image(dockerfile: Path = DOCKERFILE) -> Image:
    env: dict[str, str] = {}
    uid = user_name = home = None
    workdir, cmd, entrypoint = "/", [], []
    for word, rest in _instructions(dockerfile.read_text()):
        if word == "ENV":
            parts = shlex.split(rest)
            if parts and "=" not in parts[0]:
                env[parts[0]] = " ".join(parts[1:])
            else:
                env.update(part.split("=", 1) for part in parts)
        elif word == "USER":
            uid = int(rest.split(":")[0]) if rest.split(":")[0].isdigit() else uid
        elif word == "WORKDIR":
            workdir = rest
        elif word == "CMD":
            cmd = _exec_form(rest)
        elif word == "ENTRYPOINT":
            entrypoint = _exec_form(rest)
        elif word == "RUN":
            m = re.search(r"useradd\s+(?:--\S+\s+)*--uid\s+(\d+)\s+(\S+)", rest)
            if m:
                user_name = m.group(2)
                home = f"/home/{user_name}" if "--create-home" in rest or "-m " in rest else "/"
    return Image(env=env, uid=uid, user_name=user_name, home=home, workdir=workdir, cmd=cmd, entrypoint=entrypoint)


def venv_bin() -> str:
    """Where this checkout's console scripts are (the image puts the same ones on its PATH)."""
    return str(Path(sys.executable).parent)


def image_paths() -> list[str]:
    """Host folders that stand for the image's installed software: this checkout (editable install), its
    venv and the interpreter. A volume mounted over a folder that holds one of them (an emptyDir at /tmp
    while the checkout lives under /tmp) must not hide them: container_entry.py re-exposes them."""
    return sorted({str(REPO), os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix)})


def interpreter_exposure() -> list[dict]:
    """Bind the Python install into a container whose user could not reach it on this host.

    In the image, Python lives in /usr/local, readable by everyone; here the
    venv's interpreter may live under /root (mode 0700). The container then
    sees only that install prefix below an empty /root (as the image has it).
    """
    prefix = os.path.realpath(sys.base_prefix)
    path = "/"
    for part in Path(prefix).parts[1:]:
        path = os.path.join(path, part)
        if not os.stat(path).st_mode & 0o001:
            return [{"hide": path, "keep": prefix}]
    return []
