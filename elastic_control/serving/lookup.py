"""Embedding lookups pinned to one version: from cube shards, or from a pass's table in memory.

Every lookup names the version whose dense model will consume the vectors;
an answer for any other version is refused, so model and cube versions in a
prediction always match.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from ctr_foundation.errors import ComponentError
from elastic_control.inference.scoring import InMemoryTable


class CubeUnavailable(ComponentError):
    """No answer from cube for a version (unreachable, timed out, version not held) -> HTTP 503."""


class Lookup(Protocol):
    def lookup(self, keys: np.ndarray, version: str) -> tuple[np.ndarray, np.ndarray]:
        """(values float32 [n, dim], found bool [n]) for uint64 ``keys`` of ``version``."""

    def probe(self, version: str) -> None:
        """Raise CubeUnavailable unless every shard answers a one-key lookup pinned to ``version``."""

    def close(self) -> None: ...


class CubeLookup:
    """All cube shards, queried concurrently by cube's own client (one request per shard)."""

    def __init__(self, shard_urls: Sequence[str], timeout: float = 5.0):
        from cube.client import CubeClient  # the cube engineer's client (cube/client.py)

        self.shard_urls = list(shard_urls)
        try:
            self._client = CubeClient(self.shard_urls, timeout=timeout)
        except TypeError:  # a client without a timeout keyword still works
            self._client = CubeClient(self.shard_urls)

    def lookup(self, keys: np.ndarray, version: str) -> tuple[np.ndarray, np.ndarray]:
        try:
            values, found, got = self._client.lookup(keys, version)
        except Exception as e:  # noqa: BLE001 - any cube failure is a 503 with its reason
            raise CubeUnavailable(f"cube lookup of version {version} failed: {e}") from e
        if got != version:
            raise CubeUnavailable(f"cube answered version {got!r} for a lookup pinned to {version!r}")
        return np.asarray(values, dtype=np.float32), np.asarray(found, dtype=bool)

    def probe(self, version: str) -> None:
        # key % N picks the shard: keys 0..N-1 reach every shard once
        self.lookup(np.arange(len(self.shard_urls), dtype=np.uint64), version)

    def close(self) -> None:
        close = getattr(self._client, "close", None)
        if close:
            close()


class TableLookup:
    """A pass's sparse table in this process (``--model-dir``: no cube needed)."""

    def __init__(self, table: InMemoryTable, version: str):
        self.table = table
        self.version = version

    def lookup(self, keys: np.ndarray, version: str) -> tuple[np.ndarray, np.ndarray]:
        if version != self.version:
            raise CubeUnavailable(f"the in-memory table holds {self.version}, not {version}")
        return self.table.lookup(keys)

    def probe(self, version: str) -> None:
        self.lookup(np.zeros(1, np.uint64), version)

    def close(self) -> None:
        pass
