"""Requests that once reached the workers and failed the step for everyone: now rejected at the door."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncexec import AsyncEngine, InvalidRequestError, SamplingParams
from asyncexec.sampling_params import MAX_STOP_STRING_CHARS
from tests.engine.test_engine import GREEDY, collect, engine_config


@pytest.mark.parametrize(
    ("field", "make"),
    [
        ("logprobs", lambda: SamplingParams(logprobs=1000)),  # topk beyond the vocabulary failed the step
        ("logprobs", lambda: SamplingParams(logprobs=21)),  # over max_logprobs
        ("seed", lambda: SamplingParams(seed=2**70)),  # msgpack cannot carry it to the workers
        ("max_tokens", lambda: SamplingParams(max_tokens=2**64)),
        ("top_k", lambda: SamplingParams(top_k=-(2**64))),
        ("stop_token_ids", lambda: SamplingParams(stop_token_ids=[2**63])),
    ],
)
async def test_unsendable_or_oversized_sampling_is_rejected(
    tiny_models: dict[str, Path], field: str, make: object
) -> None:
    async with AsyncEngine(engine_config(tiny_models["llama"])) as engine:
        with pytest.raises(InvalidRequestError, match=field) as rejected:
            engine.add_request([1, 2, 3], make())  # type: ignore[operator]
        assert rejected.value.param == field
        out = await collect(engine, [1, 2, 3], GREEDY)  # the engine is untouched
        assert out.finish_reason == "length" and engine.is_healthy


async def test_max_logprobs_is_configurable(tiny_models: dict[str, Path]) -> None:
    async with AsyncEngine(engine_config(tiny_models["llama"], max_logprobs=40)) as engine:
        out = await collect(engine, [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3, logprobs=40))
        assert out.logprobs is not None and all(40 <= len(d) <= 41 for d in out.logprobs)


async def test_token_ids_outside_the_vocabulary_are_rejected(tiny_models: dict[str, Path]) -> None:
    async with AsyncEngine(engine_config(tiny_models["llama"])) as engine:
        vocab = engine.model_info["vocab_size"]
        for field, params in (
            ("stop_token_ids", SamplingParams(stop_token_ids=[5, 1_000_000_000])),
            ("logit_bias", SamplingParams(logit_bias={vocab: 1.0})),
        ):
            with pytest.raises(InvalidRequestError, match=f"^{field}: .* vocabulary's {vocab}, got") as e:
                engine.add_request([1, 2, 3], params)
            assert e.value.param == field
        last = SamplingParams(temperature=0.0, max_tokens=3, stop_token_ids=[vocab - 1])
        assert (await collect(engine, [1, 2, 3], last)).finished


def test_a_stop_string_longer_than_the_cap_is_rejected() -> None:
    assert SamplingParams(stop="x" * MAX_STOP_STRING_CHARS).stop_strings  # at the cap: accepted
    cap = f"^stop: each stop string must be at most {MAX_STOP_STRING_CHARS} characters, got 100000$"
    with pytest.raises(InvalidRequestError, match=cap) as e:
        SamplingParams(stop=["ok", "x" * 100_000])
    assert e.value.param == "stop"
