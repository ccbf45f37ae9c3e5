"""Sampling: seeded reproducibility across runs and ranks, the filters, logprobs."""

from __future__ import annotations

from pathlib import Path

import torch

from asyncexec import SamplingParams
from asyncexec.worker.sampler import Sampler
from tests.worker.driver import Driver, Req
from tests.worker.test_greedy_equality import config, start_with_cache

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8], [1, 6, 1, 8, 0, 3, 3, 9, 8, 8, 7]]


async def _sample(path: Path, ranks: int, params: list[SamplingParams]) -> dict[str, list[int]]:
    cfg = config(path, "mp" if ranks > 1 else "uni", ranks, seed=1234)
    ex, _ = await start_with_cache(cfg)
    try:
        driver = Driver(ex, num_blocks=48, block_size=4, budget=16)
        for i, (p, sp) in enumerate(zip(PROMPTS, params, strict=True)):
            driver.add(Req(f"s{i}", p, 12, sp))
        return await driver.run()
    finally:
        await ex.shutdown()


async def test_seeded_sampling_is_reproducible_across_runs_and_ranks(tiny_models: dict[str, Path]) -> None:
    params = [
        SamplingParams(temperature=1.0, seed=7),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=8),
        SamplingParams(temperature=1.2, min_p=0.05, seed=9),
    ]
    one = await _sample(tiny_models["llama"], 1, params)
    again = await _sample(tiny_models["llama"], 1, params)
    two = await _sample(tiny_models["llama"], 2, params)  # check_rank_agreement is on with 2 ranks
    assert one == again == two
    other = await _sample(tiny_models["llama"], 1, [SamplingParams(temperature=1.0, seed=70), *params[1:]])
    assert other["s0"] != one["s0"] and other["s1"] == one["s1"], "a seed changes only its own request"


def test_top_k_1_is_greedy_and_filters_restrict_the_support() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    sampler = Sampler(seed=0)
    tokens, _ = sampler(logits, [SamplingParams(temperature=1.0, top_k=1, seed=i) for i in range(4)], [0] * 4)
    assert tokens == logits.argmax(-1).tolist()
    top5 = set(logits[0].topk(5).indices.tolist())
    for pos in range(50):
        (tok,), _ = sampler(logits[:1], [SamplingParams(temperature=2.0, top_k=5, seed=3)], [pos])
        assert tok in top5
    probs = logits[1].softmax(-1)
    nucleus = set(
        probs.argsort(descending=True)[
            : int((probs.sort(descending=True).values.cumsum(0) < 0.5).sum()) + 1
        ].tolist()
    )
    for pos in range(50):
        (tok,), _ = sampler(logits[1:2], [SamplingParams(top_p=0.5, seed=4)], [pos])
        assert tok in nucleus
    strong = {i for i, p in enumerate(probs.tolist()) if p >= 0.5 * probs.max()}
    for pos in range(50):
        (tok,), _ = sampler(logits[1:2], [SamplingParams(min_p=0.5, seed=5)], [pos])
        assert tok in strong


def test_logprobs_report_the_sampled_token_and_the_top_n() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    tokens, lp = Sampler(0)(logits, [SamplingParams(temperature=0.0, logprobs=2)], [0])
    assert tokens == [1] and lp is not None
    expect = logits.log_softmax(-1)[0]
    assert lp.token_ids == [[1, 1, 3]]
    assert torch.allclose(torch.tensor(lp.logprobs[0]), expect[[1, 1, 3]])
    assert lp.sampled_token_ranks == [1]


def test_a_tiny_positive_temperature_samples_greedily_not_nan() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 20
    params = [SamplingParams(temperature=t, seed=1) for t in (1e-45, 1e-38, 9e-6)]
    tokens, _ = Sampler(seed=0)(logits, params, [0, 0, 0])
    assert tokens == logits.argmax(-1).tolist()
    assert all(p.greedy for p in params) and not SamplingParams(temperature=1e-4).greedy
