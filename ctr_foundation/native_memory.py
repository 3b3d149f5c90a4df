"""The C allocator's behaviour where it matters (glibc's ``mallopt`` and ``malloc_trim``; elsewhere nothing)."""

from __future__ import annotations

import ctypes
import functools

_M_TOP_PAD = -2  # glibc's mallopt parameter numbers
_M_MMAP_THRESHOLD = -3


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except (OSError, TypeError):
        return None


def keep_heap_top(nbytes: int) -> None:
    """Have the allocator keep ``nbytes`` of freed memory at the top of the heap for the next allocations
    (M_TOP_PAD) instead of giving it back to the kernel and faulting it in again."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_TOP_PAD, nbytes)


def allocate_from_heap_below(nbytes: int) -> None:
    """Have the allocator serve blocks below ``nbytes`` from the heap, reused once freed, rather than from
    fresh mappings that are faulted in page by page (M_MMAP_THRESHOLD). glibc raises this threshold by
    itself up to 32 MB as large blocks are freed, but not once ``keep_heap_top`` (or any other mallopt
    setting) has been made."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, nbytes)


def give_back_freed_memory() -> None:
    """Return the free pages of every malloc arena to the kernel (``malloc_trim(0)``): glibc returns only the
    top of the main heap by itself, so memory freed in the middle of an arena stays in the RSS."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
