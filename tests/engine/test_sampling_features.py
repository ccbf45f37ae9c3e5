"""AsyncEngine's issue-14 sampling features on a tiny model: n and best_of, stop strings, prompt logprobs,
penalties and bias, each against a reference (HF's forward, HF's generate, a run with n=1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from asyncexec import AsyncEngine, InvalidRequestError, RequestOutput, SamplingParams
from tests.engine.test_engine import collect, engine_config

PROMPT = [5, 17, 200, 3, 9, 44, 12, 8, 1, 2, 3, 4, 5, 6, 7, 99, 100, 101, 102]  # 19 tokens: 4 blocks and 3


async def finals(engine: AsyncEngine, prompt: list[int] | str, sp: SamplingParams) -> list[RequestOutput]:
    """Each copy's last output, by index."""
    last: dict[int, RequestOutput] = {}
    async for out in engine.generate(prompt, sp):
        last[out.index] = out
    assert all(o.finished for o in last.values())
    return [last[i] for i in sorted(last)]


async def test_seeded_copies_differ_and_copy_i_is_the_request_seeded_seed_plus_i(
    tiny_models: dict[str, Path],
) -> None:
    sp = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)
    async with AsyncEngine(engine_config(tiny_models["llama"])) as engine:
        outs = await finals(engine, PROMPT, sp)
        again = await finals(engine, PROMPT, sp)
        alone = [
            await collect(
                engine, PROMPT, SamplingParams(temperature=1.0, seed=5 + i, max_tokens=10, ignore_eos=True)
            )
            for i in range(3)
        ]
        unseeded = await finals(
            engine, PROMPT, SamplingParams(n=3, temperature=1.0, max_tokens=10, ignore_eos=True)
        )
    ids = [o.token_ids for o in outs]
    assert [o.index for o in outs] == [0, 1, 2] and len({tuple(t) for t in ids}) == 3
    assert ids == [o.token_ids for o in again] == [o.token_ids for o in alone]
    assert all(o.request_id == outs[0].request_id for o in outs)
    assert len({tuple(o.token_ids) for o in unseeded}) == 3


async def test_the_prompt_is_prefilled_once_and_greedy_copies_equal_one_request(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduled: list[dict[str, int]] = []
    async with AsyncEngine(engine_config(tiny_models["llama"])) as engine:
        ref = await collect(engine, PROMPT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        assert engine.scheduler is not None
        schedule = engine.scheduler.schedule

        def recording() -> Any:
            so = schedule()
            scheduled.append(dict(so.num_scheduled_tokens))
            return so

        monkeypatch.setattr(engine.scheduler, "schedule", recording)
        sp = SamplingParams(n=4, temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
        outs = await finals(engine, PROMPT, sp)  # prompt logprobs: no prefix-cache hit on ref's blocks
    assert [o.token_ids for o in outs] == [ref.token_ids] * 4
    computed = sum(n for step in scheduled for n in step.values())
    # 19 prompt tokens once, then each of 3 copies recomputes the last 3 (its partial block), then decodes.
    assert computed == 19 + 3 * 3 + 4 * 7
    assert all(o.prompt_logprobs == outs[0].prompt_logprobs for o in outs) and outs[0].prompt_logprobs


async def test_leaving_early_aborts_every_copy_and_frees_their_blocks(tiny_models: dict[str, Path]) -> None:
    async with AsyncEngine(engine_config(tiny_models["llama"])) as engine:
        sp = SamplingParams(n=4, temperature=1.0, max_tokens=500, ignore_eos=True)
        stream = engine.generate(PROMPT, sp)
        seen = {(await anext(stream)).index for _ in range(6)}
        assert len(seen) > 1, "several copies were running"
        await stream.aclose()
        stats = engine.stats()
        assert stats["num_free_blocks"] == stats["num_blocks"] and not engine.has_unfinished_requests()
        aborted = engine.metrics.registry.get_sample_value(
            "asyncexec_requests_finished_total", {"finish_reason": "abort"}
        )
        assert aborted == 4


async def test_best_of_returns_the_n_copies_with_the_highest_cumulative_logprob(
    tiny_models: dict[str, Path],
) -> None:
    common: dict[str, Any] = {"temperature": 1.0, "seed": 11, "max_tokens": 6, "ignore_eos": True}
    async with AsyncEngine(engine_config(tiny_models["llama"])) as engine:
        every = await finals(engine, PROMPT, SamplingParams(n=4, logprobs=0, **common))
        best = await finals(engine, PROMPT, SamplingParams(n=2, best_of=4, **common))
    ranked = sorted(every, key=lambda o: -(o.cumulative_logprob or 0.0))
    assert [o.token_ids for o in best] == [o.token_ids for o in ranked[:2]]
    assert [o.index for o in best] == [0, 1] and best[0].logprobs is None, "logprobs were not asked for"
    for o in every:
        assert o.logprobs is not None and o.cumulative_logprob is not None
        assert o.cumulative_logprob == pytest.approx(
            sum(d[t] for d, t in zip(o.logprobs, o.token_ids, strict=True))
        )


async def test_a_stop_string_ends_the_text_there_and_frees_the_blocks_at_once(
    tiny_models: dict[str, Path],
) -> None:
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    async with AsyncEngine(engine_config(tiny_models["llama"])) as engine:
        full = await collect(engine, "hello there", sp)
        text = full.text or ""
        at = next(
            i
            for i in range(8, len(text) - 3)
            if text.find(text[i : i + 3]) == i and "\ufffd" not in text[i : i + 3]
        )
        stop = text[at : at + 3]  # three characters, each its own byte-level token: a match across tokens
        out = await collect(
            engine,
            "hello there",
            SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=["zzzz", stop]),
        )
        assert out.finish_reason == "stop" and out.stop_reason == stop and out.text == text[:at]
        assert len(out.token_ids) < 40 and out.token_ids == full.token_ids[: len(out.token_ids)]
        stats = engine.stats()
        assert stats["num_free_blocks"] == stats["num_blocks"]
        kept = await collect(
            engine,
            "hello there",
            SamplingParams(
                temperature=0.0, max_tokens=40, ignore_eos=True, stop=stop, include_stop_str_in_output=True
            ),
        )
        assert kept.text == text[: at + 3]
        tok = full.token_ids[5]
        by_id = await collect(
            engine,
            "hello there",
            SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[tok]),
        )
        assert by_id.stop_reason == tok and by_id.token_ids[-1] == tok and by_id.finish_reason == "stop"


async def test_prompt_logprobs_equal_hfs_log_softmax_over_a_chunked_prefill(
    tiny_models: dict[str, Path],
) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_models["llama"]
    prompt = [(7 * i + 3) % 250 for i in range(45)]  # 45 tokens over chunks of at most 16
    async with AsyncEngine(engine_config(path, max_num_batched_tokens=16)) as engine:
        out = await collect(engine, prompt, SamplingParams(max_tokens=0, prompt_logprobs=3))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0].log_softmax(-1)
    assert out.token_ids == [] and out.finish_reason == "length"
    assert (
        out.prompt_logprobs is not None and out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 45
    )
    for pos in range(1, 45):
        d = out.prompt_logprobs[pos]
        assert d is not None
        row = ref[pos - 1]
        assert abs(d[prompt[pos]] - float(row[prompt[pos]])) < 1e-4
        top = row.topk(3)
        assert set(top.indices.tolist()) <= set(d), f"position {pos}: the top 3 are returned"
        assert all(abs(d[int(t)] - float(v)) < 1e-4 for t, v in zip(top.indices, top.values, strict=True))
        assert (
            out.prompt_logprob_ranks is not None
            and out.prompt_logprob_ranks[pos] == int((row > row[prompt[pos]]).sum()) + 1
        )


async def test_greedy_with_a_repetition_penalty_equals_hf_generate(tiny_models: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_models["llama"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([PROMPT])
    ref = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=16,
        do_sample=False,
        repetition_penalty=1.5,
        min_new_tokens=16,
    )
    async with AsyncEngine(engine_config(path)) as engine:
        out = await collect(
            engine,
            PROMPT,
            SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.5, min_tokens=16),
        )
        plain = await collect(engine, PROMPT, SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16))
        biased = await collect(
            engine, PROMPT, SamplingParams(temperature=0.0, max_tokens=5, logit_bias={42: 200})
        )
    assert out.token_ids == ref[0, len(PROMPT) :].tolist()
    assert out.token_ids != plain.token_ids, "the penalty changed the greedy choice"
    assert biased.token_ids == [42] * 5, "a bias clamped to 100 still wins every step"


async def test_sampling_fields_are_checked_at_the_door(tiny_models: dict[str, Path]) -> None:
    async with AsyncEngine(engine_config(tiny_models["llama"])) as engine:
        with pytest.raises(InvalidRequestError, match="logit_bias: token ids must be below") as e:
            engine.add_request(PROMPT, SamplingParams(logit_bias={10**6: 1.0}))
        assert e.value.param == "logit_bias"
        with pytest.raises(InvalidRequestError, match="prompt_logprobs: at most max_logprobs=20"):
            engine.add_request(PROMPT, SamplingParams(prompt_logprobs=21))
    with pytest.raises(InvalidRequestError, match=r"max_tokens must be an integer >= 1 \(0 only"):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidRequestError, match="stop must be a non-empty string or a list of at most 8"):
        SamplingParams(stop=[str(i) for i in range(9)])
    with pytest.raises(InvalidRequestError, match=r"best_of must be an integer in \[n, 128\]"):
        SamplingParams(n=3, best_of=2)
