"""cube-transfer against real cube servers, agents and the real file server: re-sharding the active version
when the fleet's shard count changed, and noticing a published version gone from the file server."""

from __future__ import annotations

import contextlib
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import requests
from helpers_cube import (
    TOKEN,
    add_done,
    cube_processes,
    fileserver,
    shard_specs,
    write_synthetic_pass,
)

from cube.client import CubeClient
from cube.rollout import RetryPolicy
from cube.transfer import Transfer, TransferConfig, reshard_name
from elastic_control.local import status as local_status

pytestmark = pytest.mark.e2e
KEYS = np.unique(np.random.default_rng(7).integers(1, 2**64 - 1, 2000, dtype=np.uint64))


@dataclass
class Fleet:
    root: Path
    fs_url: str
    servers: list[str]
    agents: list[str]

    def add_pass(self, hour: int, seed: int) -> tuple[str, np.ndarray]:
        name = f"pass-20240301-{hour:02d}"
        values = np.random.default_rng(seed).standard_normal((len(KEYS), 4)).astype(np.float32)
        write_synthetic_pass(self.root / "models" / name, KEYS, values)
        add_done(self.root / "models", name)
        return name, values

    def transfer(self, shards: int) -> Transfer:
        return Transfer(
            TransferConfig(
                model_path=self.root / "models",
                cube_root=self.root / "built",
                fileserver_url=self.fs_url,
                agents=self.agents[:shards],
                token=TOKEN,
                retry=RetryPolicy(attempts=2, backoff=0.1, timeout=10),
            )
        )

    def actives(self, shards: int) -> list[str | None]:
        return [requests.get(f"{u}/v1/status", timeout=5).json()["active"] for u in self.servers[:shards]]

    def current(self) -> dict:
        return requests.get(f"{self.fs_url}/files/cube/current.json", timeout=5).json()


@pytest.fixture
def fleet(tmp_path):
    """Three cube servers with their agents and the file server; a transfer uses the first N of them."""
    (tmp_path / "models").mkdir()
    with contextlib.ExitStack() as stack:
        fs_url = stack.enter_context(fileserver(tmp_path / "fileserver"))
        started = stack.enter_context(cube_processes(shard_specs(tmp_path, 3, fs_url), tmp_path))
        yield Fleet(tmp_path, fs_url, [u for u, _ in started[0::2]], [u for u, _ in started[1::2]])


def _lookup(servers: list[str]) -> tuple[np.ndarray, np.ndarray, str]:
    with CubeClient(servers) as c:
        return c.lookup(KEYS)


def test_a_transfer_restarted_with_more_shards_reshards_the_active_version(fleet):
    first, values = fleet.add_pass(0, seed=1)
    two = fleet.transfer(2)
    assert two.poll_once() == first
    assert fleet.actives(2) == [first, first] and fleet.current()["shards"] == 2
    before, found, _ = _lookup(fleet.servers[:2])
    assert found.all() and np.allclose(before, values)

    # The fleet grew to 3 shards: the restarted transfer re-splits the active rows and switches every shard.
    three = fleet.transfer(3)
    target = reshard_name(first, 3)
    assert three.poll_once() == target
    current = fleet.current()
    assert (current["version"], current["pass"], current["shards"]) == (target, first, 3)
    assert current["dense"] == f"cube/{target}/dense/"
    assert (
        requests.get(f"{fleet.fs_url}/files/cube/{target}/dense/inference.pdmodel", timeout=5).content
        == b"model-" + first.encode()
    )
    assert fleet.actives(3) == [target] * 3
    after, found, version = _lookup(fleet.servers)
    assert version == target and found.all()
    assert np.array_equal(after, before)  # the same rows, now split three ways
    st = three.status()[1]
    assert st["active"]["version"] == target and st["active"]["pass"] == first and st["active"]["shards"] == 3
    last = st["history"][-1]
    assert (last["version"], last["result"], last["by"]) == (target, "active", "reshard")
    assert last["resharded_from"] == {"version": first, "shards": 2}
    manifest = requests.get(f"{fleet.fs_url}/files/cube/{target}/manifest.json", timeout=5).json()
    assert manifest["shards"] == 3 and manifest["rows"] == len(KEYS)

    # Nothing more to do, and a restart reshards nothing again; the next pass rolls out on 3 shards.
    assert three.poll_once() is None
    again = fleet.transfer(3)
    assert again.poll_once() is None and again.journal.active_version == target
    second, values2 = fleet.add_pass(1, seed=2)
    assert again.poll_once() == second
    assert fleet.actives(3) == [second] * 3 and fleet.current()["shards"] == 3
    got, found, _ = _lookup(fleet.servers)
    assert found.all() and np.allclose(got, values2)

    # Back to 2 shards: the active pass is re-split again, from its 3-shard build.
    two_again = fleet.transfer(2)
    assert two_again.poll_once() == reshard_name(second, 2)
    assert fleet.actives(2) == [reshard_name(second, 2)] * 2
    got2, found, _ = _lookup(fleet.servers[:2])
    assert found.all() and np.array_equal(got2, got)


def test_a_published_version_gone_from_the_file_server_shows_in_the_status(fleet):
    first, _ = fleet.add_pass(0, seed=1)
    t = fleet.transfer(2)
    assert t.poll_once() == first
    assert t.poll_once() is None
    assert t.status()[1]["problems"] == []

    published = fleet.root / "fileserver" / "cube" / first
    (published / "shard-1.arrow").unlink()  # behind the file server's back
    assert t.poll_once() is None
    problems = t.status()[1]["problems"]
    assert [(p["version"], p["folder"], p["missing"]) for p in problems] == [
        (first, f"cube/{first}/", ["shard-1.arrow"])
    ]
    assert first in problems[0]["error"] and "shard-1.arrow" in problems[0]["error"]

    # The local status document's cube section carries it (as the transfer error, and the list itself).
    probe = local_status.Probe(state="running", answers={"/v1/status": t.status()[1]})
    cube = local_status._cube(None, _Layout(fleet.root / "built"), [], {"cube-transfer": probe})
    assert cube["transfer_problems"] == problems
    assert first in cube["transfer_error"] and "shard-1.arrow" in cube["transfer_error"]

    shutil.rmtree(published)  # the whole folder
    assert t.poll_once() is None
    problems = t.status()[1]["problems"]
    assert [p["version"] for p in problems] == [first]
    assert {"manifest.json", "chain.json", "shard-0.arrow", "shard-1.arrow"} <= set(problems[0]["missing"])
    assert "gone" in problems[0]["error"]


@dataclass
class _Layout:
    cube_root: Path
