"""The server's issue-14 API over real HTTP: every OpenAI request field honoured or refused by name, API keys,
tokenize/detokenize/version, stop strings streamed, n with indices, echo and prompt logprobs, usage."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.entrypoints.server import ServerProcess
from tests.entrypoints.test_server import FLAGS, data_events

KEY = "sk-test-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "hi there"}]
Check = Callable[[dict[str, Any], dict[str, Any]], object]  # fails the test itself when not honoured


@pytest.fixture(scope="module")
def server(tiny_models: dict[str, Path]) -> Iterator[ServerProcess]:
    os.environ["ASYNCEXEC_API_KEY"] = KEY  # the server takes its key from the environment
    try:
        with ServerProcess(tiny_models["llama"], *FLAGS, "--max-num-seqs", "8") as srv:
            yield srv
    finally:
        del os.environ["ASYNCEXEC_API_KEY"]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c:
        yield c


def _json_start(r: dict[str, Any]) -> None:
    """8 tokens of a JSON object (a one-byte tokenizer): it begins with `{`, in either endpoint's shape."""
    c = r["choices"][0]
    text = c["text"] if "text" in c else c["message"]["content"]
    assert text.startswith("{"), text


def greedy(**kw: Any) -> dict[str, Any]:
    return {"temperature": 0, "max_tokens": 8, "ignore_eos": True, "return_token_ids": True, **kw}


def ids(body: dict[str, Any], i: int = 0) -> list[int]:
    return list(body["choices"][i]["token_ids"])


# Every field of OpenAI's completion request, each with a value other than its default, and what honouring
# it looks like (`base` is the same request without the field); None: not implemented, a 400 naming it.
# Negative penalties reward repeats, which changes any greedy output of the tiny model's near-flat logits.
COMPLETION_FIELDS: list[tuple[str, Any, Check | None]] = [
    ("model", "llama", lambda r, base: None),
    ("prompt", [5, 6, 7], lambda r, base: r["usage"]["prompt_tokens"] == 3 or pytest.fail("prompt")),
    ("best_of", 3, lambda r, base: len(r["choices"]) == 1 or pytest.fail("best_of")),
    (
        "echo",
        True,
        lambda r, base: (
            r["choices"][0]["text"] == PROMPT + base["choices"][0]["text"] or pytest.fail("not honoured")
        ),
    ),
    ("frequency_penalty", -2.0, lambda r, base: ids(r) != ids(base) or pytest.fail("frequency_penalty")),
    ("logit_bias", {"42": 100}, lambda r, base: ids(r) == [42] * 8 or pytest.fail("logit_bias")),
    (
        "logprobs",
        2,
        lambda r, base: len(r["choices"][0]["logprobs"]["top_logprobs"]) == 8 or pytest.fail("not honoured"),
    ),
    ("max_tokens", 3, lambda r, base: r["usage"]["completion_tokens"] == 3 or pytest.fail("max_tokens")),
    ("n", 2, lambda r, base: [c["index"] for c in r["choices"]] == [0, 1] or pytest.fail("n")),
    ("presence_penalty", -2.0, lambda r, base: ids(r) != ids(base) or pytest.fail("presence_penalty")),
    ("seed", 7, lambda r, base: None),  # checked with temperature 1 in its own test
    ("stop", ["\x00never"], lambda r, base: ids(r) == ids(base) or pytest.fail("stop")),
    ("stream", True, None),  # checked below: the SSE body
    ("stream_options", {"include_usage": True}, None),  # only with stream: a 400 naming it otherwise
    ("suffix", "x", None),
    (
        "temperature",
        1.5,
        lambda r, base: r["choices"][0]["finish_reason"] == "length" or pytest.fail("not honoured"),
    ),
    ("top_p", 1e-6, lambda r, base: ids(r) == ids(base) or pytest.fail("top_p")),  # the nucleus is the argmax
    ("user", "someone", lambda r, base: None),
]
CHAT_FIELDS: list[tuple[str, Any, Check | None]] = [
    ("audio", {"voice": "alloy", "format": "mp3"}, None),
    ("frequency_penalty", -2.0, lambda r, base: ids(r) != ids(base) or pytest.fail("frequency_penalty")),
    ("function_call", "auto", None),
    ("functions", [{"name": "f"}], None),
    ("logit_bias", {"42": 100}, lambda r, base: ids(r) == [42] * 8 or pytest.fail("logit_bias")),
    (
        "logprobs",
        True,
        lambda r, base: len(r["choices"][0]["logprobs"]["content"]) == 8 or pytest.fail("not honoured"),
    ),
    (
        "max_completion_tokens",
        3,
        lambda r, base: r["usage"]["completion_tokens"] == 3 or pytest.fail("not honoured"),
    ),
    ("max_tokens", 4, lambda r, base: r["usage"]["completion_tokens"] == 4 or pytest.fail("max_tokens")),
    ("metadata", {"a": "b"}, None),
    ("modalities", ["text", "audio"], None),
    ("n", 3, lambda r, base: [c["index"] for c in r["choices"]] == [0, 1, 2] or pytest.fail("n")),
    ("parallel_tool_calls", False, None),
    ("prediction", {"type": "content", "content": "x"}, None),
    ("presence_penalty", -2.0, lambda r, base: ids(r) != ids(base) or pytest.fail("presence_penalty")),
    ("prompt_cache_key", "k", None),
    ("reasoning_effort", "low", None),
    ("response_format", {"type": "json_object"}, lambda r, base: _json_start(r)),
    ("safety_identifier", "s", None),
    ("seed", 7, lambda r, base: None),
    ("service_tier", "flex", None),
    ("stop", "\x00never", lambda r, base: ids(r) == ids(base) or pytest.fail("stop")),
    ("store", True, None),
    ("stream_options", {"include_usage": True}, None),
    (
        "temperature",
        1.5,
        lambda r, base: r["choices"][0]["finish_reason"] == "length" or pytest.fail("not honoured"),
    ),
    ("tool_choice", "none", None),
    ("tools", [{"type": "function", "function": {"name": "f"}}], None),
    ("top_logprobs", 2, None),  # needs logprobs: true, a 400 naming it otherwise
    ("top_p", 1e-6, lambda r, base: ids(r) == ids(base) or pytest.fail("top_p")),
    ("user", "someone", lambda r, base: None),
    ("verbosity", "low", None),
    ("web_search_options", {}, None),
]


@pytest.mark.parametrize(
    ("path", "field", "value", "check"),
    [("/v1/completions", *f) for f in COMPLETION_FIELDS if f[0] != "stream"]
    + [("/v1/chat/completions", *f) for f in CHAT_FIELDS],
    ids=[f"completions-{f[0]}" for f in COMPLETION_FIELDS if f[0] != "stream"]
    + [f"chat-{f[0]}" for f in CHAT_FIELDS],
)
def test_every_openai_field_is_honoured_or_refused_by_name(
    client: httpx.Client, path: str, field: str, value: Any, check: Check | None
) -> None:
    base_body = greedy(prompt=PROMPT) if path == "/v1/completions" else greedy(messages=MESSAGES)
    base = client.post(path, json=base_body)
    r = client.post(path, json=dict(base_body, **{field: value}))
    if check is None:
        assert r.status_code == 400, f"{field}: {r.status_code} {r.text[:200]}"
        err = r.json()["error"]
        assert err["param"] == field and field in err["message"], err
        return
    assert r.status_code == 200 and base.status_code == 200, r.text[:300]
    check(r.json(), base.json())


def test_the_api_key_guards_the_api_and_leaves_probes_open(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for method, path in [
            ("POST", "/v1/completions"),
            ("GET", "/v1/models"),
            ("POST", "/tokenize"),
            ("POST", "/detokenize"),
            ("POST", "/v1/chat/completions"),
        ]:
            for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": KEY}):
                r = c.request(method, path, json={"prompt": "hi"}, headers=headers)
                assert r.status_code == 401, (path, headers, r.status_code)
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["code"] == 401
        for path in ("/health", "/metrics", "/version"):
            assert c.get(path).status_code == 200, path
        assert c.get("/version").json() == {"version": "0.1.0"}
        ok = c.post(
            "/v1/completions",
            json={"prompt": "hi", "max_tokens": 1},
            headers={"Authorization": f"bearer {KEY}"},
        )
        assert ok.status_code == 200


def test_tokenize_round_trips_and_counts_what_the_endpoints_count(client: httpx.Client) -> None:
    text = "Hello, world: naïve café 🙂"
    tok = client.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) and tok["max_model_len"] > 0
    assert client.post("/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": text}
    done = client.post("/v1/completions", json={"prompt": text, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == tok["count"]
    chat = client.post("/tokenize", json={"messages": MESSAGES}).json()
    done = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}).json()
    assert chat["count"] == done["usage"]["prompt_tokens"] and chat["token_strs"] is None
    short = client.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert short["count"] < chat["count"]
    bad = client.post("/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_a_streamed_stop_string_is_never_partly_sent(client: httpx.Client) -> None:
    full = client.post("/v1/completions", json=greedy(prompt=PROMPT, max_tokens=40)).json()["choices"][0][
        "text"
    ]
    at = next(
        i
        for i in range(6, len(full) - 4)
        if full.find(full[i : i + 4]) == i and "\ufffd" not in full[i : i + 4]
    )
    stop = full[at : at + 4]
    body = greedy(prompt=PROMPT, max_tokens=40, stop=[stop])
    plain = client.post("/v1/completions", json=body).json()["choices"][0]
    chunks = data_events(client.post("/v1/completions", json=dict(body, stream=True)).content)
    texts = [c["choices"][0]["text"] for c in chunks]
    assert plain["text"] == "".join(texts) == full[:at] and plain["stop_reason"] == stop
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    sent = ""
    for t in texts:
        sent += t
        assert not any(stop.startswith(sent[k:]) for k in range(at, len(sent))), (
            "a piece of the stop went out"
        )


def test_n_streams_each_choice_with_its_index_and_usage_counts_every_token(client: httpx.Client) -> None:
    body = {
        "prompt": PROMPT,
        "n": 3,
        "max_tokens": 6,
        "ignore_eos": True,
        "seed": 4,
        "return_token_ids": True,
    }
    plain = client.post("/v1/completions", json=body).json()
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = data_events(
        client.post("/v1/completions", json=dict(body, stream=True, stream_options=opts)).content
    )
    per: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        per[choice["index"]] += choice["token_ids"]
        assert c["usage"]["completion_tokens"] == len(per[choice["index"]]), (
            "continuous usage: this choice so far"
        )
    assert [per[i] for i in range(3)] == [ids(plain, i) for i in range(3)], "seeded: the same three"
    assert len({tuple(v) for v in per.values()}) == 3
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 18
    assert plain["usage"] == {
        "prompt_tokens": plain["usage"]["prompt_tokens"],
        "completion_tokens": 18,
        "total_tokens": plain["usage"]["prompt_tokens"] + 18,
    }
    chat = client.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "n": 2, "max_tokens": 3, "stream": True}
    ).content
    roles = [c["choices"][0]["index"] for c in data_events(chat) if "role" in c["choices"][0]["delta"]]
    assert roles == [0, 1]


def test_echo_with_logprobs_and_max_tokens_0_scores_the_prompt(client: httpx.Client) -> None:
    body = {"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 0}
    r = client.post("/v1/completions", json=body).json()
    (choice,) = r["choices"]
    lp = choice["logprobs"]
    n = r["usage"]["prompt_tokens"]
    assert choice["text"] == PROMPT and r["usage"]["completion_tokens"] == 0
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(x < 0 for x in lp["token_logprobs"][1:]) and all(
        2 <= len(t) <= 3 for t in lp["top_logprobs"][1:]
    )
    assert "".join(lp["tokens"]) == PROMPT and lp["text_offset"][:3] == [0, 1, 2]
    more = client.post("/v1/completions", json=dict(body, max_tokens=3, temperature=0)).json()["choices"][0]
    assert (
        more["logprobs"]["token_logprobs"][:n] == lp["token_logprobs"]
        and len(more["logprobs"]["tokens"]) == n + 3
    )
    assert more["text"].startswith(PROMPT)
    vllm = client.post(
        "/v1/completions", json={"prompt": PROMPT, "prompt_logprobs": 1, "max_tokens": 1}
    ).json()
    plp = vllm["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == n
    assert all(
        d[str(t)]["logprob"] == pytest.approx(x)
        for d, t, x in zip(plp[1:], tok_ids(client), lp["token_logprobs"][1:], strict=True)
    )
    assert client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0}).status_code == 400


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_chat_asking_for_0_tokens_is_a_400_naming_the_field(client: httpx.Client, field: str) -> None:
    # max_completion_tokens: 0 once fell through to max_tokens and generated to max_model_len
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, field: 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert r.json()["error"]["message"] == f"{field} must be >= 1, got 0"


def tok_ids(client: httpx.Client) -> list[int]:
    return list(client.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"][1:])


def test_seeded_sampling_repeats_and_best_of_cannot_stream(client: httpx.Client) -> None:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 123, "ignore_eos": True}
    a, b = (client.post("/v1/completions", json=body).json()["choices"][0]["text"] for _ in range(2))
    assert a == b
    r = client.post("/v1/completions", json=dict(body, best_of=3, stream=True))
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
    s = client.post("/v1/completions", json=dict(body, stream=True))
    assert (
        "".join(
            json.loads(e[6:])["choices"][0]["text"] for e in s.text.split("\n\n") if e.startswith("data: {")
        )
        == a
    )


def test_vllm_prompt_logprobs_rank_the_top_k_around_the_actual_token() -> None:
    from asyncexec import RequestOutput
    from asyncexec.entrypoints.choices import prompt_logprobs_body

    # Position 1: the actual token 7 is the 2nd best, so the top-3 [4, 7, 9] leave 4 and 9 after it.
    # Position 2: the actual token 5 is 10th, outside the top-2 [1, 2].
    out = RequestOutput(
        "r",
        [3, 7, 5],
        [],
        [],
        prompt_logprobs=[None, {7: -1.0, 4: -0.5, 9: -2.0}, {5: -9.0, 1: -0.1, 2: -0.2}],
        prompt_logprob_ranks=[None, 2, 10],
    )
    body = prompt_logprobs_body(None, out)
    assert body is not None and body[0] is None and body[1] is not None and body[2] is not None
    assert {t: e["rank"] for t, e in body[1].items()} == {"7": 2, "4": 1, "9": 3}
    assert {t: e["rank"] for t, e in body[2].items()} == {"5": 10, "1": 1, "2": 2}
    assert body[1]["4"] == {"logprob": -0.5, "rank": 1, "decoded_token": "4"}
