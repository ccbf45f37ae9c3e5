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


def _hf_processed(logits: torch.Tensor, history: list[int], processor: object) -> torch.Tensor:
    return processor(torch.tensor([history]), logits.clone())  # type: ignore[operator, no-any-return]


def test_repetition_penalty_equals_hfs_processor_and_moves_the_greedy_argmax() -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    from asyncexec.worker.logits_processors import apply_logits_processors

    torch.manual_seed(0)
    logits = torch.randn(3, 64) * 3
    histories = [[1, 5, 5, 9, 40], [2, 3, 4], [63, 0, 7, 7, 7, 12]]
    prompts = [2, 1, 4]  # the penalty covers prompt and output alike
    params = [SamplingParams(temperature=0.0, repetition_penalty=p) for p in (1.3, 0.7, 2.0)]
    got = apply_logits_processors(logits.clone(), params, histories, prompts)
    for i, sp in enumerate(params):
        ref = _hf_processed(
            logits[i : i + 1], histories[i], RepetitionPenaltyLogitsProcessor(sp.repetition_penalty)
        )
        torch.testing.assert_close(got[i : i + 1], ref, rtol=0, atol=0)
    # The sampler applies it before the argmax of a greedy row: the favourite, once seen, loses.
    top = int(logits[0].argmax())
    logits[0, top] = 1.0 + logits[0].topk(2).values[1]  # a narrow lead, which a 2x penalty undoes
    (tok,), _ = Sampler(0)(
        logits[:1], [SamplingParams(temperature=0.0, repetition_penalty=2.0)], [1], [[top]], [1]
    )
    assert tok != top and tok == int(
        _hf_processed(logits[:1], [top], RepetitionPenaltyLogitsProcessor(2.0)).argmax()
    )


def test_presence_and_frequency_penalties_count_only_output_tokens() -> None:
    from asyncexec.worker.logits_processors import apply_logits_processors

    torch.manual_seed(1)
    logits = torch.randn(2, 32)
    history = [[3, 3, 4, 4, 4, 5], [8, 9, 9]]
    num_prompt = [2, 1]  # row 0's output is [4, 4, 4, 5]; its prompt's 3s are not penalized
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(presence_penalty=-1.0, frequency_penalty=1.5),
    ]
    got = apply_logits_processors(logits.clone(), params, history, num_prompt)
    ref = logits.clone()
    for i, sp in enumerate(params):
        out = history[i][num_prompt[i] :]
        for t in set(
            out
        ):  # OpenAI's definition: mu[j] - c[j] * alpha_frequency - (c[j] > 0) * alpha_presence
            ref[i, t] -= out.count(t) * sp.frequency_penalty + sp.presence_penalty
    torch.testing.assert_close(got, ref)
    assert got[0, 3] == logits[0, 3]


def test_logit_bias_is_clamped_and_min_tokens_masks_stop_tokens_until_reached() -> None:
    from transformers import MinNewTokensLengthLogitsProcessor

    from asyncexec.worker.logits_processors import apply_logits_processors

    logits = torch.zeros(2, 16)
    sp = SamplingParams(logit_bias={3: 500.0, 4: -7.5}, min_tokens=3, all_stop_token_ids=[2, 9])
    got = apply_logits_processors(logits.clone(), [sp, sp], [[1, 1, 5], [1, 1, 5, 6, 7]], [1, 1])
    assert got[0, 3] == got[1, 3] == 100.0 and got[0, 4] == -7.5
    hf = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=1, min_new_tokens=3, eos_token_id=[2, 9])
    for row, hist in ((0, [1, 1, 5]), (1, [1, 1, 5, 6, 7])):
        ref = _hf_processed(logits[row : row + 1], hist, hf)
        ref[0, 3], ref[0, 4] = 100.0, -7.5
        torch.testing.assert_close(got[row : row + 1], ref)
    assert got[0, 2] == float("-inf") and got[1, 2] == 0.0, "two outputs are under 3, four are not"


def test_bad_words_ban_single_tokens_always_and_a_longer_words_end_after_its_prefix() -> None:
    from asyncexec.worker.logits_processors import apply_logits_processors

    logits = torch.zeros(3, 16)
    sp = SamplingParams(bad_words_token_ids=[[7], [3, 4, 5]])
    hists = [[1, 3, 4], [1, 3], [3, 4, 9]]  # the prompt is [1] in rows 0 and 1, [3, 4] in row 2
    got = apply_logits_processors(logits.clone(), [sp] * 3, hists, [1, 1, 2])
    assert torch.isinf(got[:, 7]).all(), "a one-token bad word is always banned"
    assert got[0, 5] == float("-inf"), "the output ends with [3, 4]: 5 would complete the word"
    assert got[1, 5] == 0 and got[2, 5] == 0, "no prefix, or the prefix only in the prompt (vLLM's)"
    assert int((got == float("-inf")).sum()) == 4
