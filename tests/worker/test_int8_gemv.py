"""asyncexec's int8 GEMV kernel (`ops/csrc/int8_gemv.cpp`): the same numbers as PyTorch's int8 kernel, taken
by int8 steps of 1-4 rows, and a clear fallback where it cannot be built."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from asyncexec.ops import int8_gemv
from asyncexec.quantization.pack import INT8_MAX_ROWS, pack_linears
from tests.worker.conftest import unload_kernel


@pytest.fixture
def fresh_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's module state as if no engine had loaded it yet (monkeypatch restores it)."""
    unload_kernel(int8_gemv, monkeypatch)


def _operands(rows: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, generator=gen) * torch.logspace(-3, 0, n)).bfloat16()  # channels far apart
    return x, q, scales


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize(("n", "k"), [(50, 64), (960, 576), (8, 1536)])
def test_int8_gemv_equals_pytorchs_int8_kernel(rows: int, n: int, k: int) -> None:
    """Every row and output channel, the 4-channel blocks and the tail (n=50), K over several vectors."""
    assert int8_gemv.load(), "the kernel builds on this machine (g++ and AVX2 are there)"
    x, q, scales = _operands(rows, n, k)
    got = int8_gemv.int8_gemv(x, q, scales)
    want = torch.ops.aten._weight_int8pack_mm(x, q, scales)
    exact = x.double() @ (q.double() * scales.double()[:, None]).t()
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    # both round float32 sums to bf16: at most one bf16 step apart, and as close to the exact product
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-6)
    assert (got.double() - exact).abs().max() <= 1.01 * (want.double() - exact).abs().max() + 1e-6


def test_int8_gemv_refuses_shapes_it_does_not_serve() -> None:
    assert int8_gemv.load()
    x, q, scales = _operands(5, 8, 64)
    with pytest.raises(ValueError, match="1-4 bf16 rows"):
        int8_gemv.int8_gemv(x, q, scales)
    with pytest.raises(ValueError, match="do not fit"):
        int8_gemv.int8_gemv(x[:1], q[:, :32], scales)
    assert not int8_gemv.fits(q[:, :60].contiguous(), scales)  # K not a multiple of the vector width


@pytest.mark.usefixtures("without_int8_gemm")
def test_int8_steps_of_up_to_4_rows_run_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    kernel = int8_gemv.run

    def counted(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return kernel(x, q, s)

    monkeypatch.setattr(int8_gemv, "run", counted)
    lin = torch.nn.Linear(64, 48, bias=True).bfloat16()
    pack_linears(torch.nn.Sequential(lin), "int8")
    with torch.inference_mode():
        for rows in (1, INT8_MAX_ROWS, INT8_MAX_ROWS + 1):
            lin(torch.randn(rows, 64).bfloat16())
    assert calls == [1, INT8_MAX_ROWS]  # 5 rows: the packed bf16 copy


@pytest.mark.usefixtures("without_int8_gemm")
def test_without_the_kernel_int8_uses_pytorchs_with_the_same_result(
    fresh_kernel: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    outs = []
    for env in ("1", "0"):
        monkeypatch.setenv("ASYNCEXEC_INT8_GEMV", env)
        unload_kernel(int8_gemv, monkeypatch)
        torch.manual_seed(0)
        lin = torch.nn.Linear(64, 48).bfloat16()
        with caplog.at_level(logging.INFO, logger="asyncexec.quantization.pack"):
            pack_linears(torch.nn.Sequential(lin), "int8")
        with torch.inference_mode():
            outs.append(lin(x).float())
    assert "ASYNCEXEC_INT8_GEMV=0" in caplog.text
    torch.testing.assert_close(outs[0], outs[1], rtol=2**-7, atol=1e-6)


def test_a_kernel_that_fails_to_build_leaves_pytorchs_with_a_warning(
    fresh_kernel: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broken = tmp_path / "int8_gemv.cpp"
    broken.write_text("this is not C++;\n")
    unload_kernel(int8_gemv, monkeypatch, broken)
    with caplog.at_level(logging.WARNING, logger="asyncexec.ops.int8_gemv"):
        assert not int8_gemv.load()
    assert "could not build asyncexec's int8 GEMV kernel" in caplog.text
    assert "_weight_int8pack_mm" in caplog.text
    _, q, scales = _operands(1, 8, 64)
    assert not int8_gemv.fits(q, scales)
