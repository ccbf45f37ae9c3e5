"""int4 weights for `quantization="int4"`: 4-bit codes with a scale and a minimum per `INT4_GROUP` inputs.

The layout is llama.cpp's Q4_1: blocks of 32 inputs of one output channel, `w = q * d + mn` with codes
0-15 and a bf16 scale `d` and minimum `mn`. Rounding is to the nearest of the block's 16 levels between
its min and max: a weight matrix that came from a Q4_1 file (the built-in smollm2's linears) is
represented exactly, up to the bf16 rounding of scale and minimum (on PyTorch's kernel, of `mn + 8 d`).
On AVX-512 VNNI asyncexec's int4 GEMM (`ops.int4_gemm`) multiplies them at every step; elsewhere
PyTorch's CPU int4 weight-pack kernel (`aten._weight_int4pack_mm_for_cpu`, which takes
`w = (q - 8) * d + zero`, so `zero = mn + 8 * d`, rounded to bf16) serves a few rows and a dense copy more.
The lm_head stays in int8 (an embedding tied to it is usually stored at higher precision, and its error
reaches the logits directly), as llama.cpp's Q4 files keep the output layer at 6 bits or more.
"""

from __future__ import annotations

import torch

from asyncexec import envs
from asyncexec.ops import int4_gemm
from asyncexec.ops.packed_linear import INT4_GROUP

__all__ = ["INT4_GROUP", "dequantize_int4", "gemm_serves", "int4_codes", "int4_fits", "quantize_int4"]


def int4_fits(weight: torch.Tensor) -> bool:
    """Whether the kernels take this [N, K] weight: K in whole groups."""
    return weight.dim() == 2 and weight.shape[1] % INT4_GROUP == 0


def _codes(weight: torch.Tensor, zero: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes [N, K / G, G] (float), scales and minimums [N, K / G, 1] (float32), rounded against the scale
    and minimum as the kernel stores them: asyncexec's kernel stores `mn` in bf16; PyTorch's (`zero`) stores
    `zero = mn + 8 * d` in bf16, so there `mn` is that rounded zero minus `8 * d`."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // INT4_GROUP, INT4_GROUP)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    d = ((hi - lo) / 15).clamp(min=1e-12).to(weight.dtype).float()
    mn = (lo + 8 * d).to(weight.dtype).float() - 8 * d if zero else lo.to(weight.dtype).float()
    q = torch.round((w - mn) / d).clamp(0, 15)
    return q, d, mn


def gemm_serves(weight: torch.Tensor) -> bool:
    """Whether asyncexec's int4 GEMM serves this weight here (one 4-bit copy for every step): AVX-512 VNNI,
    a shape it takes, and not turned off (`ASYNCEXEC_INT8_GEMV=0`). Else PyTorch's kernel and a dense copy."""
    return envs.int8_gemv_enabled() and weight.dtype == torch.bfloat16 and int4_gemm.fits(weight)


def int4_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 form of an [N, K] weight: codes uint8 [N, K], scales and minimums [K / INT4_GROUP, N] in the
    weight's dtype (what `ops.int4_gemm.pack` and the kernel take)."""
    q, d, mn = _codes(weight)
    t = weight.dtype
    return q.to(torch.uint8).reshape(weight.shape), d.squeeze(-1).t().to(t), mn.squeeze(-1).t().to(t)


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For PyTorch's kernel: (its packed int4 weight, scales and zeros [K / INT4_GROUP, N, 2] in the
    weight's dtype, the float32 weight it computes with, for the dense copy)."""
    n, k = weight.shape
    q, d, mn = _codes(weight, zero=True)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).reshape(n, k), 1)
    sz = torch.stack([d.squeeze(-1), (mn + 8 * d).squeeze(-1)], dim=-1).transpose(0, 1).contiguous()
    return packed, sz.to(weight.dtype), (q * d + mn).reshape(n, k)


def dequantize_int4(weight: torch.Tensor) -> torch.Tensor:
    """The float32 weight int4 computes with for `weight` (`q * d + mn`), on the path `pack_linears` takes
    for it here: asyncexec's int4 GEMM where it serves the weight, else PyTorch's kernel."""
    q, d, mn = _codes(weight, zero=not gemm_serves(weight))
    return (q * d + mn).reshape(weight.shape)
