"""KV-cache sizing: bytes per block, available memory, the allocated shapes, per-rank heads under TP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from asyncexec import EngineConfig, Executor
from asyncexec.executor.uniproc import UniProcExecutor
from asyncexec.worker.worker import CPU_KV_CACHE_FRACTION, CPU_KV_CACHE_MAX_BYTES, _mem_available_bytes
from tests.worker.test_greedy_equality import config

# tiny llama: 2 layers, 4 query heads, 2 KV heads, head_dim 16, float32
LAYERS, KV_HEADS, HEAD_DIM, F32 = 2, 2, 16, 4


async def test_block_bytes_and_allocated_shapes(tiny_models: dict[str, Path]) -> None:
    cfg = config(tiny_models["llama"], "uni", 1, kv_cache_memory_bytes=3 << 20)
    async with Executor.create(cfg) as ex:
        assert isinstance(ex, UniProcExecutor)
        (block_bytes,) = await ex.collective_rpc("get_kv_cache_block_bytes")
        assert block_bytes == LAYERS * 2 * cfg.block_size * KV_HEADS * HEAD_DIM * F32
        available = await ex.determine_available_memory()
        assert available == 3 << 20
        num_blocks = available // block_bytes
        await ex.initialize_kv_cache(num_blocks)
        runner = ex._workers[0].model_runner
        assert runner is not None and len(runner.kv_caches) == LAYERS
        for k, v in runner.kv_caches:
            assert k.shape == v.shape == (num_blocks, cfg.block_size, KV_HEADS, HEAD_DIM)
            assert k.dtype == torch.float32
        used = sum(k.numel() * k.element_size() * 2 for k, _ in runner.kv_caches)
        assert used <= available


async def test_cpu_default_is_a_capped_share_of_available_memory(tiny_models: dict[str, Path]) -> None:
    cfg = EngineConfig(model=str(tiny_models["llama"]), executor="uni")
    async with Executor.create(cfg) as ex:
        got = await ex.determine_available_memory()
    expect = min(int(_mem_available_bytes() * CPU_KV_CACHE_FRACTION), CPU_KV_CACHE_MAX_BYTES)
    assert abs(got - expect) <= 0.05 * expect


async def test_tensor_parallel_ranks_size_their_cache_from_the_heads_they_see(
    tiny_models: dict[str, Path],
) -> None:
    cfg = config(tiny_models["llama"], "mp", 2)
    async with Executor.create(cfg) as ex:
        per_rank = await ex.collective_rpc("get_kv_cache_block_bytes")
    hf = json.loads((tiny_models["llama"] / "config.json").read_text())
    head_dim = hf["hidden_size"] // hf["num_attention_heads"]
    heads_per_rank = hf["num_key_value_heads"] // cfg.tensor_parallel_size  # the tp plan splits k/v_proj
    dtype_bytes = torch.empty(0, dtype=getattr(torch, hf.get("dtype") or hf["torch_dtype"])).element_size()
    expect = hf["num_hidden_layers"] * 2 * cfg.block_size * heads_per_rank * head_dim * dtype_bytes
    assert per_rank == [expect, expect]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_cuda_graph_replay_matches_eager(tiny_models: dict[str, Path]) -> None:
    from tests.worker.driver import Driver
    from tests.worker.test_greedy_equality import start_with_cache, workload

    results = []
    for eager in (True, False):
        cfg = config(tiny_models["llama"], "uni", 1, device="cuda", enforce_eager=eager)
        ex, _ = await start_with_cache(cfg)
        try:
            driver = Driver(ex, num_blocks=25, block_size=4, budget=16, max_seqs=8)
            for r in workload(seed=1):
                driver.add(r)
            results.append(await driver.run())
        finally:
            await ex.shutdown()
    assert results[0] == results[1]
