"""Compiled kernels (numba) for the hot loops numpy cannot express as a few passes: one policy for all.

``compiled(func)`` or ``compiled(signature)(func)``: numba's ``njit`` without the GIL (so threads parse or
look up in parallel), its machine code cached on disk when a cache folder is writable (numba's rule:
``NUMBA_CACHE_DIR``, else beside the module, else the user's cache folder; the image sets
``NUMBA_CACHE_DIR=/tmp/numba``, so a pod compiles once), and compiled anew in each process when none is
(a read-only install without ``NUMBA_CACHE_DIR``: numba then refuses to cache, and the kernel must still
work). Users: the training reader's byte parse (``elastic_control/data/byte_scan.py``), cube-server's
small-batch lookup (``cube/lookup_kernel.py``) and serving's hot-key cache read
(``elastic_control/serving/cache_kernel.py``).
"""

from __future__ import annotations

from numba import njit


def compiled(func_or_signature):
    """Decorate a kernel: ``@compiled`` (typed at its first call) or ``@compiled(signature)`` (compiled
    or loaded from the cache when the decorated module is imported)."""
    if callable(func_or_signature):  # a signature is not
        return _compile(func_or_signature, ())
    return lambda func: _compile(func, (func_or_signature,))


def _compile(func, signature: tuple):
    try:
        return njit(*signature, nogil=True, cache=True)(func)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return njit(*signature, nogil=True)(func)
