"""Make freed tensor memory go back to the OS at once (glibc), so RSS follows the memory account.

glibc raises its mmap threshold dynamically after large frees; later tensor allocations then come from the
heap, and freed fragments stay resident as heap fragmentation. Pinning the threshold keeps every tensor
above 128 KiB in its own mapping, returned to the OS when freed (a swapped-out fragment really frees).
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3
_done = False


def pin_mmap_threshold(nbytes: int = 128 * 1024) -> bool:
    global _done
    if _done:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _done = bool(libc.mallopt(M_MMAP_THRESHOLD, nbytes))
    except (OSError, AttributeError):  # not glibc: nothing to do
        _done = False
    return _done
