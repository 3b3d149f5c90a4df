"""Freshness of every rollout: seconds from a pass's donefile line to serving answering with it.

The supervisor runs a RolloutWatcher about once a second: it asks serving
which model version it answers with and, the first time a version appears,
records it beside the time trainer 0 wrote that pass's donefile line, in
local/rollouts.json (read by ``status`` and the demo).
"""

from __future__ import annotations

import json
import time

import requests

from ctr_foundation.atomic import atomic_write_json
from ctr_foundation.names import StateFolder
from ctr_foundation.records import read_donefile


def served_version(serving_url: str, timeout: float = 1.0) -> str | None:
    """The model version serving answers with now, or None if it serves nothing (yet) or is down."""
    try:
        resp = requests.get(serving_url.rstrip("/") + "/v1/status", timeout=timeout)
    except requests.RequestException:
        return None
    if not resp.ok:
        return None
    try:
        body = resp.json()
    except ValueError:
        return None
    return version_from_status(body)


def version_from_status(body: dict) -> str | None:
    """Find the served model version in serving's /v1/status answer."""
    if not isinstance(body, dict):
        return None
    for key in ("model_version", "version"):
        if isinstance(body.get(key), str) and body[key]:
            return body[key]
    for nested in ("active", "model", "serving"):
        inner = body.get(nested)
        if isinstance(inner, dict):
            found = version_from_status(inner)
            if found:
                return found
    return None


def transfer_timings(transfer_url: str, version: str, timeout: float = 1.0) -> dict:
    """cube-transfer's timings of one rollout (build, publish, prepare, activate), or {} if unknown."""
    try:
        body = requests.get(transfer_url.rstrip("/") + "/v1/status", timeout=timeout).json()
    except (requests.RequestException, ValueError):
        return {}
    for entry in reversed(body.get("history") or []):
        if entry.get("version") == version and entry.get("result") == "active":
            out = {
                k: entry[k]
                for k in ("build_s", "publish_s", "prepare_s", "activate_s", "total_s", "shipped_bytes")
                if isinstance(entry.get(k), (int, float))
            }
            if isinstance(entry.get("at"), (int, float)):
                out["activated_at"] = entry["at"]
            return out
    return {}


def read_rollouts(layout: StateFolder) -> list[dict]:
    try:
        return json.loads(layout.rollouts_file.read_text()).get("rollouts", [])
    except (FileNotFoundError, json.JSONDecodeError):
        return []


class RolloutWatcher:
    def __init__(
        self, layout: StateFolder, *, model_path: str | None, serving_url: str | None, transfer_url: str | None = None
    ):
        self.layout = layout
        self.model_path = model_path
        self.serving_url = serving_url
        self.transfer_url = transfer_url
        self.rollouts = read_rollouts(layout)
        self.seen = {r["version"] for r in self.rollouts}
        self.current: str | None = self.rollouts[-1]["version"] if self.rollouts else None

    def tick(self) -> None:
        if not self.serving_url:
            return
        version = served_version(self.serving_url)
        if not version or version == self.current:
            return
        now = time.time()
        self.current = version
        record = {"version": version, "served_at": now, "donefile_time": None, "freshness_s": None}
        if self.model_path:
            for entry in read_donefile(self.model_path):
                if entry.pass_name == version:
                    t = entry.epoch
                    record["kind"] = entry.kind  # base | delta: deltas are measured the same way
                    record["donefile_time"] = t
                    record["freshness_s"] = None if t is None else round(now - t, 2)
        record.update(transfer_timings(self.transfer_url, version) if self.transfer_url else {})
        if version in self.seen:
            record["again"] = True  # e.g. serving restarted on the same version; freshness is the first one
            record["freshness_s"] = None
        self.seen.add(version)
        self.rollouts.append(record)
        atomic_write_json(self.layout.rollouts_file, {"rollouts": self.rollouts})
