"""The built-in real model end to end: HF equality, the chat template, EOS, streamed text, a bad TP size."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from asyncexec import AsyncEngine, EngineConfig, SamplingParams, WorkerStartupError
from asyncexec.config import ExecutorKind
from asyncexec.engine.detokenizer import IncrementalDetokenizer
from asyncexec.entrypoints.api_server import OpenAIServing
from tests.real_model.conftest import hf_greedy_ids

PROMPTS = [
    "The capital of France is",
    "Photosynthesis is the process by which plants",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]
MULTILINGUAL = [
    "Écris une phrase en français sur le café et les croissants.",
    "日本の首都はどこですか。",
    "Translate to German: the weather is nice today 🙂",
]


def real_config(kind: ExecutorKind = "uni", **kw: Any) -> EngineConfig:
    fields: dict[str, Any] = {
        "dtype": "float32",
        "kv_cache_memory_bytes": 48 << 20,
        "max_model_len": 512,
        "max_num_batched_tokens": 64,  # the longer prompts are chunked, and mixed with decodes
    }
    fields.update(kw)
    return EngineConfig(model="smollm2", executor=kind, **fields)


async def final(engine: AsyncEngine, prompt: str | list[int], sp: SamplingParams) -> Any:
    last = None
    async for out in engine.generate(prompt, sp):
        last = out
    assert last is not None and last.finished
    return last


@pytest.mark.parametrize(("kind", "eager"), [("uni", False), ("mp", False), ("uni", True)])
async def test_greedy_equals_hf_generate_token_for_token_on_real_text(
    kind: ExecutorKind, eager: bool, smollm2_tokenizer: Any, smollm2_hf: Any
) -> None:
    """Graph mode (compiled decode layers, in-place decode attention) and the eager path alike."""
    prompts = [smollm2_tokenizer.encode(p) for p in PROMPTS]
    sp = SamplingParams(temperature=0.0, max_tokens=24)
    async with AsyncEngine(real_config(kind, enforce_eager=eager)) as engine:
        outs = await asyncio.gather(*(final(engine, p, sp) for p in prompts))
        stats = (await engine.collective_rpc("get_runner_stats"))[0]
    assert (stats["graph_steps"] > 0) is not eager, stats
    refs = [hf_greedy_ids(smollm2_hf, p, 24) for p in prompts]
    for prompt, out, ref in zip(PROMPTS, outs, refs, strict=True):
        assert out.token_ids == ref, (
            f"{prompt!r}: engine {out.text!r} != HF {smollm2_tokenizer.decode(ref)!r}"
        )
    assert outs[0].text.startswith(" Paris")


async def test_chat_completions_apply_the_template_exactly_and_eos_stops(smollm2_tokenizer: Any) -> None:
    messages = [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    ids = list(
        smollm2_tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    eos = smollm2_tokenizer.eos_token_id
    async with AsyncEngine(real_config()) as engine:
        app = Starlette(routes=OpenAIServing(engine, "smollm2").routes)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            r = await client.post(
                "/v1/chat/completions",
                json={"messages": messages, "max_tokens": 64, "temperature": 0, "return_token_ids": True},
            )
        direct = await final(engine, ids, SamplingParams(temperature=0.0, max_tokens=64))
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert choice["token_ids"] == direct.token_ids
    assert choice["message"]["content"] == direct.text
    assert "Paris" in choice["message"]["content"]
    # The answer ended on EOS, well before max_tokens, and the EOS token is not in the text.
    assert direct.token_ids[-1] == eos and len(direct.token_ids) < 64
    assert choice["finish_reason"] == "stop" and direct.finish_reason == "stop"
    assert smollm2_tokenizer.eos_token not in choice["message"]["content"]


async def test_streamed_text_equals_the_decode_of_its_tokens(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    sp = {"max_tokens": 40, "temperature": 1.0, "seed": 3, "ignore_eos": True, "return_token_ids": True}
    streams: list[tuple[str, list[int]]] = []
    async with AsyncEngine(real_config()) as engine:
        app = Starlette(routes=OpenAIServing(engine, "smollm2").routes)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            for prompt in MULTILINGUAL:
                r = await client.post("/v1/completions", json={"prompt": prompt, "stream": True, **sp})
                text, ids = "", []
                for line in r.text.splitlines():
                    if line.startswith("data: {"):
                        choice = json.loads(line[6:])["choices"][0]
                        text += choice["text"]
                        ids += choice["token_ids"]
                streams.append((text, ids))
    for text, ids in streams:
        assert len(ids) == 40
        assert text == tok.decode(ids, skip_special_tokens=True)
    joined = "".join(t for t, _ in streams)
    assert any(ord(c) > 0x7F for c in joined), "the prompts should make the model write multi-byte text"


def test_incremental_detokenizer_matches_decode_on_the_real_tokenizer(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    texts = [
        " leading spaces,  double spaces and\ttabs",
        "café naïve über 日本語の文章 🙂🙃 ∑x²",
        "\n\n  code:\n    return x  # ok",
        *MULTILINGUAL,
    ]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        d = IncrementalDetokenizer(tok)
        streamed = "".join(d.update(ids[:i]) for i in range(1, len(ids) + 1)) + d.flush(ids)
        assert streamed == tok.decode(ids, skip_special_tokens=True) == text


async def test_tensor_parallel_2_is_refused_naming_the_head_counts(smollm2: Path) -> None:
    config = EngineConfig(model=str(smollm2), tensor_parallel_size=2, executor="mp", dtype="float32")
    with pytest.raises(WorkerStartupError, match=r"num_attention_heads=9, num_key_value_heads=3") as info:
        async with AsyncEngine(config):
            pass
    assert "divisible by 2" in str(info.value)
    assert "reshape" not in str(info.value)
