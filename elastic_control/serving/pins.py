"""Pins: the cube versions serving's A/B challengers use, so that nothing removes them meanwhile.

The contract with cube (docs/contracts.md, "Pinned versions"): ``cube/pins.json`` on the file server
(``CUBE_ROOT/pins.json`` for a local cube root) is ``{"versions": [VERSION, ...]}``: cube-transfer
loads every listed version on every shard as pinned, and its garbage collection keeps them (other
keys are ignored by cube). Serving adds ``"pins": [{"version", "owner": "serving", "reason",
"since"}]`` and ``"updated_at"`` to say who pinned what: it owns the versions of its own entries,
writes them before a challenger arm takes traffic (then waits until every shard answers for them)
and removes them when the split ends; every other listed version is kept as it is.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

from ctr_foundation.atomic import atomic_write_json
from ctr_foundation.errors import ComponentError
from ctr_foundation.fileserver_client import NotFound
from ctr_foundation.names import CUBE_PREFIX
from ctr_foundation.records import format_time, utc_now

PINS_FILE = "pins.json"
REMOTE_PINS = f"{CUBE_PREFIX}/{PINS_FILE}"
OWNER = "serving"
log = logging.getLogger("elastic_control.serving")


class PinStore:
    """Reads and writes the pins document in a local cube root or on the file server."""

    def __init__(self, read, write, where: str):
        self._read, self._write, self.where = read, write, where

    @classmethod
    def local(cls, cube_root: Path) -> PinStore:
        path = Path(cube_root) / PINS_FILE

        def read() -> dict | None:
            try:
                return json.loads(path.read_text(encoding="utf-8"))
            except FileNotFoundError:
                return None

        return cls(read, lambda doc: atomic_write_json(path, doc), str(path))

    @classmethod
    def remote(cls, fs) -> PinStore:
        def read() -> dict | None:
            try:
                return fs.get_json(REMOTE_PINS)
            except NotFound:
                return None

        def write(doc: dict) -> None:
            fs.put_bytes(REMOTE_PINS, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())

        return cls(read, write, f"{fs.base_url}/files/{REMOTE_PINS}" if hasattr(fs, "base_url") else REMOTE_PINS)

    def document(self) -> dict:
        doc = self._read() or {}
        return doc if isinstance(doc, dict) else {}

    def serving_versions(self) -> list[str]:
        doc = self.document()
        return sorted(p["version"] for p in doc.get("pins") or [] if isinstance(p, dict) and p.get("owner") == OWNER)

    def set_serving_pins(self, versions: Iterable[tuple[str, str]]) -> None:
        """Serving's pins become exactly ``versions`` ((version, reason) pairs); others' pins stay."""
        wanted = dict(versions)
        try:
            doc = self.document()
            entries = [p for p in doc.get("pins") or [] if isinstance(p, dict) and isinstance(p.get("version"), str)]
            mine = {p["version"]: p for p in entries if p.get("owner") == OWNER}
            others = [p for p in entries if p.get("owner") != OWNER]
            listed = [v for v in doc.get("versions") or [] if isinstance(v, str)]
            foreign = {v for v in listed if v not in mine} | {p["version"] for p in others}
            if set(mine) == set(wanted) and set(listed) == foreign | set(wanted):
                return  # unchanged: no write
            now = format_time(utc_now())
            pins = others + [
                {"version": v, "owner": OWNER, "reason": reason, "since": mine.get(v, {}).get("since", now)}
                for v, reason in sorted(wanted.items())
            ]
            self._write({"versions": sorted(foreign | set(wanted)), "pins": pins, "updated_at": now})
        except Exception as e:  # noqa: BLE001 - any failure means the same: the pin is not recorded
            raise ComponentError(f"could not write the version pins to {self.where}: {e}") from e
        log.info("pinned cube versions for serving: %s (%s)", sorted(wanted) or "none", self.where)
