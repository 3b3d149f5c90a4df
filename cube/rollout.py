"""One versioned rollout across every cube shard: publish, prepare all, then activate all.

Two-phase: no shard switches until EVERY shard has downloaded, verified and
loaded the new version (prepare). A shard that fails or times out during
prepare aborts the rollout before any switch, so the old version stays
active everywhere. If activation itself fails part-way (a shard died after
preparing), the shards are switched back to the previous version, which
every server still holds; with no previous version there is nothing to mix.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ctr_foundation import names
from ctr_foundation.env_vars import CUBE_TEST_CRASH
from ctr_foundation.errors import ComponentError
from ctr_foundation.fileserver_client import FileServerClient
from ctr_foundation.pass_format import DENSE_DIR, META_FILE
from cube.control_client import ControlCallError, call_json
from cube.rollout_journal import RolloutJournal
from cube.shard_format import MANIFEST, shard_file_name

FILESERVER_PREFIX = names.CUBE_PREFIX
# Test hook: crash the transfer right after the first shard switched (tests/test_cube_transfer.py).


@dataclass
class RetryPolicy:
    attempts: int = 3
    backoff: float = 0.5  # seconds before the 2nd attempt; doubles each time
    timeout: float = 60.0  # seconds per call

    def run(self, fn, what: str):
        """Call ``fn`` up to ``attempts`` times with exponential backoff; re-raise the last error."""
        delay = self.backoff
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except ComponentError as e:
                if attempt == self.attempts:
                    raise ComponentError(f"{what}: {e} (after {attempt} attempts)") from e
                time.sleep(delay)
                delay *= 2


def publish_version(fs: FileServerClient, version_dir: Path, pass_dir: Path, retry: RetryPolicy) -> dict:
    """Upload the shard files, manifest, dense model and meta.json; return {shard name: file-server path}."""
    version = version_dir.name
    prefix = f"{FILESERVER_PREFIX}/{version}"
    uploads = [(f"{prefix}/{p.name}", p) for p in sorted(version_dir.glob("shard-*.arrow"))]
    dense = Path(pass_dir) / DENSE_DIR
    if dense.is_dir():
        uploads += [
            (f"{prefix}/{DENSE_DIR}/{p.relative_to(dense).as_posix()}", p)
            for p in sorted(dense.rglob("*"))
            if p.is_file()
        ]
    if (Path(pass_dir) / META_FILE).exists():
        uploads.append((f"{prefix}/{META_FILE}", Path(pass_dir) / META_FILE))
    uploads.append((f"{prefix}/{MANIFEST}", version_dir / MANIFEST))  # last: its presence means complete
    for remote, local in uploads:
        retry.run(lambda r=remote, p=local: fs.put_file(r, p), f"upload {remote}")
    return {Path(r).name: r for r, _ in uploads}


class ShardFleet:
    """The agents of all shards (shard order), called in parallel with retries."""

    def __init__(self, agents: list[str], token: str | None, retry: RetryPolicy):
        self.agents = [a.rstrip("/") for a in agents]
        self.token, self.retry = token, retry
        self.pool = ThreadPoolExecutor(max_workers=max(1, len(agents)), thread_name_prefix="cube-rollout")

    def _each(self, fn, shards=None, on_result=None) -> dict[int, str]:
        """Run ``fn(i)`` for every shard; {shard: error} of those that failed."""
        shards = range(len(self.agents)) if shards is None else shards
        futures = {i: self.pool.submit(fn, i) for i in shards}
        errors = {}
        for i, f in futures.items():
            try:
                f.result()
                if on_result:
                    on_result(i)
            except ComponentError as e:
                errors[i] = str(e)
        return errors

    def prepare(self, version: str, manifest: dict, fs: FileServerClient) -> dict[int, str]:
        def one(i):
            name = shard_file_name(i)
            entry = manifest["files"][name]
            body = {
                "version": version,
                "url": fs.url(f"{FILESERVER_PREFIX}/{version}/{name}"),
                "sha256": entry["sha256"],
                "size": entry["size"],
            }
            self.retry.run(
                lambda: call_json(
                    "POST", f"{self.agents[i]}/v1/prepare", body, token=self.token, timeout=self.retry.timeout
                ),
                f"prepare shard {i}",
            )

        return self._each(one)

    def activate(self, version: str, shards=None) -> dict[int, str]:
        crash = CUBE_TEST_CRASH.get() == "after-first-activate"

        def one(i):
            self.retry.run(
                lambda: call_json(
                    "POST",
                    f"{self.agents[i]}/v1/activate",
                    {"version": version},
                    token=self.token,
                    timeout=self.retry.timeout,
                ),
                f"activate shard {i}",
            )

        def crash_now(_i):
            if crash:
                os._exit(86)

        return self._each(one, shards, on_result=crash_now)

    def statuses(self) -> list[dict]:
        out = []
        for a in self.agents:
            try:
                out.append(call_json("GET", f"{a}/v1/status", timeout=5))
            except ControlCallError as e:
                out.append({"error": str(e)})
        return out


def roll_out(
    *,
    version: str,
    manifest: dict,
    journal: RolloutJournal,
    fleet: ShardFleet,
    fs: FileServerClient,
    resume: bool = False,
) -> tuple[bool, dict]:
    """Prepare every shard, then activate every shard; (succeeded, timings and errors)."""
    info: dict = {}
    if not resume:
        journal.begin(version, "preparing")
    t0 = time.time()
    errors = fleet.prepare(version, manifest, fs)
    info["prepare_s"] = round(time.time() - t0, 3)
    if errors:
        info["error"] = "prepare failed, old version kept everywhere: " + "; ".join(
            f"shard {i}: {e}" for i, e in sorted(errors.items())
        )
        return False, info
    journal.set_phase("activating")
    t1 = time.time()
    errors = fleet.activate(version)
    info["activate_s"] = round(time.time() - t1, 3)
    if not errors:
        return True, info
    previous = journal.data["in_flight"].get("previous")
    info["error"] = "activate failed: " + "; ".join(f"shard {i}: {e}" for i, e in sorted(errors.items()))
    if previous:
        back = fleet.activate(previous)
        info["rolled_back_to"] = previous
        if back:
            info["rollback_errors"] = {str(i): e for i, e in back.items()}
    return False, info
