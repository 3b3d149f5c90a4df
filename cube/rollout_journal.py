"""cube-transfer's durable record: what is active, what is rolling out, what each pass became.

Written atomically (temp file + fsync + rename) before and after every step
that changes what shards serve, so a transfer restarted at any point knows
whether a rollout was in flight and in which phase:

    {"active": {version, pass, activated_at, ...} | null,
     "in_flight": {"version", "previous", "phase": "preparing"|"activating", "started_at"} | null,
     "passes": {VERSION: {"status": "active"|"retired"|"failed"|"rejected"|"superseded", ...}},
     "history": [ {version, result, timings...}, ... ]   (newest last, bounded)}
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from ctr_foundation.atomic import atomic_write_json
from ctr_foundation.errors import DataError

HISTORY_LIMIT = 200
FINAL = {"active", "retired", "rejected", "superseded"}


class RolloutJournal:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._lock = threading.RLock()
        self.data = {"active": None, "in_flight": None, "passes": {}, "history": []}
        if self.path.exists():
            try:
                self.data.update(json.loads(self.path.read_text(encoding="utf-8")))
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{self.path}: the rollout journal is not valid JSON ({e}); "
                    "fix or move it before restarting cube-transfer"
                ) from e

    def save(self) -> None:
        with self._lock:
            atomic_write_json(self.path, self.data)

    def snapshot(self) -> dict:
        with self._lock:
            return json.loads(json.dumps(self.data))

    @property
    def active_version(self) -> str | None:
        a = self.data["active"]
        return a["version"] if a else None

    def pass_status(self, version: str) -> str | None:
        return self.data["passes"].get(version, {}).get("status")

    def set_pass(self, version: str, **fields) -> None:
        with self._lock:
            entry = self.data["passes"].setdefault(version, {})
            entry.update(fields, updated_at=time.time())
            self.save()

    def set_field(self, key: str, value) -> None:
        with self._lock:
            self.data[key] = value
            self.save()

    def begin(self, version: str, phase: str) -> None:
        with self._lock:
            self.data["in_flight"] = {
                "version": version,
                "previous": self.active_version,
                "phase": phase,
                "started_at": time.time(),
            }
            self.save()

    def set_phase(self, phase: str) -> None:
        with self._lock:
            self.data["in_flight"]["phase"] = phase
            self.save()

    def finish(self, record: dict, *, active: dict | None = None) -> None:
        """Close the in-flight rollout; ``active`` replaces the active record when it succeeded."""
        with self._lock:
            if active is not None:
                old = self.data["active"]
                if old and old["version"] != active["version"]:
                    self.data["passes"].setdefault(old["version"], {})["status"] = "retired"
                self.data["active"] = active
            self.data["in_flight"] = None
            self.data["history"] = (self.data["history"] + [record])[-HISTORY_LIMIT:]
            self.save()
