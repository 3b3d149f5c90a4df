"""Where a (re)started job continues: after the last pass named in MODEL_PATH/donefile."""

from __future__ import annotations

import shutil
from pathlib import Path

from ctr_foundation.pass_format import PASS_PREFIX, PassInfo, latest_complete_pass


def resume_point(model_path: str) -> dict:
    """The coordinator's hello answer: the last complete pass and the hour to continue after."""
    last: PassInfo | None = latest_complete_pass(model_path)
    if last is None:
        return {"resume_after": None, "last_pass": None}
    return {"resume_after": last.meta["window"]["end"], "last_pass": last.name, "last_pass_dir": str(last.path)}


def remove_stale_staging(model_path: str) -> list[str]:
    """Delete staging folders a crashed export left behind (``.pass-*.tmp``); they never count as passes."""
    removed = []
    root = Path(model_path)
    if not root.is_dir():
        return removed
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith("." + PASS_PREFIX) and p.name.endswith((".tmp", ".old")):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
    return removed
