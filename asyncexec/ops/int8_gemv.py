"""int8 weight-only GEMV for steps of 1-4 rows: asyncexec's own C++ kernel (`csrc/int8_gemv.cpp`).

Why not only PyTorch's `aten._weight_int8pack_mm`: on a lone stream every weight is read once a step, so
the int8 GEMM should cost half of bf16's. PyTorch's kernel multiplies every weight by its scale inside
the loop and issues no prefetch far enough ahead; measured on a 2-core AMD EPYC (AVX-512), SmolLM2's 121
layer GEMMs and lm_head at one row, weights from memory: 5.5-6.1 ms with it against 3.1-3.5 ms with
this kernel (`scripts/probe_linear.py` measures both). Same numbers either way, up to float32 rounding
of the sums: products are exact, sums in float32, the scale applied once per output.

Built once per machine at first use (start-up of an int8 or int4 engine), by `ops.build` (inductor's
C++ compiler driver, cached on disk). Where it cannot build (no compiler, no AVX2), int8 steps use
PyTorch's kernel, with a warning that says why; the load-time transform skips it where
`ASYNCEXEC_INT8_GEMV=0` (`asyncexec.envs`, to compare). Called through ctypes, which releases the GIL
while it runs.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch

from asyncexec.ops.build import CSRC, CppKernel

__all__ = ["fits", "int8_gemv", "load", "run"]

logger = logging.getLogger(__name__)

_KERNEL = CppKernel(
    CSRC / "int8_gemv.cpp",
    "int8 GEMV kernel",
    "int8 steps of up to 4 rows use PyTorch's _weight_int8pack_mm, which is slower",
    logger,
)
_fn: Any = None  # the loaded kernel (a ctypes function)
_width = 0  # its vector width in floats: K must be a multiple


def load() -> bool:
    """Build (or load from the disk cache) the kernel, once per process; False where it is unavailable."""
    return _KERNEL.load(_setup) is not None


def _setup(lib: Any) -> Any:
    global _fn, _width
    width = int(lib.asyncexec_int8_gemv_width())
    if width == 0:
        logger.warning("asyncexec's int8 GEMV kernel needs AVX2 or AVX-512; int8 steps use PyTorch's kernel")
        return None
    fn = lib.asyncexec_int8_gemv
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4
    _fn, _width = fn, width
    logger.info("int8 GEMV kernel ready (%d-float vectors)", width)
    return fn


def fits(qweight: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether the kernel serves this weight: loaded, bf16 scales, K a multiple of its vector width."""
    return (
        scales.dtype == torch.bfloat16
        and qweight.is_contiguous()
        and scales.is_contiguous()
        and load()
        and qweight.shape[1] % _width == 0
    )


def int8_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`aten._weight_int8pack_mm(x, qweight, scales)` for 1-4 rows of bf16 `x` [M, K], checked (`fits`
    first)."""
    assert _fn is not None, "int8_gemv.load() first"
    m, k = x.shape
    n = qweight.shape[0]
    if not (1 <= m <= 4 and x.dtype == scales.dtype == torch.bfloat16 and qweight.dtype == torch.int8):
        raise ValueError(f"int8_gemv takes 1-4 bf16 rows and int8 weights, got {tuple(x.shape)} {x.dtype}")
    if qweight.shape[1] != k or scales.shape != (n,):
        raise ValueError(f"int8_gemv: x {tuple(x.shape)}, weight {tuple(qweight.shape)}, scales "
                         f"{tuple(scales.shape)} do not fit")  # fmt: skip
    return run(x.contiguous(), qweight, scales)


def run(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The call without `int8_gemv`'s checks, for the hot path: operands that `fits` admitted at load,
    1-4 contiguous bf16 rows (the checks cost about as much as the call's own overhead)."""
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype)
    rc = _fn(
        x.data_ptr(), qweight.data_ptr(), scales.data_ptr(), y.data_ptr(), m, n, k, torch.get_num_threads()
    )
    if rc != 0:
        raise RuntimeError(f"int8_gemv kernel failed with code {rc} (x {tuple(x.shape)}, width {_width})")
    return y
