"""Prepacked linears and int8 weight-only quantization: the op, the per-channel scales, the engine path,
and the refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncexec import AsyncEngine, ConfigError, EngineConfig, SamplingParams, WorkerStartupError
from asyncexec.ops import int8_gemm
from asyncexec.ops.packed_linear import REGISTRY
from asyncexec.quantization import pack as quantization
from asyncexec.quantization.int4 import dequantize_int4
from asyncexec.quantization.int8 import dequantize
from asyncexec.quantization.int8 import gemm_serves as int8_gemm_serves
from asyncexec.quantization.pack import INT8_MAX_ROWS, can_pack, pack_linears, quantize_weight


def _linear(n: int, k: int, dtype: torch.dtype, bias: bool = True) -> torch.nn.Linear:
    gen = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():  # rows of very different magnitudes: a per-tensor scale would lose the small ones
        lin.weight.copy_(torch.randn(n, k, generator=gen) * torch.logspace(-2, 1, n)[:, None])
    return lin.to(dtype)


def test_int8_scales_are_per_output_channel() -> None:
    w = _linear(48, 64, torch.float32).weight
    q, scales = quantize_weight(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert torch.allclose(scales, w.abs().amax(1) / 127)
    assert ((q.float() * scales[:, None]) - w).abs().le(scales[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("rows", [1, INT8_MAX_ROWS, INT8_MAX_ROWS + 1, 37])
def test_int8_linear_computes_with_the_dequantized_weight_at_every_size(
    rows: int, without_int8_gemm: None
) -> None:
    """Without the int8 GEMM (one scale per channel), small steps take the int8 GEMV, bigger ones the
    packed copy: both are the same quantized model."""
    lin = _linear(48, 64, torch.bfloat16)
    with torch.no_grad():  # one large weight per row sets the scale; the rest sit near one step of it
        lin.weight[:, 0] = 1.0
        small = torch.randn(48, 63, generator=torch.Generator().manual_seed(2)) * 0.01
        lin.weight[:, 1:] = small.bfloat16()
    q, scales = quantize_weight(lin.weight)
    dequant = q.to(torch.bfloat16) * scales[:, None]
    x = torch.randn(1, rows, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    x[..., 0] = 0  # the output is made of the coarsely quantized weights only
    want = torch.nn.functional.linear(x.float(), dequant.float(), lin.bias.float())
    unquantized = torch.nn.functional.linear(x.float(), lin.weight.float(), lin.bias.float())
    pack_linears(torch.nn.Sequential(lin), "int8")
    with torch.inference_mode():
        got = lin(x).float()
    assert got.shape == (1, rows, 48)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)
    assert (want - unquantized).abs().max() > 10 * (got - want).abs().max()  # it is the quantized model


@pytest.mark.parametrize(
    ("dtype", "plain"), [(torch.bfloat16, False), (torch.float32, False), (torch.float32, True)]
)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_the_plain_one_eager_and_compiled(
    dtype: torch.dtype, plain: bool, bias: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """float32 in both layouts: whichever multiplies faster on this CPU (`plain_float32_is_faster`) is
    taken, so each is forced here."""
    if not can_pack(dtype):  # no AVX-512 or AMX: see test_where_onednn_cannot_pack_linears_stay_...
        pytest.skip(f"oneDNN cannot pack {dtype} weights on this CPU")
    monkeypatch.setattr(quantization, "plain_float32_is_faster", lambda w: (plain, "forced"))
    lin = _linear(48, 64, dtype, bias=bias)
    x = torch.randn(3, 64).to(dtype)
    with torch.inference_mode():
        want = lin(x)
        stats = pack_linears(torch.nn.Sequential(lin), None)
        assert stats["linears"] == 1 and tuple(lin.weight.stride()) == (0, 0)  # the dense weight is gone
        assert stats["plain"] == plain
        tol = 1e-4 if dtype == torch.float32 else 1.6e-2  # float32: another summation order
        torch.testing.assert_close(lin(x), want, rtol=tol, atol=tol)
        torch.testing.assert_close(torch.compile(lin)(x), want, rtol=tol, atol=tol)


class _Block(torch.nn.Module):
    """The sibling projections a llama layer has: q/k/v read one input, gate/up another."""

    def __init__(self, dtype: torch.dtype, bias: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(64, n, bias=bias) for n in (64, 32, 32))
        self.gate_proj, self.up_proj = (torch.nn.Linear(64, 96, bias=bias) for _ in range(2))
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        mlp = torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x)
        return torch.cat([q * 2, k + 1, v, mlp], dim=-1)


@pytest.mark.parametrize("quantization", [None, "int8"])
@pytest.mark.parametrize("bias", [False, True])
def test_sibling_projections_run_as_one_gemm_and_equal_the_separate_ones(
    quantization: str | None, bias: bool
) -> None:
    from asyncexec.ops import packed_linear as q

    block = _Block(torch.bfloat16, bias)
    x = torch.randn(1, 7, 64).to(torch.bfloat16)
    calls: list[int] = []
    matmul = q._matmul
    q._matmul = lambda x2, p, b: calls.append(x2.shape[0]) or matmul(x2, p, b)  # type: ignore[assignment,func-returns-value]
    try:
        with torch.inference_mode():
            ref = _Block(torch.bfloat16, bias)
            if quantization:  # the model int8 computes: dequantized weights
                pack_linears(ref, "int8")
            want = ref(x)
            calls.clear()
            stats = pack_linears(block, quantization)
            assert stats["groups"] == 2 and stats["linears"] == 5
            eager = block(x)
            assert len(calls) == 2, "eager: one GEMM per group"
            calls.clear()
            compiled = torch.compile(
                block.forward, options={"post_grad_custom_post_pass": q.DedupeGroupLinears()}
            )
            got = compiled(x)
            assert len(calls) == 2, "compiled: the members' identical calls merged into one per group"
            again = block(x[:, 1:])  # a new input recomputes (nothing is served stale; rows > INT8_MAX_ROWS)
    finally:
        q._matmul = matmul
    torch.testing.assert_close(eager, want, rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(again, want[:, 1:], rtol=0, atol=0)


def test_unknown_quantization_is_refused_with_the_supported_list() -> None:
    with pytest.raises(ConfigError, match=r"quantization='fp8'.*supported.*'int8', 'int4'"):
        EngineConfig(model="m", quantization="fp8")  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
async def test_int8_refuses_other_dtypes_at_start_up_naming_bfloat16(
    tiny_models: dict[str, Path], dtype: str
) -> None:
    cfg = EngineConfig(model=str(tiny_models["llama"]), executor="uni", dtype=dtype, quantization="int8",  # type: ignore[arg-type]
                       enforce_eager=True, kv_cache_memory_bytes=1 << 20)  # fmt: skip
    with pytest.raises((ConfigError, WorkerStartupError), match="needs dtype='bfloat16'"):
        async with AsyncEngine(cfg):
            pass


def _reference_logprobs(path: Path, ids: list[int], quantization: str) -> torch.Tensor:
    """HF in float32 with every linear's weight replaced by its int8 round trip (a scale per group of 32
    where the int8 GEMM serves it; int4: the linears' int4 round trip, the lm_head's int8 one): log-probs
    [T, V]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear):
                w = mod.weight.to(torch.bfloat16)
                if quantization == "int4" and name != "lm_head":
                    mod.weight = torch.nn.Parameter(dequantize_int4(w))
                    continue
                group = int8_gemm.GROUP if int8_gemm_serves(w) else None  # as pack_linears chooses
                q, s = quantize_weight(w, group=group)
                mod.weight = torch.nn.Parameter(dequantize(q, s, None))  # unties a tied lm_head
        logprobs: torch.Tensor = model(torch.tensor([ids])).logits[0].log_softmax(-1)
        return logprobs


@pytest.mark.parametrize(
    ("kind", "tp", "eager", "quantization"),
    [("uni", 1, False, "int8"), ("uni", 1, True, "int8"), ("mp", 2, False, "int8"), ("uni", 1, False, "int4"),
     ("uni", 1, True, "int4")],
)  # fmt: skip
async def test_int8_engine_scores_like_hf_with_the_dequantized_weights(
    tiny_models: dict[str, Path], kind: str, tp: int, eager: bool, quantization: str
) -> None:
    """Graph mode and eager, one rank and two (each rank quantizes its own shard, and both agree)."""
    path = tiny_models["llama"]
    ids = [(i * 37 + 11) % 250 + 3 for i in range(40)]
    cfg = EngineConfig(
        model=str(path), executor=kind, tensor_parallel_size=tp, dtype="bfloat16", quantization=quantization,  # type: ignore[arg-type]
        enforce_eager=eager, block_size=4, max_num_batched_tokens=16, kv_cache_memory_bytes=1 << 20,
        cudagraph_capture_sizes=(1, 2, 4), check_rank_agreement=tp > 1,
    )  # fmt: skip
    sp = SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=0, logprobs=0, ignore_eos=True)
    async with AsyncEngine(cfg) as engine:
        outs = [o async for o in engine.generate(ids, sp)]
        stats = (await engine.collective_rpc("get_runner_stats"))[0]
    assert (stats["graph_steps"] > 0) is not eager, stats
    got, out = outs[-1].prompt_logprobs, outs[-1]
    assert got is not None and out.logprobs is not None
    full = ids + list(out.token_ids)
    ref = _reference_logprobs(path, full, quantization)
    # the prompt: prefill steps (the dequantized copy); the output: one-row decode steps (the int kernels)
    diffs = [abs(got[i][ids[i]] - float(ref[i - 1, ids[i]])) for i in range(1, len(ids))]  # type: ignore[index]
    for j, (t, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        diffs.append(abs(lp[t] - float(ref[len(ids) + j - 1, t])))
    # bf16 activations against a float32 reference: close; with a per-shard scale (tp=2) a little less
    assert max(diffs) < (0.1 if tp == 1 else 0.2), max(diffs)


@pytest.mark.usefixtures("without_int8_gemm")
def test_where_onednn_cannot_pack_linears_stay_and_int8_serves_every_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A CPU without bf16 support in oneDNN (no AVX-512): no packing, and int8 needs none."""
    monkeypatch.setattr("asyncexec.quantization.pack.can_pack", lambda dtype: False)
    plain = _linear(48, 64, torch.bfloat16)
    assert pack_linears(torch.nn.Sequential(plain), None)["linears"] == 0
    assert isinstance(plain.weight, torch.nn.Parameter)  # untouched
    lin = _linear(48, 64, torch.bfloat16)
    q, scales = quantize_weight(lin.weight)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    want = torch.nn.functional.linear(x.float(), q.float() * scales.float()[:, None], lin.bias.float())
    pack_linears(torch.nn.Sequential(lin), "int8")
    with torch.inference_mode():
        torch.testing.assert_close(lin(x).float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.usefixtures("without_int8_gemm")
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_without_onednn_bf16_bigger_steps_multiply_in_float32(
    monkeypatch: pytest.MonkeyPatch, quantization: str | None
) -> None:
    """An AVX2 CPU: oneDNN packs float32 only. Steps of few rows keep the compact weights (bf16 or int8);
    bigger ones run a packed float32 copy (bf16's own matmul there grows slow with the rows)."""
    from asyncexec.quantization import pack as qmod

    monkeypatch.setattr(qmod, "can_pack", lambda dtype: dtype == torch.float32)
    lin = _linear(48, 64, torch.bfloat16)
    w = lin.weight.detach().clone()
    if quantization:
        q, scales = quantize_weight(w)
        w = q.to(torch.bfloat16) * scales[:, None]
    b = lin.bias.detach().clone()
    stats = pack_linears(torch.nn.Sequential(lin), quantization)
    assert stats["linears"] == 1
    packed = REGISTRY[lin.weight.data_ptr()]
    assert packed.dense is not None and packed.dense.dtype == torch.float32
    gen = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        small = torch.randn(INT8_MAX_ROWS, 64, generator=gen).to(torch.bfloat16)
        big = torch.randn(37, 64, generator=gen).to(torch.bfloat16)
        if quantization is None:  # the bf16 weights themselves, as plain bf16 computes
            assert torch.equal(lin(small), torch.nn.functional.linear(small, w, b))
        want = torch.nn.functional.linear(big.float(), w.float(), b.float()).bfloat16().float()
        got = lin(big)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=1e-2)
