"""One versioned rollout across every cube shard: publish, prepare all, then activate all.

Two-phase: no shard switches until EVERY shard has downloaded, verified and
loaded the new version (prepare). A shard that fails or times out during
prepare aborts the rollout before any switch, so the old version stays
active everywhere. If activation itself fails part-way (a shard died after
preparing), the shards are switched back to the previous version, which
every server still holds; with no previous version there is nothing to mix.

Every prepare names the version's *chain* (``chain_doc``): its latest full
representation (a base version, or a delta version's ``compacted/`` copy) and
the deltas after it. Each agent downloads only what its shard lacks: a shard
that holds the parent gets the delta alone, a new or restarted one the base and
every delta since. The same document is published as ``cube/VERSION/chain.json``,
where a restarting agent finds it.
"""

from __future__ import annotations

import json
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
from cube.shard_format import MANIFEST, deleted_file_name, manifest_kind, read_manifest, shard_file_name
from cube.version_store import COMPACTED, MAX_CHAIN

CHAIN_FILE = "chain.json"
UPLOAD_THREADS = 4

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


def publish_version(fs: FileServerClient, version_dir: Path, pass_dir: Path | None, retry: RetryPolicy) -> dict:
    """Upload the shard files (and deleted keys), dense model, meta.json and manifest; {name: path}."""
    version = version_dir.name
    prefix = f"{FILESERVER_PREFIX}/{version}"
    shard_files = sorted(version_dir.glob("shard-*.arrow")) + sorted(version_dir.glob("deleted-*.arrow"))
    uploads = [(f"{prefix}/{p.name}", p) for p in shard_files]
    dense = Path(pass_dir) / DENSE_DIR if pass_dir else None
    if dense is not None and dense.is_dir():
        uploads += [
            (f"{prefix}/{DENSE_DIR}/{p.relative_to(dense).as_posix()}", p)
            for p in sorted(dense.rglob("*"))
            if p.is_file()
        ]
    if pass_dir and (Path(pass_dir) / META_FILE).exists():
        uploads.append((f"{prefix}/{META_FILE}", Path(pass_dir) / META_FILE))
    _upload_all(fs, uploads, retry)
    manifest = f"{prefix}/{MANIFEST}"  # last: its presence means the version is complete
    retry.run(lambda: fs.put_file(manifest, version_dir / MANIFEST), f"upload {manifest}")
    return {Path(r).name: r for r, _ in [*uploads, (manifest, None)]}


def _upload_all(fs: FileServerClient, uploads: list[tuple[str, Path]], retry: RetryPolicy) -> None:
    """Upload files a few at a time (each a round trip to the file server); raise the first failure."""
    with ThreadPoolExecutor(max_workers=UPLOAD_THREADS, thread_name_prefix="cube-publish") as pool:
        futures = [pool.submit(retry.run, lambda r=r, p=p: fs.put_file(r, p), f"upload {r}") for r, p in uploads]
        for f in futures:
            f.result()


def publish_compacted(fs: FileServerClient, version_dir: Path, retry: RetryPolicy) -> None:
    """Upload ``VERSION/compacted/`` (shards first, its manifest last)."""
    local = version_dir / COMPACTED
    prefix = f"{FILESERVER_PREFIX}/{version_dir.name}/{COMPACTED}"
    _upload_all(fs, [(f"{prefix}/{p.name}", p) for p in sorted(local.glob("shard-*.arrow"))], retry)
    retry.run(lambda: fs.put_file(f"{prefix}/{MANIFEST}", local / MANIFEST), f"upload {prefix}/{MANIFEST}")


def chain_doc(cube_root: Path, version: str) -> dict:
    """``{"version", "shards", "chain": [...]}``: the version's latest full representation and the deltas
    after it, oldest first, each ``{"version", "kind", "parent", "path", "files"}`` (all shards' files)."""
    items: list[dict] = []
    cur = version
    while True:
        if len(items) > MAX_CHAIN:
            raise ComponentError(f"the parent chain of {version} does not end (a loop in the manifests?)")
        compacted = cube_root / cur / COMPACTED
        if (compacted / MANIFEST).exists():
            items.append(_item(cur, read_manifest(compacted), f"{FILESERVER_PREFIX}/{cur}/{COMPACTED}/"))
            break
        m = read_manifest(cube_root / cur)
        items.append(_item(cur, m, f"{FILESERVER_PREFIX}/{cur}/"))
        if manifest_kind(m) == "base":
            break
        cur = m["parent"]
    items.reverse()
    return {"version": version, "shards": read_manifest(cube_root / version)["shards"], "chain": items}


def _item(version: str, manifest: dict, path: str) -> dict:
    kind = manifest_kind(manifest)
    return {
        "version": version,
        "kind": kind,
        "parent": manifest.get("parent") if kind == "delta" else None,
        "path": path,
        "files": {
            name: {k: e[k] for k in ("sha256", "size", "rows") if k in e} for name, e in manifest["files"].items()
        },
    }


def chain_versions(doc: dict) -> list[str]:
    return [item["version"] for item in doc["chain"]]


def publish_chain(fs: FileServerClient, doc: dict, retry: RetryPolicy) -> None:
    path = f"{FILESERVER_PREFIX}/{doc['version']}/{CHAIN_FILE}"
    data = (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()
    retry.run(lambda: fs.put_bytes(path, data), f"upload {path}")


def shard_chain(doc: dict, shard: int) -> list[dict]:
    """The chain as one shard's prepare carries it: only that shard's files."""
    mine = {shard_file_name(shard), deleted_file_name(shard)}
    return [{**item, "files": {n: f for n, f in item["files"].items() if n in mine}} for item in doc["chain"]]


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

    def prepare(self, doc: dict, *, pin: bool = False) -> tuple[dict[int, str], dict[int, dict]]:
        """Prepare ``doc["version"]`` on every shard: ({shard: error}, {shard: agent's answer})."""
        results: dict[int, dict] = {}

        def one(i):
            body = {"version": doc["version"], "pin": pin, "chain": shard_chain(doc, i)}
            results[i] = self.retry.run(
                lambda: call_json(
                    "POST", f"{self.agents[i]}/v1/prepare", body, token=self.token, timeout=self.retry.timeout
                ),
                f"prepare shard {i}",
            )

        return self._each(one), results

    def unpin(self, version: str) -> dict[int, str]:
        def one(i):
            self.retry.run(
                lambda: call_json(
                    "POST",
                    f"{self.agents[i]}/v1/unpin",
                    {"version": version},
                    token=self.token,
                    timeout=self.retry.timeout,
                ),
                f"unpin {version} on shard {i}",
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
    doc: dict,
    journal: RolloutJournal,
    fleet: ShardFleet,
    resume: bool = False,
) -> tuple[bool, dict]:
    """Prepare every shard, then activate every shard; (succeeded, timings and errors)."""
    version = doc["version"]
    info: dict = {}
    if not resume:
        journal.begin(version, "preparing")
    t0 = time.time()
    errors, results = fleet.prepare(doc)
    info["prepare_s"] = round(time.time() - t0, 3)
    info["shipped_bytes"] = sum(r.get("downloaded_bytes", 0) for r in results.values())
    info["shipped"] = {str(i): r.get("downloaded", []) for i, r in sorted(results.items())}
    info["shard_timings"] = {str(i): r.get("timings", {}) for i, r in sorted(results.items())}
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
