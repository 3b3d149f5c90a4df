"""ctr_foundation/compiled.py: the one policy for numba kernels (the reader's byte parse, cube's lookup), and the
image's kernels compiled when it is built."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numba.core.dispatcher
import pytest
from numba import types

from ctr_foundation.compiled import compiled

REPO = Path(__file__).resolve().parents[1]


def _add(a, b):
    return a + b


@pytest.mark.parametrize("signature", [None, types.int64(types.int64, types.int64)])
def test_without_a_writable_cache_folder_a_kernel_is_compiled_in_the_process(monkeypatch, signature):
    """A read-only install without NUMBA_CACHE_DIR (numba then finds no folder for its cache and refuses to
    cache): the kernel still works, compiled anew by each process."""

    def no_locator(py_func):
        raise RuntimeError(f"cannot cache function {py_func.__name__!r}: no locator available for file 'x'")

    monkeypatch.setattr(numba.core.dispatcher, "FunctionCache", no_locator)
    kernel = compiled(_add) if signature is None else compiled(signature)(_add)
    assert kernel(2, 3) == 5 and kernel._cache.__class__.__name__ == "NullCache"
    assert kernel.signatures == [(types.int64, types.int64)]


def test_with_a_cache_folder_a_kernel_keeps_its_machine_code(monkeypatch, tmp_path):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    numba.config.reload_config()
    try:
        kernel = compiled(types.int64(types.int64, types.int64))(_add)
        assert kernel(2, 3) == 5 and kernel._cache.__class__.__name__ == "FunctionCache"
        assert list(tmp_path.rglob("*.nbi")), "no index written to the cache folder"
    finally:
        monkeypatch.delenv("NUMBA_CACHE_DIR")
        numba.config.reload_config()


_KERNEL_MODULE = """
from numba import types
from ctr_foundation.compiled import compiled

@compiled(types.int64(types.int64))
def plus_one(x):
    return x + 1
"""

_REPORT = "import json, k; print(json.dumps([k.plus_one(1), sum(k.plus_one.stats.cache_hits.values())]))"


def _run(tmp_path, **env):
    """A fresh process importing the kernel module in ``tmp_path``: [plus_one(1), its cache hits]."""
    full = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]), **env}
    full = {k: v for k, v in full.items() if v is not None}
    out = subprocess.run([sys.executable, "-c", _REPORT], env=full, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_a_pod_loads_the_kernels_compiled_into_the_image(tmp_path):
    """The image's seed (ELASTIC_CTR_NUMBA_SEED) copied into an absent NUMBA_CACHE_DIR: the fresh process
    loads the kernel instead of compiling it; without the seed it compiles (no cache hit)."""
    (tmp_path / "k.py").write_text(_KERNEL_MODULE)
    seed, pod = tmp_path / "seed", tmp_path / "pod" / "numba"
    assert _run(tmp_path, NUMBA_CACHE_DIR=str(seed), ELASTIC_CTR_NUMBA_SEED=None) == [2, 0]
    assert list(seed.rglob("*.nbi")), "the seed holds no compiled kernel"
    assert _run(tmp_path, NUMBA_CACHE_DIR=str(pod), ELASTIC_CTR_NUMBA_SEED=str(seed)) == [2, 1]
    assert sorted(p.name for p in pod.rglob("*")) == sorted(p.name for p in seed.rglob("*"))
    assert not list(pod.parent.glob(".numba-seed-*")), "a staging folder was left behind"
    # Without a seed a fresh cache folder means compiling.
    assert _run(tmp_path, NUMBA_CACHE_DIR=str(tmp_path / "other"), ELASTIC_CTR_NUMBA_SEED=None) == [2, 0]


def test_a_cache_folder_that_exists_is_not_replaced_by_the_seed(tmp_path):
    (tmp_path / "k.py").write_text(_KERNEL_MODULE)
    seed, pod = tmp_path / "seed", tmp_path / "pod"
    _run(tmp_path, NUMBA_CACHE_DIR=str(seed), ELASTIC_CTR_NUMBA_SEED=None)
    pod.mkdir()
    (pod / "mine").write_text("kept")
    assert _run(tmp_path, NUMBA_CACHE_DIR=str(pod), ELASTIC_CTR_NUMBA_SEED=str(seed)) == [2, 0]
    assert (pod / "mine").read_text() == "kept"
