"""int4 GEMM for every step: asyncexec's C++ kernel on AVX-512 VNNI (`csrc/int4_gemm.cpp`), so an int4
model keeps one 4-bit copy of its weights and no dense one.

The weights are llama.cpp's Q4_1 blocks (`w = q * d + mn`, codes 0-15, a bf16 scale `d` and minimum `mn`
per output channel and group of `GROUP` inputs); the activations are quantized inside the kernel as the
int8 GEMM's are (dynamic, symmetric, one scale per row and group of `GROUP` inputs: W4A8, as llama.cpp
multiplies Q4_1 weights with Q8_1 activations). Where the kernel is unavailable (no AVX-512 VNNI, no
compiler) int4 runs PyTorch's `_weight_int4pack_mm_for_cpu` for a few rows and a dense copy above, as
before (`quantization.pack`).

Built once per machine at first use by `ops.build`; called through ctypes, which releases the GIL.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch

from asyncexec.ops.build import CSRC, CppKernel
from asyncexec.ops.int8_gemm import SCALE_DTYPES

__all__ = ["GROUP", "fits", "int4_gemm", "load", "pack", "run", "unpack"]

logger = logging.getLogger(__name__)

GROUP = 32  # inputs per weight scale and minimum, and per activation scale (the kernel's kGroup)

_KERNEL = CppKernel(
    CSRC / "int4_gemm.cpp",
    "int4 GEMM kernel",
    "int4 steps of more than a few rows use a dense copy of the weights",
    logger,
)
_fn: Any = None


def load() -> bool:
    """Build (or load from the disk cache) the kernel, once per process; False where it is unavailable."""
    global _fn
    _fn = _KERNEL.load_function(
        "asyncexec_int4_gemm",
        [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 5,
        "no AVX-512 VNNI on this CPU: int4 steps of more than a few rows use a dense copy",
    )
    return _fn is not None


def fits(weight: torch.Tensor) -> bool:
    """Whether the kernel serves this [N, K] weight: loaded, N in blocks of 16 channels, K in groups."""
    n, k = weight.shape
    return n % 16 == 0 and k % GROUP == 0 and load()


def pack(codes: torch.Tensor) -> torch.Tensor:
    """The kernel's form of [N, K] codes 0-15 (any integer dtype): uint8 [N / 16, K / 8, 16, 4], byte
    (c, j) of block k8 holding input 8 * k8 + j in its low nibble and 8 * k8 + 4 + j in its high one."""
    n, k = codes.shape
    q = codes.to(torch.uint8).reshape(n // 16, 16, k // 8, 2, 4).permute(0, 2, 1, 3, 4)
    return (q[..., 0, :] | (q[..., 1, :] << 4)).contiguous()


def unpack(blocked: torch.Tensor) -> torch.Tensor:
    """The [N, K] codes (uint8) of `pack`'s output."""
    nb, k8, _, _ = blocked.shape
    q = torch.stack([blocked & 0x0F, blocked >> 4], dim=3)  # [N/16, K/8, 16, 2, 4]
    return q.permute(0, 2, 1, 3, 4).reshape(nb * 16, k8 * 8)


def int4_gemm(
    x: torch.Tensor, blocked: torch.Tensor, d: torch.Tensor, mn: torch.Tensor | None
) -> torch.Tensor:
    """`x @ (q * d + mn).T` with `x` quantized to int8 (per row and `GROUP`): bf16 [M, K] in, bf16 [M, N]
    out; `blocked = pack(q)`; `d`, `mn` [K / GROUP, N], bf16 or fp16 (as a GGUF file ships them); `mn`
    None: Q4_0's symmetric codes, `mn = -8 * d`. Checked (`fits` first)."""
    assert _fn is not None, "int4_gemm.load() first"
    k = x.shape[1]
    n = blocked.shape[0] * 16
    same = mn is None or mn.dtype == d.dtype
    if not (x.dtype == torch.bfloat16 and d.dtype in SCALE_DTYPES and same and blocked.dtype == torch.uint8):
        raise ValueError(
            f"int4_gemm takes bf16 rows, bf16 or fp16 scales and minimums of one type and uint8 codes, got "
            f"{x.dtype}, {d.dtype}, {None if mn is None else mn.dtype} and {blocked.dtype}"
        )
    if (
        blocked.shape[1:] != (k // 8, 16, 4)
        or d.shape != (k // GROUP, n)
        or (mn is not None and mn.shape != d.shape)
    ):
        minimums = None if mn is None else tuple(mn.shape)
        raise ValueError(f"int4_gemm: x {tuple(x.shape)}, weight {tuple(blocked.shape)}, scales "
                         f"{tuple(d.shape)}, minimums {minimums} do not fit")  # fmt: skip
    return run(x.contiguous(), blocked, d.contiguous(), None if mn is None else mn.contiguous())


def run(x: torch.Tensor, blocked: torch.Tensor, d: torch.Tensor, mn: torch.Tensor | None) -> torch.Tensor:
    """The call without `int4_gemm`'s checks, for the hot path (operands `fits` admitted at load)."""
    m, k = x.shape
    n = d.shape[1]
    y = torch.empty(m, n, dtype=x.dtype)
    if m == 0:
        return y
    rc = _fn(x.data_ptr(), blocked.data_ptr(), d.data_ptr(), None if mn is None else mn.data_ptr(),
             y.data_ptr(), m, n, k, torch.get_num_threads(), d.dtype == torch.float16)  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"int4_gemm kernel failed with code {rc} (x {tuple(x.shape)})")
    return y
