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
from typing import Protocol

import torch

from asyncexec.ops import int4_gemm, int8_gemm
from asyncexec.ops.packed_linear import PackedWeight
from asyncexec.quantization.int4 import int4_codes
from asyncexec.quantization.int8 import quantize_weight

__all__ = ["RowSource", "blocked_int4", "blocked_int8", "int4_from", "int8_from"]

Release = Callable[[torch.Tensor], object]


class RowSource(Protocol):
    """A weight already quantized (a GGUF file's, `gguf.weights`), read a slice of channels at a time."""

    shape: tuple[int, int]
    symmetric: bool  # int4 without stored minimums (Q4_0: -8 d)
    scale_dtype: torch.dtype

    def int4_rows(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...

    def int8_rows(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor]: ...

    def done(self) -> None:
        """Packed: whatever the source held of the file can go."""


ROWS_AT_ONCE = 1024  # output channels quantized at a time: float32 temporaries of a few MB


def _slices(n: int) -> list[tuple[slice, slice]]:
    """(channels, their vectors of 16) of each slice; ROWS_AT_ONCE is a multiple of 16."""
    return [(slice(a, min(a + ROWS_AT_ONCE, n)), slice(a // 16, min(a + ROWS_AT_ONCE, n) // 16))
            for a in range(0, n, ROWS_AT_ONCE)]  # fmt: skip


def int8_from(src: RowSource) -> PackedWeight:
    """A quantized source's int8 codes and scales (Q8_0) in `int8_gemm`'s layout; `int8.gemm_serves`."""
    n, k = src.shape
    packed = PackedWeight(blocked=torch.empty(n // 16, k // 4, 16, 4, dtype=torch.uint8),
                          scales=torch.empty(k // int8_gemm.GROUP, n, dtype=src.scale_dtype))  # fmt: skip
    assert packed.blocked is not None and packed.scales is not None
    for rows, vectors in _slices(n):
        q, packed.scales[:, rows] = src.int8_rows(rows)
        packed.blocked[vectors] = int8_gemm.pack(q)
    return packed


def int4_from(src: RowSource) -> PackedWeight:
    """A quantized source's int4 codes, scales and minimums (none for Q4_0) in `int4_gemm`'s layout."""
    n, k = src.shape
    g = int4_gemm.GROUP
    scales, t = (k // g, n), src.scale_dtype
    packed = PackedWeight(nibbles=torch.empty(n // 16, k // 8, 16, 4, dtype=torch.uint8),
                          d=torch.empty(scales, dtype=t),
                          mn=None if src.symmetric else torch.empty(scales, dtype=t))  # fmt: skip
    assert packed.nibbles is not None and packed.d is not None
    for rows, vectors in _slices(n):
        codes, packed.d[:, rows], mn = src.int4_rows(rows)
        if packed.mn is not None:
            assert mn is not None
            packed.mn[:, rows] = mn
        packed.nibbles[vectors] = int4_gemm.pack(codes)
    return packed


class _Dense:
    """A dense weight as a `RowSource`: each slice quantized when read, then handed to `release`."""

    symmetric = False

    def __init__(self, w: torch.Tensor, release: Release, s: torch.Tensor | None = None) -> None:
        self.w, self.release, self.s = w, release, s
        self.shape = (w.shape[0], w.shape[1])
        self.scale_dtype = w.dtype

    def int4_rows(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        out = int4_codes(self.w[rows])
        self.release(self.w[rows])
        return out

    def int8_rows(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        out = quantize_weight(self.w[rows], self.s, group=int8_gemm.GROUP)
        self.release(self.w[rows])
        return out

    def done(self) -> None:
        """Each slice was released as it was read."""


def blocked_int8(w: torch.Tensor, s: torch.Tensor | None, release: Release) -> PackedWeight:
    """Q8_0 (a scale per channel and group of 32) in `int8_gemm`'s layout; `s`: activation-aware input
    scales, or None. `int8.gemm_serves(w)` first."""
    packed = int8_from(_Dense(w, release, s))
    packed.inv_s = None if s is None else (1.0 / s).to(w.dtype)
    return packed


def blocked_int4(w: torch.Tensor, release: Release) -> PackedWeight:
    """Q4_1 (a scale and a minimum per channel and group of 32) in `int4_gemm`'s layout.
    `int4.gemm_serves(w)` first."""
    return int4_from(_Dense(w, release))
