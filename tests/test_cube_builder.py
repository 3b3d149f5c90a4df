"""cube-builder, the shard file format, the fast table reader and the lookup index (no servers)."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
from helpers_common import PYTHON, REPO
from helpers_cube import write_synthetic_pass

from ctr_foundation.errors import DataError, UsageError
from ctr_foundation.pass_format import SparseLayout, iter_sparse_table, load_pass, read_sparse_table
from ctr_foundation.sparse_table_reader import iter_sparse_table_fast
from cube.builder import build_version
from cube.lookup_index import COMPILED_MAX_KEYS, ShardIndex
from cube.shard_format import CorruptShardError, read_shard, verify_version_dir, write_shard


def _concat(chunks):
    chunks = list(chunks)
    return np.concatenate([c[0] for c in chunks]), np.concatenate([c[1] for c in chunks])


@pytest.fixture(scope="module")
def real_pass(synth_world):
    """A pass `elastic-control train` wrote (full 64-bit feasigns, no SPARSE_DIM)."""
    return synth_world.passes[0]


def test_fast_reader_agrees_with_pass_format_on_a_real_paddle_table(real_pass):
    # The layout meta.json declares; both readers check every line's column count against it.
    layout = load_pass(real_pass).layout
    k1, v1 = _concat(iter_sparse_table(real_pass, layout))
    k2, v2 = _concat(iter_sparse_table_fast(real_pass, layout))
    o1, o2 = np.argsort(k1), np.argsort(k2)
    assert len(k1) > 100
    np.testing.assert_array_equal(k1[o1], k2[o2])
    np.testing.assert_array_equal(v1[o1], v2[o2])
    assert (k1 > np.uint64(2**63)).any(), "the fixture must exercise keys above 2**63"


@pytest.mark.parametrize("optimizer", ["adam", "adagrad", "naive"])
def test_fast_reader_agrees_on_synthetic_layouts_and_signed_key_text(tmp_path, optimizer):
    rng = np.random.default_rng(1)
    keys = rng.integers(0, 2**64 - 1, size=300, dtype=np.uint64, endpoint=True)
    values = rng.standard_normal((300, 5)).astype(np.float32)
    p = write_synthetic_pass(tmp_path / "pass-20240101-00", keys, values, optimizer=optimizer)
    # One part written with int64 (signed) key text: both readers must keep the bits.
    import gzip

    part = p / "sparse" / "000" / "part-000.gz"
    lines = gzip.open(part, "rt").read().splitlines()
    signed = [" ".join([str(np.uint64(int(ln.split()[0])).view(np.int64)), *ln.split()[1:]]) for ln in lines]
    with gzip.open(part, "wt") as f:
        f.write("\n".join(signed) + "\n")
    layout = SparseLayout(5, optimizer)
    k1, v1 = _concat(iter_sparse_table(p, layout))
    k2, v2 = _concat(iter_sparse_table_fast(p, layout))
    np.testing.assert_array_equal(np.sort(k1), np.sort(keys))
    np.testing.assert_array_equal(k1[np.argsort(k1)], k2[np.argsort(k2)])
    np.testing.assert_array_equal(v1[np.argsort(k1)], v2[np.argsort(k2)])


def test_fast_reader_names_the_file_on_a_wrong_column_count(tmp_path):
    keys = np.arange(1, 11, dtype=np.uint64)
    p = write_synthetic_pass(tmp_path / "pass-20240101-00", keys, np.ones((10, 4), np.float32), optimizer="adam")
    with pytest.raises(DataError, match=r"part-00\d\.gz.*expected"):
        list(iter_sparse_table_fast(p, SparseLayout(4, "adagrad")))


def test_build_real_pass_shards_sorted_unique_with_exact_vectors(real_pass, tmp_path):
    info = load_pass(real_pass)
    manifest = build_version(pass_dir=real_pass, shards=3, output=tmp_path / "cube")
    keys, values = read_sparse_table(real_pass, info.layout)
    dim = info.embedding_dim
    vdir = tmp_path / "cube" / info.name
    assert manifest == verify_version_dir(vdir)
    assert manifest["rows"] == len(keys) and manifest["dim"] == dim and manifest["shards"] == 3
    seen = 0
    for i in range(3):
        s = read_shard(vdir / f"shard-{i}.arrow")
        assert (s.shard, s.shards, s.dim, s.version) == (i, 3, dim, info.name)
        assert np.all(s.keys[1:] > s.keys[:-1]) and np.all(s.keys % np.uint64(3) == i)
        idx = np.searchsorted(keys, s.keys)
        np.testing.assert_array_equal(keys[idx], s.keys)
        np.testing.assert_array_equal(values[idx], s.values)
        seen += s.rows
    assert seen == len(keys)


def test_build_is_deterministic_applies_sparse_dim_and_keeps_the_last_duplicate(tmp_path):
    keys = np.array([5, 1005, 7, 12, 1012], dtype=np.uint64)  # with sparse_dim 1000: 5, 5, 7, 12, 12
    values = np.arange(5 * 3, dtype=np.float32).reshape(5, 3)
    p = write_synthetic_pass(tmp_path / "pass-20240101-05", keys, values, sparse_dim=1000, parts=1)
    m1 = build_version(pass_dir=p, shards=2, output=tmp_path / "a")
    m2 = build_version(pass_dir=p, shards=2, output=tmp_path / "b")
    for name in m1["files"]:
        assert (tmp_path / "a" / m1["version"] / name).read_bytes() == (
            tmp_path / "b" / m2["version"] / name
        ).read_bytes()
    assert m1["rows"] == 3 and m1["input_rows"] == 5
    s1 = read_shard(tmp_path / "a" / "pass-20240101-05" / "shard-1.arrow")
    np.testing.assert_array_equal(s1.keys, [5, 7])
    np.testing.assert_array_equal(s1.values[0], values[1])  # the later line of key 5 wins
    with pytest.raises(UsageError, match="already exists"):
        build_version(pass_dir=p, shards=2, output=tmp_path / "a")


def test_truncated_or_corrupt_shard_files_are_refused(tmp_path):
    keys = np.arange(0, 4000, 3, dtype=np.uint64)
    p = write_synthetic_pass(tmp_path / "pass-20240101-00", keys, np.ones((len(keys), 4), np.float32))
    build_version(pass_dir=p, shards=1, output=tmp_path / "cube")
    vdir = tmp_path / "cube" / "pass-20240101-00"
    shard = vdir / "shard-0.arrow"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptShardError):
        read_shard(shard)
    with pytest.raises(CorruptShardError, match="size"):
        verify_version_dir(vdir)
    flipped = bytearray(data)
    flipped[len(data) // 3] ^= 0xFF
    shard.write_bytes(bytes(flipped))
    with pytest.raises(CorruptShardError, match="sha256"):
        verify_version_dir(vdir)
    bad = tmp_path / "unsorted.arrow"
    write_shard(bad, np.array([3, 1], np.uint64), np.zeros((2, 2), np.float32), version="v", shard=0, shards=1)
    with pytest.raises(CorruptShardError, match="sorted"):
        read_shard(bad)


@pytest.mark.parametrize(
    "keys",
    [
        np.random.default_rng(0).integers(0, 2**64 - 1, 50_000, dtype=np.uint64, endpoint=True),
        np.arange(0, 300_000, 7, dtype=np.uint64),  # small keys (feasign % SPARSE_DIM)
        np.array([0, 1, 2**64 - 1], dtype=np.uint64),  # extremes
        np.array([42], dtype=np.uint64),
    ],
)
def test_lookup_index_matches_a_plain_set_lookup(tmp_path, keys):
    keys = np.unique(keys)
    values = np.random.default_rng(1).standard_normal((len(keys), 3)).astype(np.float32)
    write_shard(tmp_path / "s.arrow", keys, values, version="v", shard=0, shards=1)
    index = ShardIndex(read_shard(tmp_path / "s.arrow"))
    rng = np.random.default_rng(2)
    query = np.concatenate(
        [
            keys[rng.integers(0, len(keys), 5000)],
            keys[:3],
            keys[-3:],
            rng.integers(0, 2**64 - 1, 3000, dtype=np.uint64, endpoint=True),
            keys[:100] + np.uint64(1),
            np.array([0, 2**64 - 1], np.uint64),
        ]
    )
    got, found = index.lookup(query)
    expect_found = np.isin(query, keys)
    np.testing.assert_array_equal(found, expect_found)
    pos = np.searchsorted(keys, query[found])
    np.testing.assert_array_equal(got[found], values[pos])
    assert not got[~found].any()
    # Small batches take the compiled pass (up to COMPILED_MAX_KEYS): same answers.
    for size in (1, 26, COMPILED_MAX_KEYS, COMPILED_MAX_KEYS + 1):
        for at in range(0, len(query), 997):
            part = query[at : at + size]
            got_part, found_part = index.lookup(part)
            np.testing.assert_array_equal(found_part, expect_found[at : at + size])
            np.testing.assert_array_equal(got_part, got[at : at + size])
    rows, found_rows = index.lookup_rows(query[:26])
    assert rows.dtype == np.uint8 and rows.shape == (min(26, len(query)), 4 * 3)
    np.testing.assert_array_equal(rows.view(np.float32), got[:26])


def test_builder_cli_reports_errors_in_one_line(tmp_path):
    r = subprocess.run(
        [
            PYTHON,
            "-m",
            "cube.builder",
            "--model",
            str(tmp_path / "nope"),
            "--shards",
            "2",
            "--output",
            str(tmp_path / "out"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "meta.json is missing" in r.stderr
    r = subprocess.run(
        [PYTHON, "-m", "cube.builder", "--model", str(tmp_path), "--shards", "0", "--output", str(tmp_path / "out")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "--shards 0" in r.stderr and "Traceback" not in r.stderr


def test_the_manifest_names_its_source_pass_without_host_paths(tmp_path):
    from elastic_control.serving.versions import _record_from_manifest

    keys = np.arange(1, 41, dtype=np.uint64)
    values = np.ones((40, 3), np.float32)
    built = []
    for host in ("host-a", "host-b"):  # the same pass in two places builds the same manifest
        p = write_synthetic_pass(tmp_path / host / "models" / "pass-20240101-07", keys, values, parts=1)
        build_version(pass_dir=p, shards=2, output=tmp_path / host / "cube")
        built.append((tmp_path / host / "cube" / "pass-20240101-07" / "manifest.json").read_text())
    assert str(tmp_path) not in built[0]
    assert built[0] == built[1]
    manifest = json.loads(built[0])
    assert manifest["source_pass"] == {"name": "pass-20240101-07", "path": "pass-20240101-07"}
    # serving reads the pass's name from it, and from the manifests written before (absolute path, or a bare name)
    assert _record_from_manifest("pass-20240101-07", manifest).pass_name == "pass-20240101-07"
    old = {**manifest, "source_pass": {"name": "pass-20240101-06", "path": "/srv/models/pass-20240101-06"}}
    assert _record_from_manifest("v", old).pass_name == "pass-20240101-06"
    assert _record_from_manifest("v", {**manifest, "source_pass": "pass-20240101-05"}).pass_name == "pass-20240101-05"
    assert _record_from_manifest("v", {**manifest, "source_pass": None}).pass_name == "v"
