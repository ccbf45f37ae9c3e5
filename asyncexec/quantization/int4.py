"""int4 weights for `quantization="int4"`: 4-bit codes with a scale and a zero per `INT4_GROUP` inputs.

The layout is llama.cpp's Q4_1 (blocks of 32 inputs, `w = q * scale + min`), here as PyTorch's CPU int4
weight-pack kernel (`aten._weight_int4pack_mm_for_cpu`) takes it: `w = (q - 8) * scale + zero`. Rounding is
to the nearest of the block's 16 levels between its min and max: a weight matrix that came from a Q4_1
file (the built-in smollm2's linears) is represented exactly, up to the bf16 rounding of scale and zero.
The lm_head stays in int8 (an embedding tied to it is usually stored at higher precision, and its error
reaches the logits directly), as llama.cpp's Q4 files keep the output layer at 6 bits or more.
"""

from __future__ import annotations

import torch

from asyncexec.ops.packed_linear import INT4_GROUP

__all__ = ["INT4_GROUP", "dequantize_int4", "int4_fits", "quantize_int4"]


def int4_fits(weight: torch.Tensor) -> bool:
    """Whether the kernel takes this [N, K] weight: K in whole groups."""
    return weight.dim() == 2 and weight.shape[1] % INT4_GROUP == 0


def _codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // INT4_GROUP, INT4_GROUP)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-12).to(weight.dtype).float()  # as the kernel stores them
    zero = (lo + 8 * scale).to(weight.dtype).float()
    q = torch.round((w - zero) / scale + 8).clamp(0, 15)
    return q, scale, zero


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the kernel's packed int4 weight, scales and zeros [K / INT4_GROUP, N, 2] in the weight's dtype,
    the float32 weight the int4 matmul computes with)."""
    n, k = weight.shape
    q, scale, zero = _codes(weight)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).reshape(n, k), 1)
    sz = torch.stack([scale.squeeze(-1), zero.squeeze(-1)], dim=-1).transpose(0, 1).contiguous()
    return packed, sz.to(weight.dtype), _dequantize(q, scale, zero).reshape(n, k)


def _dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return (q - 8) * scale + zero


def dequantize_int4(weight: torch.Tensor) -> torch.Tensor:
    """The float32 weight the int4 matmul computes with for `weight`."""
    return _dequantize(*_codes(weight)).reshape(weight.shape)
