"""cube-transfer: turns each new complete training pass into the active cube version.

Loop: read ``MODEL_PATH/donefile``; take the newest complete pass not yet
handled; (optional) promotion gate; build the version with cube-builder
(skipped when ``CUBE_ROOT/VERSION`` already holds a verified build); publish
shards, manifest, dense model and meta.json through the file server; roll out
in two phases (cube/rollout.py); record ``cube/current.json``; GC old versions.
Older passes still waiting when a newer one is complete are skipped
("superseded"): serving wants the freshest model, not every hour replayed
(a delta pass still needs its ancestors: they are built and shipped as part
of its chain, never activated on their own).

Delta passes: the version is built on its parent's (cube/builder.py) and each
shard downloads only what it lacks (cube/rollout.py). After a delta version
with ``--compact-after`` deltas since its last full copy became active, its
chain is folded into ``VERSION/compacted/`` in the background and published;
new and restarted shards then start from it. Versions named in the file
server's ``cube/pins.json`` are loaded on every shard (pinned) and kept, with
everything their chains need, until they are unpinned.

Durability: every phase is written to the rollout journal first, so a restart
never rebuilds a finished version, and a restart in the middle of activating
finishes the switch on every shard (or switches every shard back), never
leaving shards on different versions.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import click

from ctr_foundation import env_vars, names
from ctr_foundation.atomic import atomic_write_json
from ctr_foundation.cli_runner import run_cli
from ctr_foundation.errors import ComponentError, DataError, ElasticControlError, UsageError
from ctr_foundation.fileserver_client import FileServerClient, FileServerError, NotFound
from ctr_foundation.http_json import JsonRoute, make_json_server
from ctr_foundation.http_server import serve_in_thread
from ctr_foundation.model_registry import CHAMPION, REGISTERED_MODEL, AliasSetter, is_server_uri
from ctr_foundation.pass_format import load_pass
from ctr_foundation.records import CurrentVersion, DonefileEntry, read_donefile, utc_now, write_current
from cube.builder import build_version, compact_version, reshard_version
from cube.promotion_gate import DEFAULT_GATE_COMMAND, CommandGate, Gate
from cube.rollout import (
    FILESERVER_PREFIX,
    RetryPolicy,
    ShardFleet,
    chain_doc,
    chain_versions,
    publish_chain,
    publish_compacted,
    publish_version,
    roll_out,
)
from cube.rollout_journal import FINAL, RolloutJournal
from cube.shard_format import (
    MANIFEST,
    CorruptShardError,
    complete_versions,
    manifest_kind,
    read_manifest,
    valid_version_name,
    verify_version_dir,
)
from cube.version_store import COMPACTED

DEFAULT_PORT = names.CUBE_TRANSFER_PORT
JOURNAL_FILE = "transfer-state.json"
PINS_FILE = f"{FILESERVER_PREFIX}/pins.json"
MAX_BACKOFF = 300.0
DEFAULT_COMPACT_AFTER = 8
log = logging.getLogger("cube.transfer")


@dataclass
class TransferConfig:
    model_path: Path
    cube_root: Path
    fileserver_url: str
    agents: list[str]
    token: str | None
    keep: int = 3
    gate: Gate | None = None  # injected (cube/promotion_gate.py); None: every pass is promoted
    force: bool = False
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    poll_interval: float = 5.0
    retry_backoff: float = 5.0  # first wait before retrying a failed pass; doubles up to MAX_BACKOFF
    compact_after: int = DEFAULT_COMPACT_AFTER  # deltas since the last full copy that trigger compaction; 0: never
    # The MLflow tracking server (http[s]://) whose registered version of each activated pass gets the alias
    # champion (ctr_foundation/model_registry.py); None, or a local store: no alias.
    mlflow_uri: str | None = None

    @property
    def shards(self) -> int:
        return len(self.agents)


class Transfer:
    def __init__(self, config: TransferConfig):
        if not config.agents:
            raise UsageError("no cube agents: pass --agents or set ELASTIC_CTR_CUBE_AGENTS")
        self.cfg = config
        config.cube_root.mkdir(parents=True, exist_ok=True)
        self.journal = RolloutJournal(config.cube_root / JOURNAL_FILE)
        self.fs = FileServerClient(config.fileserver_url, token=config.token, timeout=config.retry.timeout)
        self.fleet = ShardFleet(config.agents, config.token, config.retry)
        self.wake = threading.Event()
        self.stopping = False
        self.last_error: str | None = None
        self._compactor: threading.Thread | None = None
        self.compaction: dict = {}  # the last (or running) compaction
        self.pins_error: str | None = None
        self.problems: list[dict] = []  # published versions the file server no longer holds whole
        self._published: set[str] = set()  # file-server folders (cube/V/, cube/V/compacted/) known complete
        self.champion = AliasSetter(config.mlflow_uri, CHAMPION) if is_server_uri(config.mlflow_uri) else None
        self._switching = threading.Lock()  # one rollout at a time: the loop's passes and rollbacks

    # ---- the loop ---------------------------------------------------------------------

    def run_forever(self) -> None:
        while not self.stopping:
            self.poll_once()
            self.wake.wait(self.cfg.poll_interval)
            self.wake.clear()

    def poll_once(self) -> str | None:
        """Handle at most one pass; return its version (or None when there was nothing to do)."""
        with self._switching:
            return self._poll_once()

    def _poll_once(self) -> str | None:
        try:
            if self.journal.data["in_flight"]:
                return self.recover()
            resharded = self.reshard_if_needed()
            if resharded is not None:
                return resharded
            entry = self._next_pass()
            if entry is None:
                self.sync_pins()
                self.check_published()
                return None
            self.process(entry)
            self.last_error = None
            return entry.pass_name
        except ElasticControlError as e:
            self.last_error = str(e)
            log.error("%s", e)
            return None

    def wait_for_compaction(self, timeout: float | None = None) -> None:
        t = self._compactor
        if t is not None:
            t.join(timeout)

    def _next_pass(self) -> DonefileEntry | None:
        entries = read_donefile(self.cfg.model_path)
        passes = self.journal.data["passes"]
        active = self.active_pass()
        names = [e.pass_name for e in entries]
        # Never go back to a pass older than the active one.
        start = names.index(active) + 1 if active in names else 0
        waiting = [e for e in entries[start:] if passes.get(e.pass_name, {}).get("status") not in FINAL]
        if not waiting:
            return None
        newest = waiting[-1]
        for older in waiting[:-1]:
            if passes.get(older.pass_name, {}).get("status") != "superseded":
                self.journal.set_pass(older.pass_name, status="superseded", reason=f"newer pass {newest.pass_name}")
        st = passes.get(newest.pass_name, {})
        if st.get("status") == "failed" and st.get("next_retry_at", 0) > time.time():
            return None
        return newest

    def process(self, entry: DonefileEntry) -> None:
        version = entry.pass_name
        # The donefile's "path" is relative to MODEL_PATH (the pass name) unless absolute.
        path = entry.path or version
        pass_dir = Path(path) if Path(path).is_absolute() else Path(self.cfg.model_path) / path
        timings: dict = {}
        t0 = time.time()
        if self.cfg.gate is not None and not self.cfg.force:
            active = self.journal.data["active"]
            active_dir = Path(active["pass_path"]) if active and active.get("pass_path") else None
            result = self.cfg.gate(pass_dir, active_dir)
            timings["gate_s"] = round(time.time() - t0, 3)
            gate = {"passed": bool(result.passed), "reason": str(result.reason), "metrics": dict(result.metrics)}
            if not result.passed:
                self.journal.set_pass(version, status="rejected", gate=gate)
                self.journal.finish(
                    {"version": version, "result": "rejected", "reason": gate["reason"], "at": time.time()}
                )
                log.warning("pass %s rejected by the promotion gate: %s", version, gate["reason"])
                return
            self.journal.set_pass(version, status="gated", gate=gate)
        t1 = time.time()
        manifest, rebuilt = self._build(version, pass_dir)
        timings["build_s"] = round(time.time() - t1, 3)
        timings["built"] = rebuilt
        t2 = time.time()
        try:
            doc = self._publish_chain(version, pass_dir)
        except (ComponentError, FileServerError) as e:
            self._failed(version, f"publish failed: {e}", timings)
            return
        timings["publish_s"] = round(time.time() - t2, 3)
        ok, info = roll_out(doc=doc, journal=self.journal, fleet=self.fleet)
        self._conclude(version, entry, pass_dir, manifest, ok, {**timings, **info}, t0)

    def _pass_dir(self, name: str) -> Path:
        """A pass's folder: the donefile's ``path`` (relative to MODEL_PATH unless absolute), else MODEL_PATH/NAME."""
        entry = next((e for e in read_donefile(self.cfg.model_path) if e.pass_name == name), None)
        path = (entry.path if entry else "") or name
        return Path(path) if Path(path).is_absolute() else Path(self.cfg.model_path) / path

    def _build(self, version: str, pass_dir: Path, *, check_sha: bool = True) -> tuple[dict, bool]:
        """The built version (reused when it verifies), building the ancestors a delta needs first."""
        vdir = self.cfg.cube_root / version
        if (vdir / MANIFEST).exists():
            try:
                manifest = verify_version_dir(vdir, check_sha=check_sha)
                if manifest["shards"] == self.cfg.shards:
                    return manifest, False
            except (CorruptShardError, DataError) as e:
                log.warning("rebuilding %s: %s", version, e)
        info = load_pass(pass_dir)
        if info.kind == "delta":
            if not valid_version_name(info.parent):
                raise DataError(f"{pass_dir}/meta.json: parent {info.parent!r} is not a pass name")
            self._build(info.parent, self._pass_dir(info.parent), check_sha=False)
        manifest = build_version(
            pass_dir=pass_dir, shards=self.cfg.shards, output=self.cfg.cube_root, version=version, overwrite=True
        )
        return manifest, True

    def _publish_chain(self, version: str, pass_dir: Path | None) -> dict:
        """Publish every version of the chain the file server lacks, then ``cube/VERSION/chain.json``."""
        doc = chain_doc(self.cfg.cube_root, version)
        for item in doc["chain"]:
            v, folder = item["version"], item["path"]
            if folder in self._published and v != version:
                continue  # published by this process (and not collected since)
            if v == version or not self.fs.exists(f"{FILESERVER_PREFIX}/{v}/{MANIFEST}"):
                publish_version(
                    self.fs, self.cfg.cube_root / v, pass_dir if v == version else self._pass_dir(v), self.cfg.retry
                )
            if folder.endswith(f"/{COMPACTED}/") and not self.fs.exists(f"{folder}{MANIFEST}"):
                publish_compacted(self.fs, self.cfg.cube_root / v, self.cfg.retry)
            self._published.add(folder)
        publish_chain(self.fs, doc, self.cfg.retry)
        return doc

    def _failed(self, version: str, reason: str, timings: dict) -> None:
        prev = self.journal.data["passes"].get(version, {})
        attempts = prev.get("attempts", 0) + 1
        wait = min(MAX_BACKOFF, self.cfg.retry_backoff * 2 ** (attempts - 1))
        self.journal.set_pass(
            version, status="failed", reason=reason, attempts=attempts, next_retry_at=time.time() + wait
        )
        self.journal.finish({"version": version, "result": "failed", "reason": reason, "at": time.time(), **timings})
        self.last_error = reason
        log.error("rollout of %s failed (attempt %d, retry in %.0fs): %s", version, attempts, wait, reason)

    def previous_version(self) -> str | None:
        """The version active before the active one (the newest other version history saw activated)."""
        active = self.journal.active_version
        for rec in reversed(self.journal.data["history"]):
            if rec.get("result") == "active" and rec.get("version") != active:
                return rec["version"]
        return None

    def rollback(self, version: str | None = None) -> dict:
        """Make ``version`` (default: the previous active one) active again, through the same two-phase switch.

        The pass stays where training wrote it; its built version is reused when it still verifies, else
        rebuilt. Newer passes stay handled (retired): the loop does not roll them out again, only passes
        training writes from now on. Recorded in the history with ``"by": "rollback"``.
        """
        with self._switching:
            active = self.journal.active_version
            target = version or self.previous_version()
            if target is None:
                raise UsageError("nothing to roll back to: no version was active before " + str(active))
            if not valid_version_name(target):
                raise UsageError(f"{target!r} is not a version name (e.g. pass-20200101-05)")
            if target == active:
                return {"version": target, "result": "active", "unchanged": True, "by": "rollback"}
            known = {e.pass_name: e for e in read_donefile(self.cfg.model_path)}
            if target not in known:
                raise UsageError(f"version {target} is not a pass in {self.cfg.model_path}/donefile")
            entry, pass_dir = known[target], self._pass_dir(target)
            t0 = time.time()
            try:
                manifest, rebuilt = self._build(target, pass_dir, check_sha=False)
                doc = self._publish_chain(target, pass_dir)
            except (ElasticControlError, OSError) as e:
                raise ComponentError(f"rollback to {target}: {e}") from e
            ok, info = roll_out(doc=doc, journal=self.journal, fleet=self.fleet)
            info.update(by="rollback", rolled_back_from=active, built=rebuilt)
            if not ok:
                if not info.get("rollback_errors"):
                    self.journal.finish({"version": target, "result": "failed", "at": time.time(), **info})
                raise ComponentError(f"rollback to {target} failed: {info.get('error')}")
            self._conclude(target, entry, pass_dir, manifest, ok, info, t0)
            names = list(known)
            for newer in names[names.index(target) + 1 :]:  # passes waiting or retrying are not rolled out again
                if self.journal.pass_status(newer) not in FINAL:
                    self.journal.set_pass(newer, status="superseded", reason=f"rolled back to {target}")
            self.last_error = None
            return {"version": target, "result": "active", "from": active, "by": "rollback", **info}

    def _conclude(self, version, entry, pass_dir, manifest, ok, info, t0, pass_name: str | None = None) -> None:
        pass_name = pass_name or version
        if not ok:
            if info.get("rollback_errors"):
                # Shards may disagree: keep the rollout in flight, so the next poll repairs it.
                self.last_error = info["error"]
                return
            self._failed(version, info["error"], info)
            return
        now = time.time()
        info.setdefault("by", "cube-transfer")
        info["total_s"] = round(now - t0, 3)
        if entry.epoch is not None:
            info["freshness_s"] = round(now - entry.epoch, 3)
        active = {
            "version": version,
            "pass": pass_name,
            "pass_path": str(pass_dir),
            "activated_at": now,
            "donefile_time": entry.epoch,
            "shards": manifest["shards"],
            "dim": manifest["dim"],
            "rows": manifest["rows"],
            "timings": info,
        }
        active["kind"] = manifest_kind(manifest)
        self._publish_current(version, manifest, entry, pass_name)
        self.journal.set_pass(version, status="active", timings=info, activated_at=now)
        self.journal.finish({"version": version, "result": "active", "at": now, **info}, active=active)
        log.info("cube version %s active on %d shards (%s)", version, manifest["shards"], info)
        if self.champion is not None:  # serving answers with this version now: its registered version is champion
            self.champion.point_at(pass_name)
        self.gc()
        self._maybe_compact(version)

    def _publish_current(self, version: str, manifest: dict, entry: DonefileEntry, pass_name: str) -> None:
        current = CurrentVersion(
            version=version,
            pass_name=pass_name,
            shards=manifest["shards"],
            dim=manifest["dim"],
            slots=tuple(manifest.get("slots") or ()),
            sparse_dim=manifest.get("sparse_dim"),
            dense=f"{FILESERVER_PREFIX}/{version}/dense/",
            activated_at=utc_now(),
            donefile_time=entry.time,
            extra={"kind": manifest_kind(manifest), "parent": manifest.get("parent")},
        )
        write_current(self.cfg.cube_root, current)
        try:
            self.cfg.retry.run(
                lambda: self.fs.put_bytes(names.REMOTE_CURRENT, current.to_bytes()), "publish cube/current.json"
            )
        except ComponentError as e:
            self.last_error = f"{e} (the shards are switched; current.json will be re-published next time)"

    def recover(self) -> str:
        """Finish (or undo) a rollout a previous run left in flight, so every shard ends on one version."""
        flight = self.journal.data["in_flight"]
        version = flight["version"]
        if flight["phase"] == "preparing":
            # No shard switched yet: the old version is active everywhere; retry the pass normally (a reshard
            # is retried by the next poll: the active version still has the old shard count).
            self.journal.finish({"version": version, "result": "interrupted", "phase": "preparing", "at": time.time()})
            self.journal.set_pass(version, status="failed", reason="interrupted during prepare", next_retry_at=0)
            return version
        manifest = read_manifest(self.cfg.cube_root / version)
        pass_name = _source_pass(manifest, version)
        entry = self._entry(pass_name)
        pass_dir = self._pass_dir(pass_name)
        t0 = time.time()
        ok, info = roll_out(
            doc=chain_doc(self.cfg.cube_root, version), journal=self.journal, fleet=self.fleet, resume=True
        )
        info["recovered"] = True
        if manifest.get("resharded_from"):
            info.update(by="reshard", resharded_from=manifest["resharded_from"])
        self._conclude(version, entry, pass_dir, manifest, ok, info, t0, pass_name)
        return version

    def _entry(self, pass_name: str) -> DonefileEntry:
        return next(
            (e for e in read_donefile(self.cfg.model_path) if e.pass_name == pass_name),
            DonefileEntry(pass_name, pass_name, {}, None),
        )

    def active_pass(self) -> str | None:
        """The pass the active version was built from (its name, unless it was resharded)."""
        active = self.journal.data["active"]
        return (active.get("pass") or active["version"]) if active else None

    # ---- re-sharding ----------------------------------------------------------------------

    def reshard_if_needed(self) -> str | None:
        """When the active version has another shard count than the configured agents (the fleet was
        resized), roll out the same rows re-split into ``cfg.shards`` shards as version ``PASS.sN``,
        through the same two-phase switch; recorded with ``"by": "reshard"``. None: nothing to do."""
        active = self.journal.data["active"]
        if not active or int(active.get("shards") or self.cfg.shards) == self.cfg.shards:
            return None
        source, pass_name = active["version"], self.active_pass()
        target = reshard_name(pass_name, self.cfg.shards)
        entry, pass_dir = self._entry(pass_name), self._pass_dir(pass_name)
        t0 = time.time()
        log.info(
            "active %s has %s shards, %d configured: resharding it as %s",
            source,
            active["shards"],
            self.cfg.shards,
            target,
        )
        try:
            manifest, built = self._reshard_build(source, target, pass_dir)
            doc = self._publish_chain(target, pass_dir)
        except (ElasticControlError, OSError) as e:
            raise ComponentError(f"reshard of {source} to {self.cfg.shards} shards: {e}") from e
        ok, info = roll_out(doc=doc, journal=self.journal, fleet=self.fleet)
        info.update(by="reshard", resharded_from={"version": source, "shards": active["shards"]}, built=built)
        self._conclude(target, entry, pass_dir, manifest, ok, info, t0, pass_name)
        if not ok:
            raise ComponentError(f"reshard of {source} to {self.cfg.shards} shards failed: {info.get('error')}")
        self.last_error = None
        return target

    def _reshard_build(self, source: str, target: str, pass_dir: Path) -> tuple[dict, bool]:
        """The resharded version: reused when built and sound; else from ``source``'s built chain (the rows
        the shards serve), or from the pass itself when that chain is gone and the pass is a full one."""
        tdir = self.cfg.cube_root / target
        if (tdir / MANIFEST).exists():
            try:
                manifest = verify_version_dir(tdir)
                if manifest["shards"] == self.cfg.shards:
                    return manifest, False
            except (CorruptShardError, DataError) as e:
                log.warning("rebuilding %s: %s", target, e)
        shutil.rmtree(tdir, ignore_errors=True)
        try:
            for v in chain_versions(chain_doc(self.cfg.cube_root, source)):
                verify_version_dir(self.cfg.cube_root / v, check_sha=False)
        except (ElasticControlError, KeyError) as e:
            if load_pass(pass_dir).kind == "delta":
                raise DataError(f"the built chain of {source} is unusable ({e}) and its pass is a delta") from e
            log.warning("building %s from %s: the built %s is unusable (%s)", target, pass_dir, source, e)
            return build_version(
                pass_dir=pass_dir, shards=self.cfg.shards, output=self.cfg.cube_root, version=target
            ), True
        return reshard_version(
            cube_root=self.cfg.cube_root, source=source, shards=self.cfg.shards, version=target
        ), True

    # ---- the published versions ------------------------------------------------------------

    def check_published(self) -> list[dict]:
        """Check that the file server still holds every file of the active and pinned versions' chains
        (shards, manifests, chain.json), e.g. after a folder was deleted on disk behind its back; the
        findings go to ``problems`` in the status (empty when all is there)."""
        roots = [v for v in [self.journal.active_version, *sorted(self.journal.data.get("pins") or {})] if v]
        problems = []
        for root in dict.fromkeys(roots):
            try:
                doc = chain_doc(self.cfg.cube_root, root)
            except (ElasticControlError, KeyError):
                continue  # not built here (any more): nothing to compare with
            wanted = {f"{FILESERVER_PREFIX}/{root}/": {"chain.json": None}}
            for item in doc["chain"]:
                files = wanted.setdefault(item["path"], {})
                files[MANIFEST] = None
                files.update({n: f.get("size") for n, f in item["files"].items()})
            for folder, files in wanted.items():
                try:
                    have = {e["name"]: e.get("size") for e in self.fs.list(folder) if not e.get("is_dir")}
                except NotFound:
                    have = {}
                except (FileServerError, ValueError, KeyError) as e:
                    problems.append({"version": root, "folder": folder, "error": f"cannot list: {e}"})
                    continue
                missing = sorted(n for n in files if n not in have)
                wrong = sorted(n for n, size in files.items() if n in have and size is not None and have[n] != size)
                if missing or wrong:
                    self._published.discard(folder)
                    what = "folder is gone" if not have else f"missing {', '.join(missing) or 'nothing'}"
                    if wrong:
                        what += f", wrong size: {', '.join(wrong)}"
                    problems.append(
                        {
                            "version": root,
                            "folder": folder,
                            "missing": missing,
                            "wrong_size": wrong,
                            "error": f"published version {root}: {folder} on the file server: {what}",
                        }
                    )
        self.problems = problems
        for p in problems:
            log.error("%s", p["error"])
        return problems

    # ---- compaction ---------------------------------------------------------------------

    def _maybe_compact(self, version: str) -> None:
        """Fold the active delta version's chain into a full copy, off the rollout and serving paths."""
        if not self.cfg.compact_after or (self._compactor is not None and self._compactor.is_alive()):
            return
        try:
            deltas = len(chain_doc(self.cfg.cube_root, version)["chain"]) - 1
        except ElasticControlError:
            return
        if deltas < self.cfg.compact_after:
            return

        def work():
            t0 = time.time()
            self.compaction = {"version": version, "state": "running", "deltas": deltas, "started_at": t0}
            try:
                compact_version(cube_root=self.cfg.cube_root, version=version)
                publish_compacted(self.fs, self.cfg.cube_root / version, self.cfg.retry)
                publish_chain(self.fs, chain_doc(self.cfg.cube_root, version), self.cfg.retry)
                self.compaction.update(state="done", seconds=round(time.time() - t0, 3))
                self.journal.set_pass(version, compacted=True)
                log.info("compacted %s (%d deltas) in %.1fs", version, deltas, time.time() - t0)
            except (ElasticControlError, OSError) as e:
                self.compaction.update(state="failed", error=str(e))
                log.error("compaction of %s failed: %s", version, e)

        self._compactor = threading.Thread(target=work, name=f"compact-{version}", daemon=True)
        self._compactor.start()

    # ---- pins -------------------------------------------------------------------------------

    def wanted_pins(self) -> set[str]:
        """Versions named in the file server's cube/pins.json (``{"versions": [...]}``)."""
        try:
            doc = self.fs.get_json(PINS_FILE)
        except NotFound:
            return set()
        versions = doc.get("versions") if isinstance(doc, dict) else None
        if not isinstance(versions, list):
            raise DataError(f'{PINS_FILE} on the file server must be {{"versions": [VERSION, ...]}}')
        return {v for v in versions if valid_version_name(v)}

    def sync_pins(self) -> None:
        """Load newly pinned versions on every shard (pinned), unpin the ones no longer named."""
        try:
            wanted = self.wanted_pins()
        except (ElasticControlError, ValueError) as e:
            self.pins_error = str(e)
            return
        have = dict(self.journal.data.get("pins") or {})
        errors = []
        for version in sorted(wanted - set(have)):
            try:
                self._build(version, self._pass_dir(version), check_sha=False)
                errs, _ = self.fleet.prepare(self._publish_chain(version, self._pass_dir(version)), pin=True)
                if errs:
                    raise ComponentError("; ".join(f"shard {i}: {e}" for i, e in sorted(errs.items())))
                have[version] = {"pinned_at": time.time()}
                log.info("pinned %s on every shard", version)
            except (ElasticControlError, OSError) as e:
                errors.append(f"pin {version}: {e}")
        for version in sorted(set(have) - wanted):
            errs = self.fleet.unpin(version)
            if errs and not all("not pinned" in e for e in errs.values()):
                errors.append(f"unpin {version}: " + "; ".join(f"shard {i}: {e}" for i, e in sorted(errs.items())))
                continue
            del have[version]
        self.journal.set_field("pins", have)
        self.pins_error = "; ".join(errors) or None

    # ---- garbage collection ---------------------------------------------------------------

    def protected(self) -> set[str]:
        """Versions GC must keep: the chains of the active, previous, in-flight and pinned versions."""
        roots = {self.journal.active_version}
        for rec in reversed(self.journal.data["history"]):
            if rec.get("result") == "active" and rec["version"] != self.journal.active_version:
                roots.add(rec["version"])  # the previous active version: servers still hold it
                break
        if self.journal.data["in_flight"]:
            roots.add(self.journal.data["in_flight"]["version"])
        roots |= set(self.journal.data.get("pins") or {})
        if self.pins_error is None:
            with contextlib.suppress(ElasticControlError, ValueError):
                roots |= self.wanted_pins()
        protect = set()
        for v in roots - {None}:
            protect.add(v)
            with contextlib.suppress(ElasticControlError, KeyError):
                # What a shard starting from nothing downloads (from the latest full copy on). Shards that
                # hold a version keep their own copies of its older ancestors (the agent's GC).
                protect.update(chain_versions(chain_doc(self.cfg.cube_root, v)))
        return protect

    def gc(self) -> list[str]:
        """Delete built versions beyond the newest ``keep`` that no protected chain needs."""
        if self._compactor is not None and self._compactor.is_alive():
            return []  # it reads the chain's files; collect next time
        protect = self.protected()
        versions = complete_versions(self.cfg.cube_root)
        doomed = [v for v in versions[: -self.cfg.keep] if v not in protect]
        for v in doomed:
            self._published -= {f"{FILESERVER_PREFIX}/{v}/", f"{FILESERVER_PREFIX}/{v}/{COMPACTED}/"}
            shutil.rmtree(self.cfg.cube_root / v, ignore_errors=True)
            try:
                self.fs.delete(f"{FILESERVER_PREFIX}/{v}/")
            except FileServerError as e:
                log.warning("could not delete %s from the file server: %s", v, e)
        return doomed

    # ---- status ----------------------------------------------------------------------------

    def status(self, _body=None) -> tuple[int, dict]:
        snap = self.journal.snapshot()
        return 200, {
            "active": snap["active"],
            "in_flight": snap["in_flight"],
            "passes": snap["passes"],
            "history": snap["history"][-20:],
            "last_error": self.last_error,
            "pins": snap.get("pins") or {},
            "pins_error": self.pins_error,
            "problems": self.problems,
            "compaction": self.compaction,
            "champion": {
                "alias": f"models:/{REGISTERED_MODEL}@{CHAMPION}",
                "last": self.champion.last,
                "error": self.champion.last_error,
            }
            if self.champion
            else None,
            "config": {
                "model_path": str(self.cfg.model_path),
                "cube_root": str(self.cfg.cube_root),
                "fileserver": self.cfg.fileserver_url,
                "agents": self.cfg.agents,
                "keep": self.cfg.keep,
                "gate": getattr(self.cfg.gate, "rule", None) if self.cfg.gate else None,
                "force": self.cfg.force,
                "compact_after": self.cfg.compact_after,
            },
        }

    def routes(self) -> dict:
        def poll(_body):
            self.wake.set()
            return 202, {"status": "poll requested"}

        def rollback(body):
            version = body.get("version") if isinstance(body, dict) else None
            if version is not None and not isinstance(version, str):
                return 400, {"error": '"version" must be a version name (or absent: the previous version)'}
            try:
                return 200, self.rollback(version)
            except UsageError as e:
                return 400, {"error": str(e)}
            except ElasticControlError as e:
                return 409, {"error": str(e)}

        return {
            ("GET", "/v1/status"): JsonRoute(self.status),
            ("POST", "/v1/rollback"): JsonRoute(rollback, write=True),
            ("GET", "/healthz"): JsonRoute(lambda _b: (200, {"status": "ok", "active": self.journal.active_version})),
            ("POST", "/v1/poll"): JsonRoute(poll, write=True),
            ("GET", "/v1/shards"): JsonRoute(lambda _b: (200, {"shards": self.fleet.statuses()})),
        }


def reshard_name(pass_name: str, shards: int) -> str:
    """The version of pass ``pass_name`` re-split into ``shards`` shards (a pass's own version keeps the
    count it was first built with)."""
    return f"{pass_name}.s{shards}"


def _source_pass(manifest: dict, version: str) -> str:
    source = manifest.get("source_pass")
    name = source.get("name") if isinstance(source, dict) else source
    return name if valid_version_name(name) else version


def _gate(rule: str | None, command: str | None) -> Gate | None:
    if not rule:
        return None
    return CommandGate(rule, command or DEFAULT_GATE_COMMAND)


def _split(csv: str | None) -> list[str]:
    return [s.strip() for s in (csv or "").split(",") if s.strip()]


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model-path", default=None, help="Where training writes passes and the donefile [env MODEL_PATH].")
@click.option(
    "--cube-root", default=None, help="Local folder for built versions and the journal [env ELASTIC_CTR_CUBE_ROOT]."
)
@click.option("--fileserver", default=None, help="File server base URL [env ELASTIC_CTR_FILESERVER_URL].")
@click.option(
    "--agents", default=None, help="Comma-separated cube-agent URLs in shard order [env ELASTIC_CTR_CUBE_AGENTS]."
)
@click.option("--keep", type=int, default=None, help="Built versions to keep [env ELASTIC_CTR_CUBE_KEEP, default 3].")
@click.option(
    "--gate",
    "gate_rule",
    default=None,
    help="Promotion gate rule [env ELASTIC_CTR_PROMOTION_GATE]; unset: no gate.",
)
@click.option(
    "--gate-command",
    default=None,
    help="Command that decides the gate [env ELASTIC_CTR_PROMOTION_GATE_COMMAND, default: "
    "python -m elastic_control eval gate].",
)
@click.option("--force", is_flag=True, help="Skip the promotion gate.")
@click.option("--poll-interval", type=float, default=5.0, show_default=True, help="Seconds between donefile checks.")
@click.option("--timeout", type=float, default=60.0, show_default=True, help="Seconds per agent or file-server call.")
@click.option("--retries", type=int, default=3, show_default=True, help="Attempts per call (exponential backoff).")
@click.option(
    "--compact-after",
    type=int,
    default=DEFAULT_COMPACT_AFTER,
    show_default=True,
    help="Fold a delta chain into a full copy once the active version is this many deltas deep (0: never).",
)
@click.option("--once", is_flag=True, help="Handle what is there now (including an interrupted rollout), then exit.")
@click.option(
    "--port",
    type=int,
    default=lambda: env_vars.CUBE_TRANSFER_PORT.get(),
    show_default=str(DEFAULT_PORT),
    help="Status port, 0: any free port [env ELASTIC_CTR_CUBE_TRANSFER_PORT].",
)
@click.option("--host", default="0.0.0.0", show_default=True, help="Address to bind.")
@click.option("--ready-file", default=None, help="Write {port, pid} here (JSON) once listening.")
def transfer_command(
    model_path,
    cube_root,
    fileserver,
    agents,
    keep,
    gate_rule,
    gate_command,
    force,
    poll_interval,
    timeout,
    retries,
    compact_after,
    once,
    port,
    host,
    ready_file,
):
    """Watch the donefile; build, publish and roll out each new pass to every cube shard."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s cube-transfer %(levelname)s %(message)s")
    model_path = model_path or env_vars.MODEL_PATH.require()
    cfg = TransferConfig(
        model_path=Path(model_path),
        cube_root=Path(cube_root or env_vars.CUBE_ROOT.get() or Path(model_path) / "cube"),
        fileserver_url=fileserver or env_vars.FILESERVER_URL.require(),
        agents=_split(agents or env_vars.CUBE_AGENTS.get()),
        token=env_vars.TOKEN.get(),
        keep=keep if keep is not None else env_vars.CUBE_KEEP_VERSIONS.get(),
        gate=_gate(gate_rule or env_vars.PROMOTION_GATE.get(), gate_command or env_vars.PROMOTION_GATE_COMMAND.get()),
        force=force,
        retry=RetryPolicy(attempts=retries, timeout=timeout),
        poll_interval=poll_interval,
        compact_after=compact_after,
        mlflow_uri=env_vars.MLFLOW_TRACKING_URI.get(),
    )
    expected = env_vars.CUBE_SHARDS.get()
    if expected is not None and expected != cfg.shards:
        raise UsageError(f"ELASTIC_CTR_CUBE_SHARDS={expected} but {cfg.shards} agent URLs were given")
    if cfg.keep < 2:
        raise UsageError(f"--keep {cfg.keep} must be >= 2 (the active and the previous version)")
    if retries < 1:
        raise UsageError(f"--retries {retries} must be >= 1")
    if compact_after < 0:
        raise UsageError(f"--compact-after {compact_after} must be >= 0")
    transfer = Transfer(cfg)
    if once:
        while transfer.poll_once():
            pass
        transfer.wait_for_compaction()
        if transfer.champion is not None:
            transfer.champion.wait(timeout=transfer.champion.patience + 60)
        if transfer.last_error:
            raise ComponentError(transfer.last_error)
        return
    try:
        server = make_json_server(host=host, port=port, routes=transfer.routes(), token=cfg.token, name="cube-transfer")
    except OSError as e:
        raise ComponentError(f"cube-transfer cannot listen on {host}:{port}: {e.strerror}") from e
    serve_in_thread(server)
    if ready_file:
        atomic_write_json(ready_file, {"port": server.server_address[1], "pid": os.getpid()})
    print(
        f"cube-transfer: watching {cfg.model_path}/donefile, {cfg.shards} shards, "
        f"status on http://{host}:{server.server_address[1]}",
        flush=True,
    )

    def stop(*_):
        transfer.stopping = True
        transfer.wake.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    transfer.run_forever()


def main(argv: list[str] | None = None) -> None:
    run_cli(transfer_command, "cube-transfer", argv)


if __name__ == "__main__":
    main()
