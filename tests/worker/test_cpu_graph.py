"""CPU graph mode: compiled decode layers that never recompile in steady state, and the in-place decode
kernels (asyncexec's C++ one and the inductor-compiled fallback) against the eager gather-and-SDPA path
they replace."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import torch
import torch._dynamo.utils

from asyncexec import EngineConfig, Executor, SamplingParams
from asyncexec.ops import paged_decode
from asyncexec.ops.paged_decode import attend_decode
from asyncexec.worker.attention import _decode
from tests.worker.conftest import unload_kernel
from tests.worker.driver import Driver, Req

BLOCK = 4


def compiled_graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


async def test_no_recompiles_across_200_steps_of_changing_batches(tiny_models: dict[str, Path]) -> None:
    cfg = EngineConfig(
        model=str(tiny_models["llama"]), executor="uni", block_size=BLOCK, max_num_batched_tokens=32,
        max_num_seqs=8, cudagraph_capture_sizes=(1, 2, 4, 8), kv_cache_memory_bytes=1 << 20,
    )  # fmt: skip
    ex = Executor.create(cfg)  # uni: the ranks compile in this process, where the counters are
    await ex.start()
    try:
        block_bytes = max(await ex.collective_rpc("get_kv_cache_block_bytes"))
        await ex.initialize_kv_cache(min(256, await ex.determine_available_memory() // block_bytes))
        after_start = compiled_graphs()
        rng = random.Random(3)
        greedy = SamplingParams(temperature=0.0)
        driver = Driver(ex, num_blocks=256, block_size=BLOCK, budget=32, max_seqs=8)
        for i in range(50):  # arrivals and lengths vary the batch size and the table width every step
            prompt = [rng.randrange(256) for _ in range(rng.randint(1, 30))]
            driver.add(Req(f"r{i}", prompt, rng.randint(2, 40), greedy, arrive=rng.randint(0, 240)))
        await driver.run()
        stats = (await ex.collective_rpc("get_runner_stats"))[0]
    finally:
        await ex.shutdown()
    assert stats["steps"] >= 200, stats
    assert stats["graph_steps"] >= 100, stats
    assert stats["guard_free_steps"] == stats["graph_steps"], "graph steps went through dynamo's guards"
    assert stats["mixed_graph_steps"] >= 20, "mixed steps ran their compiled layer graph"
    assert compiled_graphs() == after_start, "a step compiled a new graph after start-up"


def _paged(
    lens: list[int], h: int, hkv: int, d: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """q, caches and tables of rows of `lens` tokens over scattered blocks (never the null block)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 2 + sum(-(-n // BLOCK) for n in lens)
    k_cache = torch.randn(num_blocks, BLOCK, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK, hkv, d, generator=gen).to(dtype)
    blocks = torch.randperm(num_blocks - 1, generator=gen) + 1
    width = max(-(-n // BLOCK) for n in lens) + 1  # one spare column: rows read only what they hold
    tables = torch.zeros(len(lens), width, dtype=torch.int64)
    used = 0
    for i, n in enumerate(lens):
        need = -(-n // BLOCK)
        tables[i, :need] = blocks[used : used + need]
        used += need
    q = torch.randn(len(lens), h, d, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens)


@pytest.fixture(params=["cpp", "inductor"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each decode kernel in turn: asyncexec's C++ one (built here) or the inductor-compiled fallback."""
    if request.param == "cpp":
        assert paged_decode.load(), "the C++ decode kernel builds on this machine"
    else:
        monkeypatch.setattr(paged_decode, "_ready", False)
    return str(request.param)


@pytest.mark.parametrize("window", [0, 5])
def test_the_in_place_kernel_matches_the_eager_decode_in_float32(kernel: str, window: int) -> None:
    lens = [1, 3, 4, 9, 17, 30]
    q, k_cache, v_cache, tables, seq_lens = _paged(lens, 6, 2, 16, torch.float32)
    assert paged_decode.serves(q, k_cache) == (kernel == "cpp")
    want = _decode(q, k_cache, v_cache, tables, seq_lens, 0.25, window or None)
    got = attend_decode(q, k_cache, v_cache, tables, seq_lens, 0.25, window)
    assert (got - want).abs().max() < 1e-5
    if window:
        unlimited = _decode(q, k_cache, v_cache, tables, seq_lens, 0.25, None)
        assert (got - unlimited).abs().max() > 1e-2, "the window must change the long rows"


@pytest.mark.parametrize("shape", [(9, 3, 64), (8, 8, 32), (16, 2, 128)])  # SmolLM2's, MHA, head size 128
def test_the_cpp_decode_kernel_matches_float64_at_every_head_shape(shape: tuple[int, int, int]) -> None:
    assert paged_decode.load()
    h, hkv, d = shape
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2**-7)):
        q, k_cache, v_cache, tables, lens = _paged([1, 15, 16, 17, 70], h, hkv, d, dtype, seed=h)
        assert paged_decode.serves(q, k_cache)
        got = paged_decode.run_kernel(q, k_cache, v_cache, tables, lens, d**-0.5, 0)
        args = (q.double(), k_cache.double(), v_cache.double(), tables, lens, d**-0.5, 0)
        want = paged_decode.decode_kernel(*args)
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_the_cpp_decode_kernel_refuses_what_it_does_not_serve() -> None:
    assert paged_decode.load()
    q, k_cache, *_ = _paged([5], 9, 3, 64, torch.float16)
    assert not paged_decode.serves(q, k_cache)  # fp16
    q, k_cache, *_ = _paged([5], 18, 1, 64, torch.float32)
    assert not paged_decode.serves(q, k_cache)  # 18 query heads per KV head
    q, k_cache, *_ = _paged([5], 4, 2, 24, torch.float32)
    assert not paged_decode.serves(q, k_cache)  # head size not a whole number of vectors


def test_a_decode_kernel_that_fails_to_build_leaves_the_inductor_one_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broken = tmp_path / "paged_decode.cpp"
    broken.write_text("this is not C++;\n")
    unload_kernel(paged_decode, monkeypatch, broken)
    with caplog.at_level(logging.WARNING, logger="asyncexec.ops.paged_decode"):
        assert not paged_decode.load()
    assert "could not build asyncexec's paged decode attention kernel" in caplog.text
    q, k_cache, v_cache, tables, lens = _paged([3, 9], 6, 2, 16, torch.float32)
    assert not paged_decode.serves(q, k_cache)
    want = _decode(q, k_cache, v_cache, tables, lens, 0.25, None)
    assert (attend_decode(q, k_cache, v_cache, tables, lens, 0.25, 0) - want).abs().max() < 1e-5


async def test_graph_steps_run_the_cpp_decode_kernel(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = paged_decode.run_kernel

    def counted(q: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(q.shape[0])
        return real(q, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(paged_decode, "run_kernel", counted)
    cfg = EngineConfig(
        model=str(tiny_models["llama"]), executor="uni", block_size=BLOCK, max_num_seqs=4,
        cudagraph_capture_sizes=(1, 4), kv_cache_memory_bytes=1 << 20,
    )  # fmt: skip
    from asyncexec import AsyncEngine

    async with AsyncEngine(cfg) as engine:
        start = len(calls)
        async for _ in engine.generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=5)):
            pass
        stats = (await engine.collective_rpc("get_runner_stats"))[0]
    assert stats["graph_steps"] >= 4, stats
    assert len(calls) - start >= 4 * 2, "each graph step's layers (2) call the C++ kernel"


async def _prompt_logprobs_bf16(
    model: Path, prompts: list[list[int]], eager: bool
) -> tuple[list[list[dict[int, float] | None]], dict[str, float]]:
    from asyncexec import AsyncEngine

    cfg = EngineConfig(
        model=str(model), executor="uni", dtype="bfloat16", enforce_eager=eager, max_model_len=512,
        cudagraph_capture_sizes=(1, 2), kv_cache_memory_bytes=4 << 20,
    )  # fmt: skip
    scored = []
    async with AsyncEngine(cfg) as engine:
        for p in prompts:  # one at a time: prefill-only steps, whose attention is the same op either way
            lps = None
            async for out in engine.generate(p, SamplingParams(max_tokens=0, prompt_logprobs=3)):
                lps = out.prompt_logprobs
            assert lps is not None
            scored.append(lps)
        stats = (await engine.collective_rpc("get_runner_stats"))[0]
    return scored, stats


async def test_bf16_prefill_through_the_compiled_graph_rounds_like_eager(
    tiny_models: dict[str, Path],
) -> None:
    """Inductor keeps a fused bf16 chain in float32 unless told to round where eager rounds; without that,
    these logprobs moved by 0.003-0.007 on average (and flipped smollm2's answer to a near-tie question)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 200) for _ in range(n)] for n in (7, 64, 300)]
    eager, _ = await _prompt_logprobs_bf16(tiny_models["llama"], prompts, eager=True)
    graph, stats = await _prompt_logprobs_bf16(tiny_models["llama"], prompts, eager=False)
    assert stats["mixed_graph_steps"] >= len(prompts), stats
    diffs = [
        abs(e[t] - g[t])
        for es, gs in zip(eager, graph, strict=True)
        for e, g in zip(es, gs, strict=True)
        if e is not None and g is not None
        for t in e
        if t in g
    ]
    assert len(diffs) >= 3 * 360
    mean = sum(diffs) / len(diffs)
    worst = max(diffs)
    assert mean < 5e-4, f"compiled bf16 prefill moved logprobs by {mean:.4f} on average (max {worst:.4f})"
