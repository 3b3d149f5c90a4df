"""Compiled kernels (numba) for the hot loops numpy cannot express as a few passes: one policy for all.

``compiled(func)`` or ``compiled(signature)(func)``: numba's ``njit`` without the GIL (so threads parse or
look up in parallel), its machine code cached on disk when a cache folder is writable (numba's rule:
``NUMBA_CACHE_DIR``, else beside the module, else the user's cache folder; the image sets
``NUMBA_CACHE_DIR=/tmp/numba``, so a pod compiles once), and compiled anew in each process when none is
(a read-only install without ``NUMBA_CACHE_DIR``: numba then refuses to cache, and the kernel must still
work). The image also carries its kernels compiled when it was built (``ELASTIC_CTR_NUMBA_SEED``,
``python -m elastic_control.kube.kernel_cache``): a pod's first kernel copies them into its absent
``NUMBA_CACHE_DIR``, so the pod loads them instead of compiling. Users: the training reader's byte parse
(``elastic_control/data/byte_scan.py``), cube-server's small-batch lookup (``cube/lookup_kernel.py``), the
KeyBatch of one key a cell (``elastic_control/inference/key_kernel.py``), and serving's hot-key cache read
and request body scan (``elastic_control/serving/cache_kernel.py``, ``body_scan.py``).
"""

from __future__ import annotations

import os
import shutil
import tempfile

from numba import njit

from ctr_foundation import env_vars

_seed_checked = False


def compiled(func_or_signature):
    """Decorate a kernel: ``@compiled`` (typed at its first call) or ``@compiled(signature)`` (compiled
    or loaded from the cache when the decorated module is imported)."""
    if callable(func_or_signature):  # a signature is not
        return _compile(func_or_signature, ())
    return lambda func: _compile(func, (func_or_signature,))


def _compile(func, signature: tuple):
    _seed_cache_once()
    try:
        return njit(*signature, nogil=True, cache=True)(func)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return njit(*signature, nogil=True)(func)


def _seed_cache_once() -> None:
    """Copy the image's compiled kernels (ELASTIC_CTR_NUMBA_SEED) into NUMBA_CACHE_DIR when that folder does
    not exist yet: a fresh pod then loads them (0.3 s) instead of compiling them (3-4 s of CPU for the
    reader's parse alone). numba caches only in a folder it can write, and the image's own files are
    read-only in a pod, hence a copy rather than pointing numba at the seed. The copy lands whole or not at
    all (built beside the target, then renamed); a process that loses the race to another keeps the other's.
    Machine code compiled for another CPU is not used: numba checks, compiles and caches anew."""
    global _seed_checked
    if _seed_checked:
        return
    _seed_checked = True
    seed, target = env_vars.NUMBA_SEED.get(), os.environ.get("NUMBA_CACHE_DIR")
    if not seed or not target or not os.path.isdir(seed) or os.path.exists(target):
        return
    staging = None
    try:
        parent = os.path.dirname(os.path.abspath(target))
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".numba-seed-", dir=parent)
        shutil.copytree(seed, staging, dirs_exist_ok=True)
        os.rename(staging, target)
    except OSError:  # another process's copy landed first, or no room: the kernels compile as without a seed
        if staging:
            shutil.rmtree(staging, ignore_errors=True)
