"""glibc's heap, tuned for an engine: freed memory handed back, step buffers kept.

A build lets go of large tensors (released weights, the panels a fusion replaces, the
temporaries of packing) that glibc's heap would otherwise keep in the process's RSS until it
ends; a step allocates and frees the same buffers every time. Both are glibc calls (malloc_trim,
mallopt), made through ctypes; elsewhere they do nothing.
"""

from __future__ import annotations

import ctypes


def _call_glibc(name: str, *args: int) -> None:
    """Calls glibc's malloc tuning function `name`; a no-op where there is no glibc."""
    try:
        getattr(ctypes.CDLL("libc.so.6"), name)(*args)
    except (OSError, AttributeError):
        pass


def return_freed_memory() -> None:
    """Hands memory freed inside glibc's heap back to the system (malloc_trim), so that what a
    build lets go of (released weights, the panels a fusion replaces, temporaries) does not
    stay in the process's RSS. A no-op without glibc."""
    _call_glibc("malloc_trim", 0)


# glibc's mallopt parameter and the value keep_step_buffers sets
_M_MMAP_THRESHOLD = -3
STEP_BUFFER_BYTES = 256 << 20


def keep_step_buffers() -> None:
    """Has glibc serve allocations of up to 256 MiB from its heap instead of a fresh mmap each.
    A step's temporaries (a 64-row step: about 1 MB per product output; logits and prefill
    chunks: tens of MB) are freed and allocated again every step; as separate mappings each
    comes back from the kernel as newly zeroed pages. Batch 64, 2 threads: 451-457 -> 471-485
    tokens/s (a smaller threshold, 32 MiB, did not help). Process-wide; a no-op without glibc."""
    _call_glibc("mallopt", _M_MMAP_THRESHOLD, STEP_BUFFER_BYTES)
