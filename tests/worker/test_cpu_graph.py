"""CPU graph mode: compiled decode layers that never recompile in steady state, and the in-place decode
kernel against the eager gather-and-SDPA path it replaces."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch._dynamo.utils

from asyncexec import EngineConfig, Executor, SamplingParams
from asyncexec.worker.attention import _decode
from asyncexec.worker.paged_decode import attend_decode
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
    assert compiled_graphs() == after_start, "a step compiled a new graph after start-up"


@pytest.mark.parametrize("window", [0, 5])
def test_the_in_place_kernel_matches_the_eager_decode_in_float32(window: int) -> None:
    gen = torch.Generator().manual_seed(0)
    num_blocks, bs, hkv, h, d = 64, 4, 2, 6, 16
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=gen)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=gen)
    lens = torch.tensor([1, 3, 4, 9, 17, 30])
    blocks = torch.randperm(num_blocks - 1, generator=gen) + 1  # scattered, never the null block
    tables = torch.zeros(len(lens), 8, dtype=torch.int64)
    used = 0
    for i, n in enumerate(lens.tolist()):
        need = -(-n // bs)
        tables[i, :need] = blocks[used : used + need]
        used += need
    q = torch.randn(len(lens), h, d, generator=gen)
    want = _decode(q, k_cache, v_cache, tables, lens, 0.25, window or None)
    got = attend_decode(q, k_cache, v_cache, tables, lens, 0.25, window)
    assert (got - want).abs().max() < 1e-5
    if window:
        unlimited = _decode(q, k_cache, v_cache, tables, lens, 0.25, None)
        assert (got - unlimited).abs().max() > 1e-2, "the window must change the long rows"
