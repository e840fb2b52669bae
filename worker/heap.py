"""Freed activation memory kept in the process's heap (glibc), for the next pass to reuse.

Torch's CPU allocator takes every tensor from `malloc` and gives it back on free. glibc serves
a block over its mmap threshold (128 KiB at start, raised as large blocks are freed) with a
fresh `mmap`, and returns a free heap top to the system past its trim threshold. A prefill pass
allocates and frees a few MiB per layer, and how much of it glibc keeps depends on the order of
earlier frees: in some runs of `tests/worker/test_heap.py`'s script a cold prompt faults
thousands of pages in again and takes measurably longer.

`retain_freed_memory()` raises the mmap threshold to glibc's maximum (32 MiB) and the trim
threshold to 1 GiB, once per process: a pass then reuses the pages the previous one freed. The
price: the heap keeps its peak (a few passes' activations). Elsewhere than glibc, nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from functools import cache

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit: blocks up to this come from the heap
TRIM_THRESHOLD = 1 << 30  # free heap top kept up to this


@cache
def retain_freed_memory() -> bool:
    """Set the two thresholds (once); True when glibc took them."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc: its own allocator's policy stays
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    if not ok:
        logger.info("mallopt refused the heap thresholds; freed activations go back to the system")
    return ok
