"""A GGUF tensor as a quantized weight, read a few output channels at a time from the file's memory map.

What each tensor type becomes (the default mode, `dtype="auto"`; an explicit dtype dequantizes all):

- Q4_0, Q4_1 -> int4 (`ops.int4_gemm`), as they ship: the file's codes and fp16 scales, and Q4_1's
  minimums (Q4_0's are `-8 d`, made in the kernel, not stored);
- Q8_0 -> int8 (`ops.int8_gemm`), as it ships: codes and fp16 scales per 32;
- Q4_K -> int4, requantized: dequantized a slice at a time, then Q4_1 per 32 inputs (Q4_K's sub-blocks
  of 32 have a scale and a minimum each);
- Q5_0, Q5_1, Q5_K, Q6_K -> int8, requantized: dequantized, then Q8_0 per 32 (8 bits for 5-6);
- F32, F16, BF16 -> dense, in the model's dtype.

A weight is kept quantized where the GEMM serves its shape (`gemm_serves`): output channels in blocks
of 16, inputs in groups of 32, AVX-512 VNNI; elsewhere it is dequantized. The row permutation some
architectures' converters applied (llama's q and k) is undone by reading rows in transformers' order
(`row_order`), exact on quantized data since every block lies inside one row.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch

from asyncexec.ops import int4_gemm, int8_gemm
from asyncexec.quantization.int4 import int4_codes
from asyncexec.quantization.int8 import quantize_weight

__all__ = ["FORMS", "GGUFWeight", "StackedWeight", "dequantize_rows", "drop_pages", "form_of", "gemm_serves"]

Form = Literal["int4", "int8", "dense"]
FORMS: dict[str, Form] = {
    "Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4",
    "Q8_0": "int8", "Q5_0": "int8", "Q5_1": "int8", "Q5_K": "int8", "Q6_K": "int8",
    "F32": "dense", "F16": "dense", "BF16": "dense",
}  # fmt: skip
AS_SHIPPED = ("Q4_0", "Q4_1", "Q8_0")  # the others of int4 and int8 are requantized
GROUP = int8_gemm.GROUP  # == int4_gemm.GROUP == the Q4/Q8 block size


def drop_pages(raw: np.ndarray) -> None:
    """Drop the whole pages of `raw`, a view of the file's memory map, from this process."""
    from asyncexec.worker.memory import drop_range  # asyncexec.worker imports the loader

    start = int(raw.ctypes.data)
    drop_range(start, start + int(raw.nbytes))


def form_of(type_name: str) -> Form:
    return FORMS[type_name]


def gemm_serves(form: Form, shape: tuple[int, int]) -> bool:
    """Whether asyncexec's int4 or int8 GEMM takes a weight of this form and [N, K] shape here."""
    probe = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    if form == "int4":
        return int4_gemm.fits(probe)
    return form == "int8" and int8_gemm.fits(probe)


def dequantize_rows(raw: np.ndarray, type_name: str) -> np.ndarray:
    """Rows of a tensor as the file holds them, dequantized to float32 by `gguf` (transformers' own
    dequantization: `dtype="float32"` then equals its GGUF load)."""
    from gguf import GGMLQuantizationType, dequantize

    return np.asarray(dequantize(raw, GGMLQuantizationType[type_name]), dtype=np.float32)


class GGUFWeight:
    """One [N, K] tensor of the file kept quantized: `raw` the file's rows (a memory-map view), read in
    transformers' row order (`order`, or None where the converter kept it)."""

    def __init__(self, name: str, type_name: str, raw: np.ndarray, shape: tuple[int, int],
                 order: np.ndarray | None) -> None:  # fmt: skip
        self.name, self.type_name, self.raw, self.shape, self.order = name, type_name, raw, shape, order
        self.form = form_of(type_name)
        self.symmetric = type_name == "Q4_0"  # no minimums stored: -8 d
        self.scale_dtype = torch.float16  # the file's; requantized ones are stored so too

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    def done(self) -> None:
        """Packed: its pages of the memory map leave this process (the page cache keeps them)."""
        drop_pages(self.raw)

    def _raw(self, rows: slice) -> np.ndarray:
        return self.raw[rows] if self.order is None else self.raw[self.order[rows]]

    def dense(self, rows: slice = slice(None)) -> torch.Tensor:
        """The rows dequantized, float32 [r, K]."""
        return torch.from_numpy(dequantize_rows(self._raw(rows), self.type_name).reshape(-1, self.shape[1]))

    def int4_rows(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Codes uint8 [r, K], scales and minimums fp16 [K / 32, r] (minimums None for Q4_0)."""
        if self.type_name not in AS_SHIPPED:
            return int4_codes(self.dense(rows).half())
        blocks = self._raw(rows).reshape(-1, self.shape[1] // GROUP, 18 if self.symmetric else 20)
        r = blocks.shape[0]
        d = torch.from_numpy(np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0])
        head = 2 if self.symmetric else 4
        qs = torch.from_numpy(np.ascontiguousarray(blocks[..., head:]))  # [r, K/32, 16]
        codes = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(r, self.shape[1])  # low: 0-15, high: 16-31
        mn = None
        if not self.symmetric:
            mn = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0]).t()
        return codes, d.t(), mn

    def int8_rows(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes int8 [r, K], scales fp16 [K / 32, r]."""
        if self.type_name != "Q8_0":
            return quantize_weight(self.dense(rows).half(), group=GROUP)
        blocks = self._raw(rows).reshape(-1, self.shape[1] // GROUP, 34)
        d = torch.from_numpy(np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0])
        q = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8)).reshape(-1, self.shape[1])
        return q, d.t()


class StackedWeight:
    """Sibling weights of one form (q/k/v, gate/up) as one [sum N, K] weight: rows read from each."""

    def __init__(self, parts: list[GGUFWeight]) -> None:
        self.parts = parts
        self.form = parts[0].form
        self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
        self.symmetric = all(p.symmetric for p in parts)
        self.scale_dtype = torch.float16
        self.starts = np.cumsum([0] + [p.shape[0] for p in parts])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def done(self) -> None:
        for p in self.parts:
            p.done()

    def _pieces(self, rows: slice) -> list[tuple[GGUFWeight, slice]]:
        a, b = rows.start or 0, self.shape[0] if rows.stop is None else rows.stop
        out = []
        for p, s in zip(self.parts, self.starts[:-1], strict=True):
            lo, hi = max(a, s), min(b, s + p.shape[0])
            if lo < hi:
                out.append((p, slice(int(lo - s), int(hi - s))))
        return out

    def dense(self, rows: slice = slice(None)) -> torch.Tensor:
        return torch.cat([p.dense(r) for p, r in self._pieces(rows)])

    def int4_rows(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        got = [p.int4_rows(r) for p, r in self._pieces(rows)]
        mn: Any = None
        if not self.symmetric:  # a Q4_0 sibling of Q4_1 ones: its minimums made explicit
            mn = torch.cat([m if m is not None else -8 * d.float() for _, d, m in got], dim=1).half()
        return torch.cat([c for c, _, _ in got]), torch.cat([d for _, d, _ in got], dim=1), mn

    def int8_rows(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        got = [p.int8_rows(r) for p, r in self._pieces(rows)]
        return torch.cat([q for q, _ in got]), torch.cat([s for _, s in got], dim=1)
