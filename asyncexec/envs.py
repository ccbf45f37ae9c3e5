"""Every environment variable asyncexec reads, in one place (vLLM's `envs.py`).

Settings of an engine belong in `EngineConfig`; these are the process-wide knobs, read where a decision
is made at start-up or load, never on a step's path:

- `ASYNCEXEC_INT8_GEMV=0`: int8 weights run PyTorch's kernels instead of asyncexec's own (`ops/int8_gemm.py`
  on AVX-512 VNNI, every step, no dense copy; else `ops/int8_gemv.py` for steps of 1-4 rows and a dense
  copy above): PyTorch's `_weight_int8pack_mm` for 1-4 rows, a dense copy above, to compare
  (`scripts/_bench_single.py` does). Read by the load-time transform (`quantization/pack.py`).
- `ASYNCEXEC_PAGED_DECODE=0`: graph-mode decode attention runs the inductor-compiled loop instead of
  asyncexec's C++ kernel (`ops/paged_decode.py`). Read by the CPU graph runner when it compiles.
- `ASYNCEXEC_API_KEY`: the server's API key where `--api-key` is not given (`asyncexec serve`).
- `XDG_CACHE_HOME`: the root of asyncexec's caches (`asyncexec/torch-compile`, the compiled graphs and
  kernels; `asyncexec/scale`, the scale benchmark's models), else `~/.cache`.
- `TORCHINDUCTOR_CACHE_DIR`: where inductor keeps compiled graphs and asyncexec's kernels; where unset,
  asyncexec sets it to its own folder (`ops.build.compile_cache_dir`, which says why).
- `CXX`: the C++ compiler inductor uses for graph mode and the kernels; without a working one, graph mode
  falls back to eager with a warning.
"""

from __future__ import annotations

import os

__all__ = ["api_key", "int8_gemv_enabled", "paged_decode_enabled"]


def int8_gemv_enabled() -> bool:
    """Whether int8 weights may use asyncexec's own kernels (`ASYNCEXEC_INT8_GEMV`, default 1)."""
    return os.environ.get("ASYNCEXEC_INT8_GEMV", "1") != "0"


def paged_decode_enabled() -> bool:
    """Whether decode attention may use asyncexec's C++ kernel (`ASYNCEXEC_PAGED_DECODE`, default 1)."""
    return os.environ.get("ASYNCEXEC_PAGED_DECODE", "1") != "0"


def api_key() -> str | None:
    """`ASYNCEXEC_API_KEY`, or None where it is unset or empty."""
    return os.environ.get("ASYNCEXEC_API_KEY") or None
