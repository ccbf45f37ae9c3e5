"""Issue 14 on the real model, through the official `openai` client: echo and prompt logprobs against HF's
logits, penalties against HF's logits processors, stop strings streamed, n with and without seeds, the
API key, and a tokenize round trip."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, cast

import httpx
import openai
import pytest
import torch
from starlette.applications import Starlette
from starlette.middleware import Middleware

from asyncexec import AsyncEngine
from asyncexec.entrypoints.api_server import OpenAIServing
from asyncexec.entrypoints.guards import APIKeyGuard
from tests.real_model.test_smollm2 import real_config

KEY = "sk-real-1"
TEXT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"


@pytest.fixture
async def api() -> AsyncIterator[Any]:
    """An `openai.AsyncOpenAI` client on the server's app, in process, behind the API key."""
    async with AsyncEngine(real_config(max_num_batched_tokens=16)) as engine:  # prompts are chunked
        app = Starlette(
            routes=OpenAIServing(engine, "smollm2").routes, middleware=[Middleware(APIKeyGuard, api_key=KEY)]
        )
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://localhost/v1", timeout=300
        ) as http:
            # newer clients annotate their own httpx fork; any httpx-compatible client works at runtime
            yield openai.AsyncOpenAI(api_key=KEY, base_url="http://localhost/v1", http_client=cast(Any, http))


class OpenAIPenalties:
    """OpenAI's presence and frequency penalties as an HF logits processor, over the generated tokens."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = input_ids[0, self.prompt_len :]
        counts = torch.zeros_like(scores[0]).scatter_add_(0, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


async def test_echo_with_logprobs_equals_hfs_log_softmax(
    api: Any, smollm2_hf: Any, smollm2_tokenizer: Any
) -> None:
    ids = smollm2_tokenizer.encode(TEXT)
    r = await api.completions.create(model="smollm2", prompt=TEXT, echo=True, logprobs=5, max_tokens=0)
    lp = r.choices[0].logprobs
    with torch.no_grad():
        ref = smollm2_hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    assert r.choices[0].text == TEXT and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        assert abs(lp.token_logprobs[pos] - float(ref[pos - 1, ids[pos]])) < 1e-4, pos
        top = ref[pos - 1].topk(5)
        want = {
            smollm2_tokenizer.decode([int(t)]): float(v) for t, v in zip(top.indices, top.values, strict=True)
        }
        for text, value in want.items():
            assert abs(lp.top_logprobs[pos][text] - value) < 1e-4, (pos, text)


async def test_greedy_penalties_equal_hf_generate_with_its_logits_processors(
    api: Any, smollm2_hf: Any, smollm2_tokenizer: Any
) -> None:
    from transformers import LogitsProcessorList

    ids = smollm2_tokenizer.encode(TEXT)
    x = torch.tensor([ids])
    extra = {"repetition_penalty": 1.3, "ignore_eos": True, "return_token_ids": True}
    r = await api.completions.create(
        model="smollm2",
        prompt=TEXT,
        max_tokens=20,
        temperature=0,
        presence_penalty=0.4,
        frequency_penalty=0.3,
        extra_body=extra,
    )
    ref = smollm2_hf.generate(
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=20,
        min_new_tokens=20,
        do_sample=False,
        repetition_penalty=1.3,
        logits_processor=LogitsProcessorList([OpenAIPenalties(len(ids), 0.4, 0.3)]),
    )
    plain = await api.completions.create(
        model="smollm2",
        prompt=TEXT,
        max_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    got = (
        r.model_extra["choices"][0]["token_ids"]
        if "choices" in (r.model_extra or {})
        else r.choices[0].model_extra["token_ids"]
    )
    assert got == ref[0, len(ids) :].tolist()
    assert got != plain.choices[0].model_extra["token_ids"], "the penalties changed the answer"


async def test_stop_strings_stream_without_a_partial_match(api: Any) -> None:
    full = await api.completions.create(model="smollm2", prompt=TEXT, max_tokens=30, temperature=0)
    text = full.choices[0].text
    at = text.index(" ", 6)
    stop = text[at : at + 6]  # spans several tokens
    stream = await api.completions.create(
        model="smollm2", prompt=TEXT, max_tokens=30, temperature=0, stop=[stop], stream=True
    )
    pieces, reasons = [], []
    async for chunk in stream:
        pieces.append(chunk.choices[0].text)
        reasons.append(chunk.choices[0].finish_reason)
    sent = "".join(pieces)
    assert sent == text[:at] and reasons[-1] == "stop"
    chat = await api.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Name three colors."}],
        max_tokens=40,
        temperature=0,
    )
    words = chat.choices[0].message.content
    cut = words[3:8]
    again = await api.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Name three colors."}],
        max_tokens=40,
        temperature=0,
        stop=cut,
    )
    assert (
        again.choices[0].message.content == words[: words.index(cut)]
        and again.choices[0].finish_reason == "stop"
    )


async def test_n_with_and_without_seeds(api: Any) -> None:
    kw: dict[str, Any] = {"model": "smollm2", "prompt": "My favourite thing is", "max_tokens": 12, "n": 3}
    kw.update(temperature=1.0, extra_body={"return_token_ids": True})
    seeded = [await api.completions.create(seed=42, **kw) for _ in range(2)]
    texts = [[c.text for c in r.choices] for r in seeded]
    assert texts[0] == texts[1] and len(set(texts[0])) == 3, "seed + index: distinct and reproducible"
    assert [c.index for c in seeded[0].choices] == [0, 1, 2]
    free = await api.completions.create(**kw)
    assert len({c.text for c in free.choices}) == 3
    assert free.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in free.choices)


async def test_a_wrong_key_is_refused_and_tokenize_round_trips(api: Any) -> None:
    wrong = openai.AsyncOpenAI(api_key="sk-nope", base_url="http://localhost/v1", http_client=api._client)
    with pytest.raises(openai.AuthenticationError):
        await wrong.completions.create(model="smollm2", prompt="hi", max_tokens=1)
    http = api._client
    headers = {"Authorization": f"Bearer {KEY}"}
    tok = (await http.post("http://localhost/tokenize", json={"prompt": TEXT}, headers=headers)).json()
    back = (
        await http.post("http://localhost/detokenize", json={"tokens": tok["tokens"]}, headers=headers)
    ).json()
    assert back == {"prompt": TEXT}
    with pytest.raises(openai.BadRequestError, match="metadata"):
        await api.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "hi"}], metadata={"a": "b"}
        )
