"""int8 GEMM for steps of more than `INT8_MAX_ROWS` rows: asyncexec's C++ kernel on AVX-512 VNNI
(`csrc/int8_gemm.cpp`), so an int8 model keeps no dense copy of its weights.

The activations are quantized inside the kernel (dynamic, symmetric, one scale per row and group of
`GROUP` inputs), after the division by int8's activation-aware input scales, and multiplied with the
int8 weights in int32 (W8A8, as vLLM's and SGLang's CPU backends run int8; per group as llama.cpp's
int8 dot products, which kept SmolLM2's argmax where one scale per row did not). Where the kernel is
unavailable (no AVX-512 VNNI, no compiler) the load-time transform keeps a dense copy for steps of more
than `INT8_MAX_ROWS` rows, as before.

Built once per machine at first use by `ops.build`; called through ctypes, which releases the GIL.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch

from asyncexec.ops.build import CSRC, CppKernel

__all__ = ["GROUP", "fits", "int8_gemm", "load", "pack", "run"]

logger = logging.getLogger(__name__)

GROUP = 32  # inputs per activation scale (the kernel's kGroup)

_KERNEL = CppKernel(
    CSRC / "int8_gemm.cpp",
    "int8 GEMM kernel",
    "int8 steps of more than a few rows use a dense copy of the weights",
    logger,
)
_fn: Any = None


def load() -> bool:
    """Build (or load from the disk cache) the kernel, once per process; False where it is unavailable."""
    global _fn
    _fn = _KERNEL.load_function(
        "asyncexec_int8_gemm",
        [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4,
        "no AVX-512 VNNI on this CPU: int8 steps of more than a few rows use a dense copy",
    )
    return _fn is not None


def fits(qweight: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether the kernel serves this [N, K] weight: loaded, bf16 scales, N in blocks of 16 channels, K
    in groups of `GROUP` inputs."""
    n, k = qweight.shape
    return scales.dtype == torch.bfloat16 and n % 16 == 0 and k % GROUP == 0 and load()


def pack(qweight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's form of an int8 [N, K] weight: blocked [N / 16, K / 4, 16, 4] (the same bytes), and
    each group's sum of weights per output channel (int32 [K / GROUP, N])."""
    n, k = qweight.shape
    blocked = qweight.reshape(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    wsum = qweight.reshape(n, k // GROUP, GROUP).sum(dim=2, dtype=torch.int32).t().contiguous()
    return blocked, wsum


def int8_gemm(
    x: torch.Tensor,
    blocked: torch.Tensor,
    wsum: torch.Tensor,
    scales: torch.Tensor,
    inv_s: torch.Tensor | None = None,
) -> torch.Tensor:
    """`(x * inv_s) @ (qweight * scales).T` with `x` quantized to int8 (per row and `GROUP`): bf16
    [M, K] in, bf16 [M, N] out; `blocked, wsum = pack(qweight)`; `inv_s` [K] (bf16) the inverses of
    the activation-aware input scales, or None. Checked (`fits` first)."""
    assert _fn is not None, "int8_gemm.load() first"
    k = x.shape[1]
    n = blocked.shape[0] * 16
    if not (x.dtype == scales.dtype == torch.bfloat16 and blocked.dtype == torch.int8):
        raise ValueError(f"int8_gemm takes bf16 rows and int8 weights, got {x.dtype} and {blocked.dtype}")
    shapes_fit = (
        blocked.shape[1:] == (k // 4, 16, 4) and scales.shape == (n,) and wsum.shape == (k // GROUP, n)
    )
    if not shapes_fit or wsum.dtype != torch.int32:
        raise ValueError(f"int8_gemm: x {tuple(x.shape)}, weight {tuple(blocked.shape)}, scales "
                         f"{tuple(scales.shape)}, sums {tuple(wsum.shape)} do not fit")  # fmt: skip
    if inv_s is not None and (inv_s.shape != (k,) or inv_s.dtype != torch.bfloat16):
        raise ValueError(f"int8_gemm: inv_s must be bf16 [{k}], got {inv_s.dtype} {tuple(inv_s.shape)}")
    return run(x.contiguous(), blocked, wsum, scales, inv_s)


def run(
    x: torch.Tensor,
    blocked: torch.Tensor,
    wsum: torch.Tensor,
    scales: torch.Tensor,
    inv_s: torch.Tensor | None,
) -> torch.Tensor:
    """The call without `int8_gemm`'s checks, for the hot path (operands `fits` admitted at load)."""
    m, k = x.shape
    n = wsum.shape[1]
    y = torch.empty(m, n, dtype=x.dtype)
    if m == 0:
        return y
    rc = _fn(
        x.data_ptr(),
        None if inv_s is None else inv_s.data_ptr(),
        blocked.data_ptr(),
        wsum.data_ptr(),
        scales.data_ptr(),
        y.data_ptr(),
        m,
        n,
        k,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"int8_gemm kernel failed with code {rc} (x {tuple(x.shape)})")
    return y
