"""Delta versions (the cube side): built from delta passes derived from a real saved table, served as
the parent overlaid by the delta, shipped alone, caught up by restarted shards, compacted, kept by GC."""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import requests
from helpers_cube import (
    TOKEN,
    DeltaPasses,
    agent_args,
    cube_process,
    fileserver,
    free_port,
    server_args,
)

from ctr_foundation.errors import DataError
from cube.builder import build_version, compact_version
from cube.client import CubeClient
from cube.rollout import RetryPolicy
from cube.shard_format import read_deleted, read_shard
from cube.transfer import Transfer, TransferConfig
from cube.version_store import ChainLoader

pytestmark = pytest.mark.needs_criteo

BASE, D1, D2, D3 = "pass-20240101-00", "pass-20240101-01", "pass-20240101-02", "pass-20240101-03"


@pytest.fixture(scope="module")
def real_pass(criteo_world):
    # The Criteo pass, not the synthetic one: its thousands of keys make a delta of a few dozen "far fewer
    # rows" than the base, as a real delta is.
    return criteo_world.latest


def _served(root, version, shards):
    """Every key and value the version amounts to, from its chain on disk (what cube-server loads)."""
    parts = [ChainLoader(root, i).content(version, f"{version}/shard-{i}.arrow") for i in range(shards)]
    keys = np.concatenate([p.keys for p in parts])
    values = np.concatenate([p.values for p in parts])
    order = np.argsort(keys)
    return keys[order], values[order]


def test_delta_versions_amount_to_exactly_the_latest_delta_or_base(real_pass, tmp_path):
    passes = DeltaPasses(real_pass, tmp_path / "models", BASE)
    cube = tmp_path / "cube"
    base = build_version(pass_dir=tmp_path / "models" / BASE, shards=2, output=cube)
    assert base["kind"] == "base" and base["parent"] is None and base["depth"] == 0
    n = base["rows"]
    passes.delta(D1, change=20, add=10, delete=15, seed=1)
    with pytest.raises(DataError, match="not built"):
        build_version(pass_dir=tmp_path / "models" / D1, shards=2, output=tmp_path / "elsewhere")
    m1 = build_version(pass_dir=tmp_path / "models" / D1, shards=2, output=cube)
    passes.delta(D2, change=25, add=5, delete=10, seed=2, readd=4)
    m2 = build_version(pass_dir=tmp_path / "models" / D2, shards=2, output=cube)
    for m, parent, depth, rows, deleted in ((m1, BASE, 1, 30, 15), (m2, D1, 2, 34, 10)):
        assert (m["kind"], m["parent"], m["base"], m["depth"]) == ("delta", parent, BASE, depth)
        assert m["rows"] == rows and m["deleted"] == deleted and m["rows"] < n / 10  # far fewer rows
        assert set(m["files"]) == {"shard-0.arrow", "shard-1.arrow", "deleted-0.arrow", "deleted-1.arrow"}
        assert sum(e["rows"] for k, e in m["files"].items() if k.startswith("deleted")) == deleted
    rows = read_shard(cube / D2 / "shard-1.arrow")
    assert rows.kind == "delta" and rows.parent == D1 and np.all(rows.keys % np.uint64(2) == 1)
    meta, gone = read_deleted(cube / D2 / "deleted-0.arrow")
    assert meta["version"] == D2 and np.all(gone % np.uint64(2) == 0)
    # For every key: the value of its latest delta or the base; deleted keys are absent.
    keys, values = _served(cube, D2, 2)
    want_keys, want_values = passes.expected()
    np.testing.assert_array_equal(keys, want_keys)
    np.testing.assert_array_equal(values, want_values)
    assert len(passes.gone - set(int(k) for k in keys)) == len(passes.gone) - 4  # re-added keys are back
    # Compaction folds the chain into a full copy with the same content.
    c = compact_version(cube_root=cube, version=D2)
    assert c["kind"] == "base" and c["rows"] == len(want_keys) and c["compacted_from"] == {"base": BASE, "depth": 2}
    full = [read_shard(cube / D2 / "compacted" / f"shard-{i}.arrow") for i in range(2)]
    got = np.concatenate([f.keys for f in full])
    np.testing.assert_array_equal(np.sort(got), want_keys)
    # A later delta's chain on disk starts at the compacted copy.
    passes.delta(D3, change=5, add=1, delete=1, seed=3)
    build_version(pass_dir=tmp_path / "models" / D3, shards=2, output=cube)
    shutil.rmtree(cube / D1)  # not needed any more: D3 = D2's compacted copy + D3
    keys, values = _served(cube, D3, 2)
    want_keys, want_values = passes.expected()
    np.testing.assert_array_equal(keys, want_keys)
    np.testing.assert_array_equal(values, want_values)
    assert json.loads((cube / D3 / "manifest.json").read_text())["depth"] == 3


class Fleet:
    """A file server and two shards (server + agent each, restartable, the server with 2 workers on shard 0)."""

    def __init__(self, root: Path, stack: contextlib.ExitStack):
        self.root, self.stack = root, stack
        self.fs_url = stack.enter_context(fileserver(root / "fileserver"))
        self.ports = [free_port() for _ in range(2)]
        self.agent_ports = [free_port() for _ in range(2)]
        self.servers = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.pods: list[contextlib.ExitStack | None] = [None, None]
        self.agents: list[str] = ["", ""]
        for i in range(2):
            self.start(i)

    def data(self, i: int) -> Path:
        return self.root / f"shard-{i}"

    def start(self, i: int, tag: str = "") -> None:
        """Start shard i's pod: its server and its agent (which re-seeds the server if need be)."""
        self.data(i).mkdir(exist_ok=True)
        pod = contextlib.ExitStack()
        args = server_args(self.data(i), i, port=self.ports[i], workers=2 if i == 0 else 1)
        pod.enter_context(cube_process("server", args, self.root, f"server-{i}{tag}"))
        agent = agent_args(self.data(i), i, self.servers[i], self.fs_url, port=self.agent_ports[i])
        self.agents[i] = pod.enter_context(cube_process("agent", agent, self.root, f"agent-{i}{tag}"))[0]
        self.pods[i] = pod
        self.stack.callback(pod.close)

    def kill(self, i: int, *, wipe: bool) -> None:
        self.pods[i].close()
        if wipe:  # an emptyDir: a new pod starts with nothing
            shutil.rmtree(self.data(i))

    def transfer(self, **kw) -> Transfer:
        return Transfer(
            TransferConfig(
                model_path=self.root / "models",
                cube_root=self.root / "built",
                fileserver_url=self.fs_url,
                agents=self.agents,
                token=TOKEN,
                retry=RetryPolicy(attempts=2, backoff=0.1, timeout=30),
                **kw,
            )
        )

    def status(self, i: int) -> dict:
        return requests.get(f"{self.servers[i]}/v1/status", timeout=5).json()

    def wait_ready(self, i: int, version: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if requests.get(f"{self.agents[i]}/readyz", timeout=5).status_code == 200:
                    if self.status(i)["active"] == version:
                        return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(requests.get(f"{self.agents[i]}/v1/status", timeout=5).text)
            time.sleep(0.2)


def _check_answers(servers: list[str], passes: DeltaPasses, version: str) -> None:
    """Every key answers its latest value; deleted keys (and a few never seen) are not found."""
    keys, values = passes.expected()
    gone = np.array(sorted(passes.gone - set(passes.lines)), dtype=np.uint64)
    with CubeClient(servers) as c:
        got, found, served = c.lookup(keys)
        assert served == version and found.all()
        np.testing.assert_array_equal(got, values)
        if len(gone):
            got, found, _ = c.lookup(gone)
            assert not found.any() and not got.any()


@pytest.fixture
def fleet(tmp_path):
    with contextlib.ExitStack() as stack:
        yield Fleet(tmp_path, stack)


def test_deltas_ship_alone_and_a_restarted_shard_catches_up_on_base_and_deltas(real_pass, fleet):
    passes = DeltaPasses(real_pass, fleet.root / "models", BASE)
    t = fleet.transfer(keep=2, compact_after=0)
    assert t.poll_once() == BASE, t.last_error
    base_bytes = t.status()[1]["active"]["timings"]["shipped_bytes"]
    _check_answers(fleet.servers, passes, BASE)
    passes.delta(D1, change=40, add=20, delete=30, seed=1)
    assert t.poll_once() == D1, t.last_error
    timings = t.status()[1]["active"]["timings"]
    assert timings["shipped"] == {"0": [D1], "1": [D1]}  # only the delta, on both shards
    assert 0 < timings["shipped_bytes"] < base_bytes / 3
    _check_answers(fleet.servers, passes, D1)
    # Two deltas land before the transfer looks: D2 is built and shipped as part of D3's chain.
    passes.delta(D2, change=30, add=10, delete=20, seed=2, readd=5)
    passes.delta(D3, change=30, add=10, delete=20, seed=3)
    assert t.poll_once() == D3, t.last_error
    snap = t.status()[1]
    assert snap["passes"][D2]["status"] == "superseded"
    assert snap["active"]["timings"]["shipped"] == {"0": [D2, D3], "1": [D2, D3]}
    _check_answers(fleet.servers, passes, D3)
    st = fleet.status(1)
    assert (st["active"], st["previous"]) == (D3, D1) and st["versions"][D3]["kind"] == "delta"
    # GC keeps every version the active and previous chains need (keep=2 would otherwise drop the base).
    built = sorted(p.name for p in (fleet.root / "built").iterdir() if p.name.startswith("pass-"))
    assert built == [BASE, D1, D2, D3]
    # Shard 1's pod is replaced (empty folder): its agent re-seeds it with base + deltas, no transfer needed.
    fleet.kill(1, wipe=True)
    fleet.start(1, tag="-new")
    fleet.wait_ready(1, D3)
    # The server answers with D3 a moment before its agent records the seeding (it activates, then records).
    seeded = _seed_record(fleet.agents[1], D3)
    assert seeded["downloaded"] == [BASE, D1, D2, D3]
    _check_answers(fleet.servers, passes, D3)
    # A restarted server (folder kept) loads its delta versions from disk.
    fleet.kill(0, wipe=False)
    fleet.start(0, tag="-again")
    fleet.wait_ready(0, D3)
    assert requests.get(f"{fleet.agents[0]}/v1/status", timeout=5).json()["last"] == {}  # nothing to fetch
    _check_answers(fleet.servers, passes, D3)
    assert fleet.status(0)["previous"] == D1


def _seed_record(agent: str, version: str) -> dict:
    """The agent's record of seeding its server with ``version`` (waits for it: a few ms after activation)."""
    deadline = time.monotonic() + 30
    while True:
        last = requests.get(f"{agent}/v1/status", timeout=5).json()["last"]
        if last.get("seeded") == version or time.monotonic() > deadline:
            return last
        time.sleep(0.05)


def test_compaction_gives_new_shards_one_full_copy_and_gc_then_drops_the_old_chain(real_pass, fleet):
    passes = DeltaPasses(real_pass, fleet.root / "models", BASE)
    t = fleet.transfer(keep=2, compact_after=2)
    assert t.poll_once() == BASE
    for name, seed in ((D1, 1), (D2, 2)):
        passes.delta(name, change=30, add=10, delete=10, seed=seed)
        assert t.poll_once() == name, t.last_error
    t.wait_for_compaction(60)
    assert t.compaction["state"] == "done" and t.compaction["deltas"] == 2
    chain = requests.get(f"{fleet.fs_url}/files/cube/{D2}/chain.json", timeout=5).json()["chain"]
    assert [(c["version"], c["kind"], c["path"]) for c in chain] == [(D2, "base", f"cube/{D2}/compacted/")]
    # A new shard starts from the compacted copy alone.
    fleet.kill(1, wipe=True)
    fleet.start(1, tag="-new")
    fleet.wait_ready(1, D2)
    assert _seed_record(fleet.agents[1], D2)["downloaded"] == [D2]
    _check_answers(fleet.servers, passes, D2)
    # The next delta: every shard downloads just it (shard 1 holds D2's compacted copy, shard 0 the chain).
    passes.delta(D3, change=10, add=3, delete=3, seed=3)
    assert t.poll_once() == D3, t.last_error
    assert t.status()[1]["active"]["timings"]["shipped"] == {"0": [D3], "1": [D3]}
    _check_answers(fleet.servers, passes, D3)
    # Once D2 is compacted and no longer previous, BASE and D1 go: every chain still needed starts at D2's
    # compacted copy (shard 0 keeps its own local copies of what its held versions were built from).
    passes.delta("pass-20240101-04", change=10, add=3, delete=3, seed=4)
    assert t.poll_once() == "pass-20240101-04", t.last_error
    built = sorted(p.name for p in (fleet.root / "built").iterdir() if p.name.startswith("pass-"))
    assert built == [D2, D3, "pass-20240101-04"], built
    assert requests.get(f"{fleet.fs_url}/files/cube/{BASE}/manifest.json", timeout=5).status_code == 404
    _check_answers(fleet.servers, passes, "pass-20240101-04")


def test_pinned_versions_stay_loaded_on_every_shard_and_are_kept(real_pass, fleet):
    passes = DeltaPasses(real_pass, fleet.root / "models", BASE)
    t = fleet.transfer(keep=2, compact_after=0)
    assert t.poll_once() == BASE
    base_keys, base_values = passes.expected()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    requests.put(
        f"{fleet.fs_url}/files/cube/pins.json", data=json.dumps({"versions": [BASE]}), headers=auth, timeout=5
    ).raise_for_status()
    for n, name in enumerate((D1, D2, D3)):
        passes.delta(name, change=20, add=5, delete=5, seed=n)
        assert t.poll_once() == name, t.last_error
        assert t.poll_once() is None and t.pins_error is None  # syncs the pins
    for i in range(2):
        st = fleet.status(i)
        assert BASE in st["pinned"] and st["active"] == D3
    with CubeClient(fleet.servers) as c:
        got, found, v = c.lookup(base_keys, BASE)
        assert v == BASE and found.all()
        np.testing.assert_array_equal(got, base_values)
    assert (fleet.root / "built" / BASE).is_dir()
    # A new pod loads the pins as well as the active version.
    fleet.kill(1, wipe=True)
    fleet.start(1, tag="-new")
    fleet.wait_ready(1, D3)
    deadline = time.monotonic() + 30
    while BASE not in fleet.status(1)["pinned"]:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    # Unpinned: the shards let it go.
    requests.put(
        f"{fleet.fs_url}/files/cube/pins.json", data=json.dumps({"versions": []}), headers=auth, timeout=5
    ).raise_for_status()
    assert t.poll_once() is None and t.pins_error is None
    assert all(BASE not in fleet.status(i)["versions"] for i in range(2))
