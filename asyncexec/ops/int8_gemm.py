"""int8 GEMM for steps of more than `INT8_MAX_ROWS` rows: asyncexec's C++ kernel on AVX-512 VNNI
(`csrc/int8_gemm.cpp`), so an int8 model keeps no dense copy of its weights.

The activations are quantized inside the kernel (dynamic, symmetric, one scale per row and group of
`GROUP` inputs), after the division by int8's activation-aware input scales, and multiplied with the
int8 weights in int32 (W8A8, as vLLM's and SGLang's CPU backends run int8; per group as llama.cpp's
int8 dot products, which kept SmolLM2's argmax where one scale per row did not). The weights have a
scale per output channel and group of `GROUP` inputs (llama.cpp's Q8_0, `quantization.int8`). Where the
kernel is unavailable (no AVX-512 VNNI, no compiler) the load-time transform keeps a dense copy for
steps of more than `INT8_MAX_ROWS` rows, as before.

Built once per machine at first use by `ops.build`; called through ctypes, which releases the GIL.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch

from asyncexec.ops.build import CSRC, CppKernel

__all__ = ["GROUP", "SCALE_DTYPES", "fits", "int8_gemm", "load", "pack", "run", "unpack"]

logger = logging.getLogger(__name__)

GROUP = 32  # inputs per activation scale (the kernel's kGroup)
SCALE_DTYPES = (torch.bfloat16, torch.float16)  # the weight scales' types the kernel reads

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
        [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 5,
        "no AVX-512 VNNI on this CPU: int8 steps of more than a few rows use a dense copy",
    )
    return _fn is not None


def fits(weight: torch.Tensor) -> bool:
    """Whether the kernel serves this [N, K] weight in bf16: loaded, N in blocks of 16 channels, K in
    groups of `GROUP` inputs."""
    n, k = weight.shape
    return weight.dtype == torch.bfloat16 and n % 16 == 0 and k % GROUP == 0 and load()


def pack(qweight: torch.Tensor) -> torch.Tensor:
    """The kernel's form of an int8 [N, K] weight: blocked uint8 [N / 16, K / 4, 16, 4] holding w + 128
    (`vpdpbusd` takes the weights as its unsigned operand)."""
    n, k = qweight.shape
    shifted = qweight.view(torch.uint8) ^ 0x80  # two's complement + 128
    return shifted.reshape(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()


def unpack(blocked: torch.Tensor) -> torch.Tensor:
    """The int8 [N, K] weight of `pack`'s output (or of any slice of its channel blocks)."""
    nb, k4, _, _ = blocked.shape
    return (blocked.permute(0, 2, 1, 3).reshape(nb * 16, k4 * 4).to(torch.int16) - 128).to(torch.int8)


def int8_gemm(
    x: torch.Tensor, blocked: torch.Tensor, scales: torch.Tensor, inv_s: torch.Tensor | None = None
) -> torch.Tensor:
    """`(x * inv_s) @ W.T` with `x` quantized to int8 (per row and `GROUP`) and `W` the int8 `qweight`
    times `scales` [K / GROUP, N] per output channel and group of inputs (Q8_0; bf16, or fp16 as a GGUF
    file ships them): bf16 [M, K] in, bf16 [M, N] out; `blocked = pack(qweight)`; `inv_s` [K] (bf16)
    the inverses of the activation-aware input scales, or None. Checked (`fits` first)."""
    assert _fn is not None, "int8_gemm.load() first"
    k = x.shape[1]
    n = blocked.shape[0] * 16
    if not (x.dtype == torch.bfloat16 and scales.dtype in SCALE_DTYPES and blocked.dtype == torch.uint8):
        raise ValueError(f"int8_gemm takes bf16 rows and scales and packed weights, got {x.dtype}, "
                         f"{scales.dtype} and {blocked.dtype}")  # fmt: skip
    if blocked.shape[1:] != (k // 4, 16, 4) or scales.shape != (k // GROUP, n):
        raise ValueError(f"int8_gemm: x {tuple(x.shape)}, weight {tuple(blocked.shape)}, scales "
                         f"{tuple(scales.shape)} do not fit")  # fmt: skip
    if inv_s is not None and (inv_s.shape != (k,) or inv_s.dtype != torch.bfloat16):
        raise ValueError(f"int8_gemm: inv_s must be bf16 [{k}], got {inv_s.dtype} {tuple(inv_s.shape)}")
    return run(x.contiguous(), blocked, scales.contiguous(), inv_s)


def run(
    x: torch.Tensor, blocked: torch.Tensor, scales: torch.Tensor, inv_s: torch.Tensor | None
) -> torch.Tensor:
    """The call without `int8_gemm`'s checks, for the hot path (operands `fits` admitted at load)."""
    m, k = x.shape
    n = scales.shape[1]
    y = torch.empty(m, n, dtype=x.dtype)
    if m == 0:
        return y
    inv = None if inv_s is None else inv_s.data_ptr()
    rc = _fn(x.data_ptr(), inv, blocked.data_ptr(), scales.data_ptr(), y.data_ptr(), m, n, k,
             torch.get_num_threads(), scales.dtype == torch.float16)  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"int8_gemm kernel failed with code {rc} (x {tuple(x.shape)})")
    return y
