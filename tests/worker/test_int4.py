"""int4 weights: exact on Q4_1 blocks, the kernel and the dequantized copy agree at every size, the lm_head
stays int8 (the engine's scores: `test_quantization.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncexec import envs
from asyncexec.ops import int4_gemm
from asyncexec.ops.packed_linear import REGISTRY
from asyncexec.quantization.int4 import INT4_GROUP, dequantize_int4
from asyncexec.quantization.pack import INT8_MAX_ROWS, pack_linears, quantize_weight


def _ours() -> bool:
    """Whether asyncexec's int4 GEMM serves int4 weights here (else PyTorch's kernel and a dense copy)."""
    return envs.int8_gemv_enabled() and int4_gemm.load()


def activations_as_the_int4_gemm_quantizes_them(x: torch.Tensor) -> torch.Tensor:
    """x quantized per row and group of 32 (symmetric int8, the scale's reciprocal times x rounded half
    to even), as float64."""
    m, k = x.shape
    groups = x.float().reshape(m, k // INT4_GROUP, INT4_GROUP)
    sx = groups.abs().amax(-1, keepdim=True) / 127
    sx = torch.where(sx > 0, sx, torch.ones_like(sx))
    codes = torch.round(groups * (1.0 / sx)).clamp(-127, 127)
    return (codes.double() * sx.double()).reshape(m, k)


def _q4_1_weight(n: int, k: int) -> torch.Tensor:
    """A weight as a Q4_1 file holds it: per block of 32 inputs, codes 0-15 (both ends used) * d + m."""
    gen = torch.Generator().manual_seed(0)
    blocks = k // INT4_GROUP
    codes = torch.randint(0, 16, (n, blocks, INT4_GROUP), generator=gen).float()
    codes[..., 0], codes[..., 1] = 0, 15
    d = (torch.rand(n, blocks, 1, generator=gen) * 0.02 + 0.005).bfloat16().float()
    m = (-8 * d + torch.randn(n, blocks, 1, generator=gen) * 0.01).bfloat16().float()
    return (codes * d + m).reshape(n, k)


def test_int4_represents_q4_1_blocks_exactly_where_int8_cannot() -> None:
    """Blocks whose scale and min are bf16 values come back exactly, even from the bf16-rounded weight."""
    w = _q4_1_weight(64, 128)
    torch.testing.assert_close(dequantize_int4(w.bfloat16()), w, rtol=0, atol=1e-6)
    q, s = quantize_weight(w.bfloat16())
    assert (q.float() * s.float()[:, None] - w).abs().mean() > 1e-4  # int8's per-row grid cannot


@pytest.mark.parametrize("rows", [1, INT8_MAX_ROWS, INT8_MAX_ROWS + 1, 37])
def test_int4_linear_computes_with_the_dequantized_weight_at_every_size(rows: int) -> None:
    """With the dequantized weight and, where asyncexec's int4 GEMM serves (W4A8), the activations
    quantized as it quantizes them."""
    gen = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(128, 64, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(64, 128, generator=gen) * 0.1)
        lin.bias.copy_(torch.randn(64, generator=gen) * 0.1)
    lin = lin.to(torch.bfloat16)
    want_w = dequantize_int4(lin.weight.detach())
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(2)).bfloat16()
    xq = activations_as_the_int4_gemm_quantizes_them(x) if _ours() else x.float()
    want = torch.nn.functional.linear(xq.float(), want_w, lin.bias.float())
    unquantized = torch.nn.functional.linear(x.float(), lin.weight.float(), lin.bias.float())
    stats = pack_linears(torch.nn.Sequential(lin), "int4")
    assert stats["int4"] == 1
    with torch.inference_mode():
        got = lin(x).float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert (want - unquantized).abs().max() > 10 * (got - want).abs().max()  # it is the int4 model


def test_int4_keeps_the_lm_head_in_int8(tiny_models: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.bfloat16)
    stats = pack_linears(model, "int4")
    assert stats["int4"] == stats["linears"] - 1
    head = REGISTRY[model.lm_head.weight.data_ptr()]
    assert head.q4 is None and head.qweight is not None
    q_proj = REGISTRY[model.model.layers[0].self_attn.q_proj.weight.data_ptr()]
    assert q_proj.group is not None
    kept = q_proj.group.packed.nibbles if _ours() else q_proj.group.packed.q4
    assert kept is not None
