"""A KV cache smaller than one `max_model_len` sequence: a warning at start-up, a request that could never
fit refused at admission (a 400 naming the limit through the server), and no request left waiting."""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

import pytest

from asyncexec import AsyncEngine, EngineConfig, InvalidRequestError, SamplingParams
from asyncexec.entrypoints.api_server import build_app
from tests.engine.test_engine import collect, engine_config
from tests.entrypoints.test_server_hardening import app_client, assert_error


def small_cache(model: Path) -> EngineConfig:
    """40 blocks of 4 tokens: a KV cache far smaller than one sequence of max_model_len=512."""
    return engine_config(
        model, kv_cache_memory_bytes=40 * 2048, max_model_len=512, enable_prefix_caching=False
    )


async def test_a_request_the_cache_cannot_hold_is_refused_and_the_rest_are_served(
    tiny_models: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="asyncexec.engine.supervisor")
    async with AsyncEngine(small_cache(tiny_models["llama"])) as engine:
        holds = (engine.num_blocks - 1) * 4
        assert holds + 1 < 512 and engine.max_seq_len == holds + 1
        assert f"the KV cache holds {holds} tokens" in caplog.text and "max_model_len=512" in caplog.text
        prompt = list(range(1, holds // 2))
        too_many = SamplingParams(temperature=0.0, max_tokens=holds, ignore_eos=True)
        with pytest.raises(InvalidRequestError, match=f"needs {len(prompt) + holds - 1} tokens of KV cache, "
                           f"but the cache holds {holds} "):  # fmt: skip
            engine.add_request(prompt, too_many)
        huge = list(range(1, holds + 2))
        refusal = f"prompt of {holds + 1} tokens needs more KV blocks than the cache holds: it holds {holds} "
        with pytest.raises(InvalidRequestError, match=refusal) as info:
            engine.add_request(huge, SamplingParams(max_tokens=1))
        assert info.value.param == "prompt"
        most = holds + 1 - len(prompt)
        full = SamplingParams(temperature=0.0, max_tokens=most, ignore_eos=True)
        short = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        # the one that fills the whole cache and three behind it, which it preempts as it grows
        outs = await asyncio.wait_for(
            asyncio.gather(
                collect(engine, prompt, full), *(collect(engine, [i, 2, 3], short) for i in range(3))
            ),
            60,
        )
        assert [len(o.token_ids) for o in outs] == [most, 3, 3, 3]
        assert all(o.finish_reason == "length" for o in outs)
        stats = engine.stats()
        assert stats["num_free_blocks"] == stats["num_blocks"] and not engine.has_unfinished_requests()


async def test_the_server_answers_400_naming_the_cache_and_fits_its_default_max_tokens(
    tiny_models: dict[str, Path],
) -> None:
    async with app_client(build_app(small_cache(tiny_models["llama"]))) as c:
        metrics = (await c.get("/metrics")).text
        holds = int(float(re.search(r"^asyncexec_kv_cache_blocks (\S+)$", metrics, re.M)[1])) * 4  # type: ignore[index]
        r = await c.post("/v1/completions", json={"prompt": list(range(1, 101)), "max_tokens": holds})
        assert assert_error(r, 400, f"but the cache holds {holds} ")["param"] == "max_tokens"
        r = await c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        # without max_tokens a chat may fill what the cache holds (not max_model_len, which it cannot)
        chat = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.0, "ignore_eos": True}
        r = await asyncio.wait_for(c.post("/v1/chat/completions", json=chat), 60)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == holds + 1
