"""asyncexec's own C++ kernels (`int8_gemv.cpp`, `paged_decode.cpp`): built once per machine at first use.

Built through inductor's C++ compiler driver (`torch._inductor.codecache.CppCodeCache`): it picks this
CPU's vector flags (CPU_CAPABILITY_AVX512 or _AVX2), puts torch's headers on the include path (ATen's
vector types, c10's BFloat16), links torch's OpenMP, and caches the library on disk under the compile
cache folder (`cpu_graph.compile_cache_dir`), keyed by source and flags: 1-10 s cold, then a cache hit.
The libraries export plain C functions, called through ctypes (which releases the GIL while they run).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

__all__ = ["build"]


def build(source: Path, what: str, fallback: str, logger: logging.Logger) -> Any | None:
    """The loaded library of `source` (a ctypes CDLL), or None with a warning that names the error and
    `fallback`, what runs instead."""
    from torch._inductor.codecache import CppCodeCache

    from asyncexec.worker.cpu_graph import compile_cache_dir

    compile_cache_dir()  # the libraries live next to the compiled decode graphs
    start = time.perf_counter()
    try:
        lib = CppCodeCache.load(source.read_text())
    except Exception as e:  # any build failure leaves the fallback, said once
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        logger.warning("could not build asyncexec's %s (%s: %s); %s", what, type(e).__name__, first, fallback)
        return None
    logger.debug("%s built or loaded in %.1f s", what, time.perf_counter() - start)
    return lib
