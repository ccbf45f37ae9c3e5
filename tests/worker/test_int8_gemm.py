"""asyncexec's int8 GEMM on AVX-512 VNNI (`ops/csrc/int8_gemm.cpp`): the W8A8 product it claims (activations
quantized per row and group of 32 inputs), at every number of rows, and int8 weights that serve every step
with no dense copy of the weights."""

from __future__ import annotations

import pytest
import torch

from asyncexec.ops import int8_gemm
from asyncexec.ops.packed_linear import INT8_MAX_ROWS, REGISTRY
from asyncexec.quantization.int8 import dequantize, quantize_weight
from asyncexec.quantization.pack import pack_linears

pytestmark = pytest.mark.skipif(not int8_gemm.load(), reason="the int8 GEMM needs AVX-512 VNNI")


def _reference(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, inv_s: torch.Tensor | None
) -> torch.Tensor:
    """The W8A8 product: x (times inv_s) quantized per row and group in float32 as the kernel does (the
    scale's reciprocal times x, rounded half to even), then the codes times the int8 weights, with their
    scales [K / GROUP, N], in float64."""
    xf = x.float() * (inv_s.float() if inv_s is not None else 1.0)
    m, k = xf.shape
    groups = xf.reshape(m, k // int8_gemm.GROUP, int8_gemm.GROUP)
    sx = groups.abs().amax(-1, keepdim=True) / 127
    sx = torch.where(sx > 0, sx, torch.ones_like(sx))
    codes = torch.round(groups * (1.0 / sx)).clamp(-127, 127)
    xq = (codes.double() * sx.double()).reshape(m, k)
    return xq @ dequantize(q, scales, None).double().t()


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 37])
@pytest.mark.parametrize(("n", "k"), [(48, 64), (960, 576), (16, 1536)])
@pytest.mark.parametrize("aware", [False, True])
def test_int8_gemm_is_the_w8a8_product_at_every_size(rows: int, n: int, k: int, aware: bool) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n + aware)
    x = (torch.randn(rows, k, generator=gen) * torch.logspace(-2, 1, k)).bfloat16()  # groups far apart
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(k // int8_gemm.GROUP, n, generator=gen) * 0.01 + 1e-3).bfloat16()
    inv_s = (torch.rand(k, generator=gen) + 0.5).bfloat16() if aware else None
    got = int8_gemm.int8_gemm(x, int8_gemm.pack(q), scales, inv_s)
    want = _reference(x, q, scales, inv_s)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # the sums are exact in int32; what is left is float32's sum over groups and bf16's rounding
    torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-6 * want.abs().max().item())


@pytest.mark.parametrize("rows", [1, 5, 9])
def test_int8_gemm_computes_with_the_rounded_codes_exactly(rows: int) -> None:
    """Activations whose every group's largest value is 127 have the scale 1, so the codes are x rounded
    half to even; with small integer weights and outputs below 256, bf16 holds every result exactly, and
    the kernel must give the codes' product to the bit, not the product of x itself."""
    n, k = 32, 128
    gen = torch.Generator().manual_seed(rows)
    x = torch.randint(-31, 32, (rows, k), generator=gen).float() + 0.5 * torch.randint(
        0, 2, (rows, k), generator=gen
    )
    x[:, :: int8_gemm.GROUP] = 127.0  # each group's largest, where no weight reads it
    q = torch.randint(-1, 2, (n, k), generator=gen, dtype=torch.int8)
    q[:, :: int8_gemm.GROUP] = 0
    q[:, 8:] = 0  # 6 inputs per output: |y| <= 6 * 31.5
    ones = torch.ones(k // int8_gemm.GROUP, n, dtype=torch.bfloat16)
    got = int8_gemm.int8_gemm(x.bfloat16(), int8_gemm.pack(q), ones)
    codes = torch.round(x)  # half to even, as the kernel rounds
    assert torch.equal(got.float(), codes @ q.float().t())
    assert not torch.equal(got.float(), x @ q.float().t())  # the unrounded product differs


def test_int8_gemm_pack_keeps_every_weight() -> None:
    q = torch.randint(-127, 128, (48, 128), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    blocked = int8_gemm.pack(q)
    assert blocked.shape == (3, 32, 16, 4) and blocked.dtype == torch.uint8  # a byte a weight
    assert torch.equal(int8_gemm.unpack(blocked), q)


def test_int8_gemm_refuses_what_it_does_not_serve() -> None:
    assert not int8_gemm.fits(torch.zeros(24, 64, dtype=torch.bfloat16))  # not whole blocks of 16
    assert not int8_gemm.fits(torch.zeros(32, 48, dtype=torch.bfloat16))  # not whole groups of 32
    assert not int8_gemm.fits(torch.zeros(32, 64, dtype=torch.float32))  # its scales are bf16
    blocked = int8_gemm.pack(torch.zeros(32, 64, dtype=torch.int8))
    scales = torch.ones(2, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="do not fit"):
        int8_gemm.int8_gemm(torch.zeros(2, 128, dtype=torch.bfloat16), blocked, scales)
    with pytest.raises(ValueError, match="bf16 rows"):
        int8_gemm.int8_gemm(torch.zeros(2, 64), blocked, scales)


def test_int8_weights_serve_every_step_with_no_dense_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    kernel = int8_gemm.run

    def counted(x: torch.Tensor, *args: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        return kernel(x, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(int8_gemm, "run", counted)
    lin = torch.nn.Linear(256, 96, bias=True).bfloat16()
    q, scales = quantize_weight(lin.weight, group=int8_gemm.GROUP)
    stats = pack_linears(torch.nn.Sequential(lin), "int8")
    packed = REGISTRY[lin.weight.data_ptr()]
    assert packed.dense is None and packed.qweight is None and packed.blocked is not None
    # int8 weights, a bf16 scale per channel and group of 32: Q8_0's 8.5 bits a weight
    assert stats["bytes_after"] == 96 * 256 + 96 * (256 // int8_gemm.GROUP) * 2
    sizes = [1, INT8_MAX_ROWS, INT8_MAX_ROWS + 1, 37, 600]
    with torch.inference_mode():
        for rows in sizes:
            x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
            want = _reference(x, q, scales, None) + lin.bias.double()
            torch.testing.assert_close(lin(x).double(), want, rtol=2**-7, atol=1e-2)
    assert calls == sizes
