"""ctr_foundation/compiled.py: the one policy for numba kernels (the reader's byte parse, cube's lookup)."""

from __future__ import annotations

import numba.core.dispatcher
import pytest
from numba import types

from ctr_foundation.compiled import compiled


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
