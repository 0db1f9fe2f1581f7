"""CPU allocator tuning: keep freed large blocks for reuse instead of returning them to the kernel.

glibc's malloc serves blocks above its mmap threshold (at most 32 MiB by default, adapting upwards) with fresh
mmap pages and unmaps them on free, so every training step page-faults its large activation and gradient
buffers in again (measured here: about 100 ms of a 500 ms MoE layer step at 64 experts). Raising the mmap and
trim thresholds makes malloc keep and reuse those blocks, which is what tcmalloc/jemalloc (the usual advice for
PyTorch on CPU) do. It changes no result, only where memory comes from. GPU memory is untouched (PyTorch's CUDA
caching allocator already reuses blocks). ``MEGAMOE_CPU_MALLOC=default`` in the environment leaves glibc alone
(to compare, or where another allocator is preloaded).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False


def retain_freed_memory(threshold_bytes: int = 1 << 30) -> bool:
    """Raise glibc's mmap and trim thresholds (process-wide, idempotent). False where glibc is not the
    allocator (macOS, musl) or refuses the values: nothing changes then."""
    global _done
    if _done:
        return True
    if os.environ.get("MEGAMOE_CPU_MALLOC", "").strip().lower() == "default":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(threshold_bytes)) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(2 * threshold_bytes - 1 if threshold_bytes < 1 << 30 else (1 << 31) - 1)) == 1 and ok
    _done = ok
    return ok
