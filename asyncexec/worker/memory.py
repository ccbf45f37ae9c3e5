"""The worker process's own memory: what it gives back to the OS after its start-up."""

from __future__ import annotations

import contextlib
import ctypes

__all__ = ["trim_heap"]


def trim_heap() -> None:
    """Give the C heap's free pages back to the OS. glibc keeps freed memory for reuse, so a load whose
    peak (bf16 weights, a calibration forward, packing) was freed still counted as resident; `malloc_trim`
    returns it. A no-op where the C library has no `malloc_trim`."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)
