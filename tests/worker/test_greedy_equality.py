"""Token-for-token equality with `model.generate(do_sample=False)` through the executor and the worker,
in graph mode (the default: compiled decode graphs on CPU, CUDA graphs on CUDA) for uniform decode steps.

Each case drives the workers with the engine's own `Scheduler` (tests/worker/driver.py) through mixed
prompt lengths, a small token budget (chunked prefill, steps that mix prefill and decode), requests that
join mid-stream and finish early (their blocks are reused), and a KV cache too small for all of them
(the newest running request is preempted and recomputed later).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from asyncexec import EngineConfig, Executor, SamplingParams, WorkerStartupError
from asyncexec.config import ExecutorKind
from tests.conftest import hf_greedy
from tests.worker.driver import Driver, Req

BLOCK = 4
CASES: list[tuple[str, ExecutorKind, int]] = [
    ("llama", "uni", 1),
    ("qwen2", "uni", 1),
    ("mistral", "uni", 1),
    ("gpt2", "uni", 1),
    ("llama", "mp", 1),
    ("llama", "mp", 2),
    ("qwen2", "mp", 2),
    ("mistral", "mp", 2),
]


def workload(seed: int) -> list[Req]:
    rng = random.Random(seed)
    greedy = SamplingParams(temperature=0.0)
    lengths = [1, 3, BLOCK, 2 * BLOCK, 2 * BLOCK + 1, 13, 29, 40]
    reqs = []
    for i, n in enumerate(lengths):
        prompt = [rng.randrange(256) for _ in range(n)]
        reqs.append(Req(f"r{i}", prompt, rng.choice([3, 6, 10]), greedy, arrive=rng.choice([0, 0, 2, 5])))
    return reqs


def config(path: Path, kind: ExecutorKind, ranks: int, **kw: object) -> EngineConfig:
    fields: dict[str, object] = {
        "block_size": BLOCK,
        "max_num_batched_tokens": 16,
        "max_num_seqs": 8,
        "kv_cache_memory_bytes": 1 << 20,
        "check_rank_agreement": ranks > 1,
    }
    fields.update(kw)
    return EngineConfig(model=str(path), executor=kind, tensor_parallel_size=ranks, **fields)  # type: ignore[arg-type]


async def start_with_cache(cfg: EngineConfig) -> tuple[Executor, int]:
    ex = Executor.create(cfg)
    await ex.start()
    block_bytes = max(await ex.collective_rpc("get_kv_cache_block_bytes"))
    num_blocks = await ex.determine_available_memory() // block_bytes
    await ex.initialize_kv_cache(num_blocks)
    return ex, num_blocks


async def run_and_compare(
    model: Path, cfg: EngineConfig, seed: int, reqs: list[Req] | None = None
) -> tuple[Driver, list[Any], int]:
    """The workload through the executor against HF greedy, token for token; (driver, runner stats,
    KV blocks). 16 usable blocks (block 0 is the null block): too few for all requests at once, so blocks
    are reused and running requests are preempted."""
    reqs = workload(seed) if reqs is None else reqs
    refs = hf_greedy(model, [r.prompt for r in reqs], max_new_tokens=max(r.max_tokens for r in reqs))
    ex, num_blocks = await start_with_cache(cfg)
    try:
        driver = Driver(ex, num_blocks=17, block_size=BLOCK, budget=16, max_seqs=8)
        for r in reqs:
            driver.add(r)
        got = await driver.run()
        stats = await ex.collective_rpc("get_runner_stats")
    finally:
        await ex.shutdown()
    for r, ref in zip(reqs, refs, strict=True):
        want = ref[: r.max_tokens]
        assert got[r.req_id][: len(want)] == want, f"{r.req_id} (prompt of {len(r.prompt)} tokens) diverged"
    return driver, stats, num_blocks


@pytest.mark.parametrize(("arch", "kind", "ranks"), CASES, ids=[f"{a}-{k}{n}" for a, k, n in CASES])
async def test_greedy_equals_hf_generate(
    tiny_models: dict[str, Path], arch: str, kind: ExecutorKind, ranks: int
) -> None:
    model = tiny_models[arch]
    driver, stats, num_blocks = await run_and_compare(model, config(model, kind, ranks), seed=len(arch))
    assert all(s["graph_steps"] > 0 for s in stats), "graph mode (the default) never replayed"
    assert num_blocks >= 17
    assert driver.max_blocks_in_use <= 16
    assert driver.num_preemptions > 0 and driver.mixed_steps > 0 and driver.chunked > 0


async def test_a_single_capture_size_of_one_starts_and_equals_hf_generate(
    tiny_models: dict[str, Path],
) -> None:
    """Start-up also warms the kernel mixed steps' decode rows use (2 rows and 1): that must work when
    only batches of one are captured."""
    model = tiny_models["llama"]
    _, stats, _ = await run_and_compare(model, config(model, "uni", 1, cudagraph_capture_sizes=(1,)), seed=1)
    assert stats[0]["graph_steps"] > 0


async def test_gpt2_with_two_ranks_fails_at_start_naming_the_architecture(
    tiny_models: dict[str, Path],
) -> None:
    ex = Executor.create(config(tiny_models["gpt2"], "mp", 2))
    with pytest.raises(
        WorkerStartupError, match=r"GPT2LMHeadModel cannot be split over 2 ranks.*tensor-parallel"
    ):
        await ex.start()


async def test_an_architecture_without_the_attention_interface_is_refused(tmp_path: Path) -> None:
    from transformers import FalconConfig, FalconForCausalLM

    cfg = FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4)
    FalconForCausalLM(cfg).save_pretrained(tmp_path / "falcon")
    ex = Executor.create(config(tmp_path / "falcon", "uni", 1))
    with pytest.raises(WorkerStartupError, match="FalconForCausalLM cannot run on asyncexec"):
        await ex.start()


async def test_layers_that_compile_differently_keep_dynamos_guards_and_equal_hf_generate(
    tmp_path: Path,
) -> None:
    """Qwen2 with a sliding window on some layers only: those layers' graphs differ from the others', so
    no step may call one compiled entry for every layer without dynamo's guards (the window would apply
    to the wrong layers, and contexts past it would diverge from HF)."""
    from asyncexec.testing import make_tiny_model

    model = make_tiny_model(
        tmp_path / "qwen2-mixed", "qwen2", use_sliding_window=True, sliding_window=6, max_window_layers=1
    )
    layer_types = json.loads((model / "config.json").read_text())["layer_types"]
    assert len(set(layer_types)) == 2, layer_types
    _, stats, _ = await run_and_compare(model, config(model, "uni", 1), seed=5)
    assert stats[0]["graph_steps"] > 0
    assert stats[0]["guard_free_steps"] == 0


async def test_graph_steps_call_the_compiled_layers_without_dynamos_guards(
    tiny_models: dict[str, Path],
) -> None:
    model = tiny_models["llama"]
    _, stats, _ = await run_and_compare(model, config(model, "uni", 1), seed=2)
    assert stats[0]["graph_steps"] > 0
    assert stats[0]["guard_free_steps"] == stats[0]["graph_steps"]


SPEC_CASES: list[tuple[str, ExecutorKind, int, bool]] = [
    ("llama", "uni", 1, False),
    ("llama", "uni", 1, True),
    ("llama", "mp", 2, False),
    ("qwen2", "mp", 2, False),
]


@pytest.mark.parametrize(
    ("arch", "kind", "ranks", "eager"),
    SPEC_CASES,
    ids=[f"{a}-{k}{n}{'-eager' * e}" for a, k, n, e in SPEC_CASES],
)
async def test_speculative_decoding_equals_hf_generate(
    tiny_models: dict[str, Path], arch: str, kind: ExecutorKind, ranks: int, eager: bool
) -> None:
    """n-gram drafts verified in the step's forward, amid chunked prefills and preemption, on one rank and
    two (every rank verifies the same drafts: `check_rank_agreement`): greedy output equals HF's."""
    rng = random.Random(7)
    greedy = SamplingParams(temperature=0.0)
    reqs = []
    for i in range(8):  # prompts that repeat a phrase (drafts to find) and prompts that do not
        phrase = [rng.randrange(256) for _ in range(rng.randint(3, 7))]
        prompt = (
            phrase * rng.randint(2, 5)
            if i % 2 == 0
            else [rng.randrange(256) for _ in range(rng.randint(3, 30))]
        )
        reqs.append(Req(f"r{i}", prompt, rng.choice([8, 16, 24]), greedy, arrive=rng.choice([0, 0, 2, 5])))
    spec = {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "disable_by_batch_size": None}
    cfg = config(tiny_models[arch], kind, ranks, speculative_config=spec, enforce_eager=eager)
    driver, stats, _ = await run_and_compare(tiny_models[arch], cfg, seed=0, reqs=reqs)
    assert driver.stats["spec_decode_num_drafts"] >= 10, driver.stats
    assert driver.stats["spec_decode_num_accepted_tokens"] >= 10, driver.stats
    assert driver.num_preemptions > 0 and driver.chunked > 0
    if not eager:  # steps of decode and verify rows alone replay the decode graphs
        assert all(s["graph_steps"] > 0 and s["guard_free_steps"] == s["graph_steps"] for s in stats), stats
