"""Becomes one container: run as root as PID 1 of fresh mount, UTS and PID namespaces in the pod's
network namespace (``ip netns exec NS unshare -m -u -p -f --mount-proc ...``), then exec's the
container's command as the container's user.

``python container_entry.py SPEC.json`` (start a container) or ``--exec SPEC.json`` (run a
command, e.g. a preStop hook, inside a running container entered with nsenter: only the
privilege drop). SPEC (written by the harness):

    {"hostname", "hosts_file", "resolv_file", "passwd_line", "group_line", "scratch", "expose",
     "mounts": [{"source", "target", "read_only"}], "uid", "gid", "groups", "no_new_privs",
     "drop_all_caps", "read_only_root", "reexpose": [...], "env": {...}, "argv": [...], "cwd"}

``reexpose``: host folders of the emulated image (the checkout, its venv) that a volume's mount
point covers, e.g. an emptyDir at /tmp while the checkout lives under /tmp: held open before the
volumes are mounted and bound back read-only at their paths afterwards (folders made in the
volume to mount them on), as the image's files would sit beside that volume.

With ``read_only_root`` (securityContext.readOnlyRootFilesystem), everything that stands for the
image (``/``, the overlays, the exposed interpreter) is remounted read-only in this container's
private mount namespace (bind remounts: per mount point, never the host's file system); the
volumes keep their own mode.

Mount points that do not exist on the host (``/etc/elastic-ctr``, ``/var/lib/mlflow``...) are
made inside an overlay of their nearest existing parent, private to this container, so the
host's file system is never changed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys


def mount(*args: str) -> None:
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"container_entry: mount {' '.join(args)} failed: {proc.stderr.strip()}")


def existing_ancestor(path: str) -> str:
    while not os.path.lexists(path):
        path = os.path.dirname(path.rstrip("/")) or "/"
    return path


IMAGE_MOUNTS: list[str] = []  # mount points that are part of the image (made read-only with read_only_root)


def overlay(parent: str, scratch: str) -> None:
    IMAGE_MOUNTS.append(parent)
    key = parent.strip("/").replace("/", "_")
    upper, work = f"{scratch}/overlay/{key}/upper", f"{scratch}/overlay/{key}/work"
    os.makedirs(upper, exist_ok=True)
    os.makedirs(work, exist_ok=True)
    mount("-t", "overlay", "overlay", "-o", f"lowerdir={parent},upperdir={upper},workdir={work}", parent)


def prepare_mount_points(targets: list[str], scratch: str) -> None:
    """Overlay /etc (the image's user is added to passwd) and the nearest existing parent of every
    missing mount point, then create the mount points inside the overlays."""
    overlay("/etc", scratch)
    overlaid = {"/etc"}
    for target in sorted(targets):
        if os.path.lexists(target):
            continue
        parent = existing_ancestor(os.path.dirname(target.rstrip("/")))
        if parent == "/":
            raise SystemExit(f"container_entry: cannot create {target}: its only existing parent is /")
        if not any(parent == o or parent.startswith(o + "/") for o in overlaid):
            overlay(parent, scratch)
            overlaid.add(parent)
        os.makedirs(target, exist_ok=True)


def expose(items: list[dict], scratch: str) -> None:
    """Cover ``hide`` with an empty tmpfs that holds only ``keep`` (the interpreter's install)."""
    for i, item in enumerate(items):
        stash = f"{scratch}/expose-{i}"
        os.makedirs(stash, exist_ok=True)
        mount("--bind", item["keep"], stash)
        mount("-t", "tmpfs", "-o", "mode=0755", "tmpfs", item["hide"])
        os.makedirs(item["keep"], exist_ok=True)
        mount("--move", stash, item["keep"])
        IMAGE_MOUNTS.extend([item["hide"], item["keep"]])


def _covers_a_source(target: str, mounts: list[dict]) -> bool:
    """A volume over a folder that holds other volumes' sources on this host (an emptyDir at /tmp, while the
    harness keeps pods under the test's /tmp) is mounted after them, or it would hide them."""
    prefix = target.rstrip("/") + "/"
    return any(m["source"].startswith(prefix) for m in mounts if m["target"] != target)


def become_container(spec: dict) -> None:
    expose(spec.get("expose", []), spec["scratch"])
    prepare_mount_points([m["target"] for m in spec["mounts"]], spec["scratch"])
    for path, line in (("/etc/passwd", spec.get("passwd_line")), ("/etc/group", spec.get("group_line"))):
        if line:
            with open(path, "a") as f:
                f.write(line + "\n")
    mount("--bind", spec["hosts_file"], "/etc/hosts")
    mount("--bind", spec["resolv_file"], "/etc/resolv.conf")
    held = [(path, os.open(path, os.O_RDONLY | os.O_DIRECTORY)) for path in spec.get("reexpose", [])]
    for m in sorted(spec["mounts"], key=lambda m: _covers_a_source(m["target"], spec["mounts"])):
        mount("--bind", m["source"], m["target"])
        if m.get("read_only"):
            mount("-o", "remount,bind,ro", m["target"])
    for path, fd in held:
        os.makedirs(path, exist_ok=True)
        # --no-canonicalize: mount(8) would resolve the fd's link to its path, which now names the new folder.
        mount("--no-canonicalize", "--bind", f"/proc/{os.getpid()}/fd/{fd}", path)
        mount("-o", "remount,bind,ro", path)
        os.close(fd)
    if spec.get("read_only_root"):
        # After the volumes: a bind mount of a folder on a read-only mount would be read-only too, while
        # remounting a parent later changes only the parent's own mount, not the volumes on it.
        for target in ["/", *IMAGE_MOUNTS]:
            mount("-o", "remount,bind,ro", target)
    socket.sethostname(spec["hostname"])
    drop_and_exec(spec)


def drop_and_exec(spec: dict) -> None:
    argv = ["setpriv", f"--reuid={spec['uid']}", f"--regid={spec['gid']}"]
    groups = [str(g) for g in spec.get("groups", [])]
    argv += [f"--groups={','.join(groups)}"] if groups else ["--clear-groups"]
    if spec.get("no_new_privs"):
        argv.append("--no-new-privs")
    if spec.get("drop_all_caps"):
        argv += ["--inh-caps=-all", "--bounding-set=-all"]
    os.chdir(spec.get("cwd") or "/")
    os.execvpe("setpriv", argv + ["--", *spec["argv"]], spec["env"])


if __name__ == "__main__":
    exec_only = sys.argv[1] == "--exec"
    with open(sys.argv[2] if exec_only else sys.argv[-1]) as f:
        loaded = json.load(f)
    if exec_only:
        if sys.argv[3:4] == ["--"]:  # an exec probe's command, instead of the spec's
            loaded["argv"] = sys.argv[4:]
        drop_and_exec(loaded)
    else:
        become_container(loaded)
