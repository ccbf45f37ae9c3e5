"""asyncexec's int4 GEMM on AVX-512 VNNI (`ops/csrc/int4_gemm.cpp`): the W4A8 product it claims (Q4_1 weights,
activations quantized per row and group of 32 inputs), at every number of rows, and int4 weights that
serve every step with no dense copy of the weights."""

from __future__ import annotations

import pytest
import torch

from asyncexec.ops import int4_gemm
from asyncexec.ops.packed_linear import INT8_MAX_ROWS, REGISTRY
from asyncexec.quantization.int4 import dequantize_int4, int4_codes
from asyncexec.quantization.pack import pack_linears
from tests.worker.test_int4 import activations_as_the_int4_gemm_quantizes_them

pytestmark = pytest.mark.skipif(not int4_gemm.load(), reason="the int4 GEMM needs AVX-512 VNNI")

G = int4_gemm.GROUP


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The W4A8 product: x quantized as the kernel does, times the float weight `w` [N, K] in float64."""
    return activations_as_the_int4_gemm_quantizes_them(x) @ w.double().t()


def _q4_1(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    d = (torch.rand(k // G, n, generator=gen) * 0.02 + 1e-3).bfloat16()
    mn = (-8 * d.float() + torch.randn(k // G, n, generator=gen) * 0.01).bfloat16()
    return q, d, mn


def _weight(q: torch.Tensor, d: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    w = q.float().reshape(n, k // G, G) * d.float().t()[..., None] + mn.float().t()[..., None]
    return w.reshape(n, k)


def test_int4_pack_keeps_every_code() -> None:
    q, _, _ = _q4_1(48, 128, 0)
    blocked = int4_gemm.pack(q)
    assert blocked.shape == (3, 16, 16, 4) and blocked.dtype == torch.uint8  # 4 bits a code
    assert torch.equal(int4_gemm.unpack(blocked), q)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 37])
@pytest.mark.parametrize(("n", "k"), [(48, 64), (960, 576), (16, 1536)])
def test_int4_gemm_is_the_w4a8_product_at_every_size(rows: int, n: int, k: int) -> None:
    q, d, mn = _q4_1(n, k, rows * 1000 + n)
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, k, generator=gen) * torch.logspace(-2, 1, k)).bfloat16()  # groups far apart
    got = int4_gemm.int4_gemm(x, int4_gemm.pack(q), d, mn)
    want = _reference(x, _weight(q, d, mn))
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # the sums are exact in int32; what is left is float32's sum over groups and bf16's rounding
    torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=4e-3 * want.abs().max().item())


@pytest.mark.parametrize("rows", [1, 5, 9])
def test_int4_gemm_computes_with_the_rounded_codes_exactly(rows: int) -> None:
    """Activations whose every group's largest value is 127 have the scale 1, so the codes are x rounded
    half to even; with scale 1, minimum -8 and outputs below 256, bf16 holds every result exactly, and the
    kernel must give the codes' product to the bit, not the product of x itself."""
    n, k = 32, 128
    gen = torch.Generator().manual_seed(rows)
    x = torch.randint(-31, 32, (rows, k), generator=gen).float() + 0.5 * torch.randint(
        0, 2, (rows, k), generator=gen
    )
    x[:, ::G] = 127.0  # each group's largest, where the weight is 0
    q = torch.randint(7, 10, (n, k), generator=gen, dtype=torch.uint8)  # weights -1, 0, 1
    q[:, ::G] = 8
    q[:, 8:] = 8  # 6 inputs per output: |y| <= 6 * 31.5
    d = torch.ones(k // G, n, dtype=torch.bfloat16)
    mn = torch.full((k // G, n), -8.0, dtype=torch.bfloat16)
    got = int4_gemm.int4_gemm(x.bfloat16(), int4_gemm.pack(q), d, mn)
    w = q.float() - 8
    assert torch.equal(got.float(), torch.round(x) @ w.t())  # half to even, as the kernel rounds
    assert not torch.equal(got.float(), x @ w.t())  # the unrounded product differs


def test_int4_gemm_refuses_what_it_does_not_serve() -> None:
    assert not int4_gemm.fits(torch.zeros(24, 64))  # 24 output channels: not whole blocks of 16
    assert not int4_gemm.fits(torch.zeros(32, 48))  # 48 inputs: not whole groups
    q, d, mn = _q4_1(32, 64, 0)
    with pytest.raises(ValueError, match="do not fit"):
        int4_gemm.int4_gemm(torch.zeros(2, 128, dtype=torch.bfloat16), int4_gemm.pack(q), d, mn)
    with pytest.raises(ValueError, match="bf16 rows"):
        int4_gemm.int4_gemm(torch.zeros(2, 64), int4_gemm.pack(q), d, mn)


def test_int4_weights_serve_every_step_with_no_dense_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    kernel = int4_gemm.run

    def counted(x: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return kernel(x, *args)

    monkeypatch.setattr(int4_gemm, "run", counted)
    lin = torch.nn.Linear(256, 96, bias=True).bfloat16()
    w = dequantize_int4(lin.weight.detach())
    codes, d, mn = int4_codes(lin.weight.detach())
    torch.testing.assert_close(_weight(codes, d, mn), w, rtol=0, atol=0)
    stats = pack_linears(torch.nn.Sequential(lin), "int4")
    packed = REGISTRY[lin.weight.data_ptr()]
    assert packed.dense is None and packed.q4 is None and packed.nibbles is not None
    # 4 bits a weight, a bf16 scale and minimum per channel and group: Q4_1's 5 bits a weight
    assert stats["bytes_after"] == 96 * 256 // 2 + 2 * 96 * (256 // G) * 2
    sizes = [1, INT8_MAX_ROWS, INT8_MAX_ROWS + 1, 37, 600]
    with torch.inference_mode():
        for rows in sizes:
            x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
            want = _reference(x, w) + lin.bias.double()
            torch.testing.assert_close(lin(x).double(), want, rtol=2**-7, atol=1e-2)
    assert calls == sizes
