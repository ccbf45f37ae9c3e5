"""bf16 GEMM whose every output sums its inputs in one fixed order, whatever the number of rows: the
dense linears of the batch-invariant mode (`EngineConfig.batch_invariant`), asyncexec's C++ kernel on
AVX-512 BF16 (`csrc/bf16_gemm.cpp`).

oneDNN's bf16 matmul (the default mode's dense linears) picks its kernel and its blocking of the inputs
by the number of rows, so one row's output moves by an ulp with the step it is in; here each output is
one float32 accumulator walked through the inputs two at a time (`vdpbf16ps`), the bias added in float32,
rounded once. Where it is unavailable (no AVX-512 BF16, no compiler, a width it does not take) the
batch-invariant mode multiplies one row at a time (`packed_linear`), slower.

Built once per machine at first use by `ops.build`; called through ctypes, which releases the GIL.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch

from asyncexec.ops.build import CSRC, CppKernel

__all__ = ["bf16_gemm", "fits", "load", "pack", "run", "unpack"]

logger = logging.getLogger(__name__)

_KERNEL = CppKernel(
    CSRC / "bf16_gemm.cpp",
    "batch-invariant bf16 GEMM kernel",
    "batch-invariant bf16 linears multiply one row at a time",
    logger,
)
_fn: Any = None


def load() -> bool:
    """Build (or load from the disk cache) the kernel, once per process; False where it is unavailable."""
    global _fn
    _fn = _KERNEL.load_function(
        "asyncexec_bf16_gemm",
        [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4,
        "no AVX-512 BF16 on this CPU: batch-invariant bf16 linears multiply one row at a time",
    )
    return _fn is not None


def fits(weight: torch.Tensor) -> bool:
    """Whether the kernel serves this [N, K] weight: bf16, N in blocks of 16 channels, K even, loaded."""
    n, k = weight.shape
    return weight.dtype == torch.bfloat16 and n % 16 == 0 and k % 2 == 0 and load()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The kernel's form of a bf16 [N, K] weight: [N / 16, K / 2, 16, 2], pairs of inputs of 16 channels."""
    n, k = weight.shape
    return weight.reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack(blocked: torch.Tensor) -> torch.Tensor:
    """The [N, K] weight of `pack`'s output."""
    nb, k2, _, _ = blocked.shape
    return blocked.permute(0, 2, 1, 3).reshape(nb * 16, k2 * 2)


def bf16_gemm(x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W.T + bias` for bf16 `x` [M, K] and `blocked = pack(W)`; bf16 [M, N]. Checked (`fits` first)."""
    assert _fn is not None, "bf16_gemm.load() first"
    nb, k2, _, _ = blocked.shape
    n = nb * 16
    if not (x.dtype == blocked.dtype == torch.bfloat16 and (bias is None or bias.dtype == torch.bfloat16)):
        raise ValueError(f"bf16_gemm takes bf16 rows, weights and bias, got {x.dtype} and {blocked.dtype}")
    if (
        x.dim() != 2
        or x.shape[1] != 2 * k2
        or blocked.shape[2:] != (16, 2)
        or (bias is not None and bias.shape != (n,))
    ):
        raise ValueError(f"bf16_gemm: x {tuple(x.shape)}, weight {tuple(blocked.shape)}, bias "
                         f"{None if bias is None else tuple(bias.shape)} do not fit")  # fmt: skip
    return run(x.contiguous(), blocked, None if bias is None else bias.contiguous())


def run(x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The call without `bf16_gemm`'s checks, for the hot path (operands `fits` admitted at load)."""
    m, k = x.shape
    n = blocked.shape[0] * 16
    y = torch.empty(m, n, dtype=x.dtype)
    if m == 0:
        return y
    b = None if bias is None else bias.data_ptr()
    rc = _fn(x.data_ptr(), blocked.data_ptr(), b, y.data_ptr(), m, n, k, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"bf16_gemm kernel failed with code {rc} (x {tuple(x.shape)})")
    return y
