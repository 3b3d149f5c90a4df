"""Embedding lookups pinned to one version: from cube shards, or from a pass's table in memory.

Every lookup names the version whose dense model will consume the vectors;
an answer for any other version is refused, so model and cube versions in a
prediction always match.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ctr_foundation.errors import ComponentError
from cube.client import CubeClient, CubeVersionError  # the cube engineer's client (cube/client.py)
from elastic_control.inference.scoring import InMemoryTable


class CubeUnavailable(ComponentError):
    """No answer from cube for a version (unreachable, timed out, version not held) -> HTTP 503.

    ``version_missing``: a shard answered that it does not hold the version (it may have moved on), as
    opposed to a shard that did not answer at all."""

    def __init__(self, message: str, *, version_missing: bool = False):
        super().__init__(message)
        self.version_missing = version_missing


Rows = tuple[np.ndarray, np.ndarray]  # (values float32 [n, dim], found bool [n])


@dataclass(frozen=True)
class Looked:
    """One piece of a lookup started with ``Lookup.start``: the keys at ``idx`` (indices into the lookup's
    keys) with their rows, or, where a shard did not answer, ``error`` (and zero rows)."""

    idx: np.ndarray  # int [k]
    values: np.ndarray  # float32 [k, dim]
    found: np.ndarray  # bool [k]
    error: CubeUnavailable | None = None


Done = Callable[[Looked], None]


def failed_piece(idx: np.ndarray, error: CubeUnavailable) -> Looked:
    return Looked(idx, np.zeros((len(idx), 0), np.float32), np.zeros(len(idx), bool), error)


class Lookup(Protocol):
    def lookup(self, keys: np.ndarray, version: str) -> Rows:
        """(values float32 [n, dim], found bool [n]) for uint64 ``keys`` of ``version``."""

    def start(self, keys: np.ndarray, version: str, done: Done) -> None:
        """Look ``keys`` up without waiting: ``done(Looked)`` is called once per piece (a shard's keys), on
        whichever thread has it (maybe this one, before ``start`` returns), as soon as that piece is in; the
        pieces cover every key once."""

    def probe(self, version: str) -> None:
        """Raise CubeUnavailable unless every shard answers a one-key lookup pinned to ``version``."""

    def close(self) -> None: ...


class _Shard:
    """One shard's requests (their own threads) and its health: a shard that timed out or could not be
    reached is *down* for ``retry_after`` seconds, and lookups that need it fail at once meanwhile, so a
    stalled shard costs each request at most one timeout, and only requests that need a key it holds."""

    def __init__(self, url: str, threads: int):
        self.url = url
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="cube-lookup")
        self.lock = threading.Lock()
        self.down_until = 0.0
        self.reason = ""

    def check(self) -> None:
        with self.lock:
            if time.monotonic() < self.down_until:
                raise CubeUnavailable(
                    f"cube shard {self.url} is not answering ({self.reason}); lookups that need it fail at once "
                    f"for {max(0.0, self.down_until - time.monotonic()):.1f}s more"
                )

    def failed(self, reason: str, retry_after: float) -> None:
        with self.lock:
            self.down_until, self.reason = time.monotonic() + retry_after, reason

    def answered(self) -> None:
        with self.lock:
            self.down_until, self.reason = 0.0, ""


class CubeLookup:
    """All cube shards, each asked once per lookup (only for the keys it holds), concurrently.

    Each shard has its own request threads and a deadline of ``timeout`` seconds per lookup (from when the
    lookup started), so a shard that stalls delays only the lookups that need one of its keys, by at most
    ``timeout``; then it is down for ``retry_after`` seconds (lookups that need it are refused at once, the
    probe still tries it), and the first lookup after that, or the probe, tries it again.
    """

    def __init__(self, shard_urls: Sequence[str], timeout: float = 5.0, *, retry_after: float = 1.0, threads: int = 4):
        self.shard_urls = list(shard_urls)
        self.timeout, self.retry_after = timeout, retry_after
        self._client = CubeClient(self.shard_urls, timeout=timeout)
        self._shards = [_Shard(u, threads) for u in self.shard_urls]

    def lookup(self, keys: np.ndarray, version: str, *, trial: bool = False) -> Rows:
        waiter = _Waiter(len(keys))
        self._start(keys, version, waiter.done, trial=trial)
        return waiter.wait()

    def start(self, keys: np.ndarray, version: str, done: Done) -> None:
        self._start(keys, version, done, trial=False)

    def _start(self, keys: np.ndarray, version: str, done: Done, *, trial: bool) -> None:
        keys = np.ascontiguousarray(keys, dtype=np.uint64).reshape(-1)
        n = len(self._shards)
        shard_of = keys % np.uint64(n)
        groups = [(i, np.flatnonzero(shard_of == i)) for i in range(n)]
        groups = [(i, idx) for i, idx in groups if len(idx)] or [(0, np.zeros(0, np.int64))]
        deadline = time.monotonic() + self.timeout
        for i, idx in groups:
            if not trial:
                try:
                    self._shards[i].check()  # a shard that is down: its keys fail at once, nothing is sent
                except CubeUnavailable as e:
                    done(failed_piece(idx, e))
                    continue
            self._shards[i].pool.submit(self._ask, i, keys[idx], idx, version, deadline, done)

    def _ask(self, i: int, keys: np.ndarray, idx: np.ndarray, version: str, deadline: float, done: Done) -> None:
        done(self._piece(i, keys, idx, version, deadline))

    def _piece(self, i: int, keys: np.ndarray, idx: np.ndarray, version: str, deadline: float) -> Looked:
        shard = self._shards[i]
        failed = f"cube lookup of version {version} failed"
        left = deadline - time.monotonic()
        if left <= 0:  # every thread of the shard was busy with requests it does not answer
            reason = f"cube shard {shard.url} gave no answer within {self.timeout:g}s"
            shard.failed(reason, self.retry_after)
            return failed_piece(idx, CubeUnavailable(f"{failed}: {reason}"))
        try:
            values, found, got = self._client.lookup_shard(i, keys, version, timeout=left)
        except CubeVersionError as e:
            shard.answered()
            return failed_piece(idx, CubeUnavailable(f"{failed}: {e}", version_missing=True))
        except Exception as e:  # noqa: BLE001 - any cube failure is a 503 with its reason
            if isinstance(e.__cause__, OSError):  # timed out or unreachable (not an error answer): down a while
                shard.failed(str(e), self.retry_after)
            return failed_piece(idx, CubeUnavailable(f"{failed}: {e}"))
        shard.answered()
        if got != version:
            return failed_piece(
                idx, CubeUnavailable(f"cube answered version {got!r} for a lookup pinned to {version!r}")
            )
        return Looked(idx, np.asarray(values, np.float32), np.asarray(found, bool))

    def probe(self, version: str) -> None:
        # key % N picks the shard: keys 0..N-1 reach every shard once; a shard that is down is tried again
        self.lookup(np.arange(len(self.shard_urls), dtype=np.uint64), version, trial=True)

    def close(self) -> None:
        for s in self._shards:
            s.pool.shutdown(wait=False)
        self._client.close()


class _Waiter:
    """Waits for the pieces of one lookup and puts them back in key order."""

    def __init__(self, n: int):
        self.n, self.covered = n, 0
        self.lock = threading.Lock()
        self.event = threading.Event()
        self.pieces: list[Looked] = []

    def done(self, piece: Looked) -> None:
        with self.lock:
            self.pieces.append(piece)
            self.covered += len(piece.idx)
            if self.covered >= self.n:
                self.event.set()

    def wait(self) -> Rows:
        self.event.wait()
        errors = [p.error for p in self.pieces if p.error is not None]
        if errors:
            raise errors[0]
        widths = {p.values.shape[1] for p in self.pieces}
        if len(widths) != 1:
            raise CubeUnavailable(f"cube shards answered rows of different widths ({sorted(widths)})")
        values = np.zeros((self.n, widths.pop()), np.float32)
        found = np.zeros(self.n, bool)
        for p in self.pieces:
            values[p.idx], found[p.idx] = p.values, p.found
        return values, found


class TableLookup:
    """A pass's sparse table in this process (``--model-dir``: no cube needed)."""

    def __init__(self, table: InMemoryTable, version: str):
        self.table = table
        self.version = version

    def lookup(self, keys: np.ndarray, version: str) -> tuple[np.ndarray, np.ndarray]:
        if version != self.version:
            raise CubeUnavailable(f"the in-memory table holds {self.version}, not {version}")
        return self.table.lookup(keys)

    def start(self, keys: np.ndarray, version: str, done: Done) -> None:
        idx = np.arange(len(keys))
        try:
            values, found = self.lookup(keys, version)
        except CubeUnavailable as e:
            done(failed_piece(idx, e))
            return
        done(Looked(idx, values, found))

    def probe(self, version: str) -> None:
        self.lookup(np.zeros(1, np.uint64), version)

    def close(self) -> None:
        pass
