"""Weights quantized straight into the VNNI GEMMs' blocked layouts (`ops.int8_gemm`, `ops.int4_gemm`), a
few output channels at a time.

Quantizing a whole weight at once made float32 temporaries and an unblocked copy of its size: for a 1B
llama's lm_head (128,256 x 2,048) about 1.3 GB above the packed weights, most of the load's peak. Here
each slice of `ROWS_AT_ONCE` channels is quantized, blocked into its place in the preallocated result,
and handed to `release` (the worker drops its pages from the checkpoint's memory map), so the peak holds
the packed weights plus one slice.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from asyncexec.ops import int4_gemm, int8_gemm
from asyncexec.ops.packed_linear import PackedWeight
from asyncexec.quantization.int4 import int4_codes
from asyncexec.quantization.int8 import quantize_weight

__all__ = ["blocked_int4", "blocked_int8"]

Release = Callable[[torch.Tensor], object]

ROWS_AT_ONCE = 1024  # output channels quantized at a time: float32 temporaries of a few MB


def _slices(n: int) -> list[tuple[slice, slice]]:
    """(channels, their vectors of 16) of each slice; ROWS_AT_ONCE is a multiple of 16."""
    return [(slice(a, min(a + ROWS_AT_ONCE, n)), slice(a // 16, min(a + ROWS_AT_ONCE, n) // 16))
            for a in range(0, n, ROWS_AT_ONCE)]  # fmt: skip


def blocked_int8(w: torch.Tensor, s: torch.Tensor | None, release: Release) -> PackedWeight:
    """Q8_0 (a scale per channel and group of 32) in `int8_gemm`'s layout; `s`: activation-aware input
    scales, or None. `int8.gemm_serves(w)` first."""
    n, k = w.shape
    g = int8_gemm.GROUP
    packed = PackedWeight(blocked=torch.empty(n // 16, k // 4, 16, 4, dtype=torch.uint8),
                          scales=torch.empty(k // g, n, dtype=w.dtype),
                          inv_s=None if s is None else (1.0 / s).to(w.dtype))  # fmt: skip
    assert packed.blocked is not None and packed.scales is not None
    for rows, vectors in _slices(n):
        q, packed.scales[:, rows] = quantize_weight(w[rows], s, group=g)
        packed.blocked[vectors] = int8_gemm.pack(q)
        release(w[rows])
    return packed


def blocked_int4(w: torch.Tensor, release: Release) -> PackedWeight:
    """Q4_1 (a scale and a minimum per channel and group of 32) in `int4_gemm`'s layout.
    `int4.gemm_serves(w)` first."""
    n, k = w.shape
    g = int4_gemm.GROUP
    packed = PackedWeight(nibbles=torch.empty(n // 16, k // 8, 16, 4, dtype=torch.uint8),
                          d=torch.empty(k // g, n, dtype=w.dtype),
                          mn=torch.empty(k // g, n, dtype=w.dtype))  # fmt: skip
    assert packed.nibbles is not None and packed.d is not None and packed.mn is not None
    for rows, vectors in _slices(n):
        codes, packed.d[:, rows], packed.mn[:, rows] = int4_codes(w[rows])
        packed.nibbles[vectors] = int4_gemm.pack(codes)
        release(w[rows])
    return packed
