"""The OpenAI-compatible server as a real uvicorn process, driven over HTTP with httpx."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from asyncexec import AsyncEngine, SamplingParams
from tests.engine.test_engine import collect, engine_config
from tests.entrypoints.server import ServerProcess

FLAGS = (
    "--block-size",
    "4",
    "--max-num-seqs",
    "4",
    "--max-waiting-requests",
    "4",  # above the 3 requests the equality tests send at once, far below the overload test's 16
    "--max-num-batched-tokens",
    "48",
    "--kv-cache-memory-bytes",
    str(4 << 20),
)
PROMPTS: list[str | list[int]] = ["hello world", [5, 17, 200, 3, 9], "The quick brown fox jumps"]


@pytest.fixture(scope="module")
def server(tiny_models: dict[str, Path]) -> Iterator[ServerProcess]:
    with ServerProcess(tiny_models["llama"], *FLAGS) as srv:
        yield srv


def data_events(raw: bytes) -> list[Any]:
    """The decoded `data:` payloads of an SSE body, checking OpenAI's framing on the way."""
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    out = []
    for ev in events[:-2]:
        assert ev.startswith(b"data: ") and b"\n" not in ev, ev
        out.append(json.loads(ev[len(b"data: ") :]))
    return out


def metrics(client: httpx.Client) -> dict[str, float]:
    text = client.get("/metrics").text
    return {
        s.name + json.dumps(s.labels, sort_keys=True): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


async def test_completions_match_engine_generate(server: ServerProcess, tiny_models: dict[str, Path]) -> None:
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    async with AsyncEngine(engine_config(tiny_models["llama"])) as engine:
        refs = [await collect(engine, p, sp) for p in PROMPTS]
    body = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
        plain = await asyncio.gather(*(c.post("/v1/completions", json=dict(body, prompt=p)) for p in PROMPTS))
        streamed = await asyncio.gather(
            *(c.post("/v1/completions", json=dict(body, prompt=p, stream=True)) for p in PROMPTS)
        )
    for ref, r, s in zip(refs, plain, streamed, strict=True):
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["object"] == "text_completion" and out["model"] == str(tiny_models["llama"])
        choice = out["choices"][0]
        assert choice["token_ids"] == ref.token_ids and choice["text"] == ref.text
        assert choice["finish_reason"] == "length"
        n = len(ref.prompt_token_ids)
        assert out["usage"] == {"prompt_tokens": n, "completion_tokens": 12, "total_tokens": n + 12}
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        chunks = data_events(s.content)
        assert {c["id"] for c in chunks} == {chunks[0]["id"]} and chunks[0]["id"].startswith("cmpl-")
        assert all(c["object"] == "text_completion" for c in chunks)
        assert "".join(c["choices"][0]["text"] for c in chunks) == ref.text
        assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == ref.token_ids
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]


async def test_chat_completions_apply_the_template(
    server: ServerProcess, tiny_models: dict[str, Path]
) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    async with AsyncEngine(engine_config(tiny_models["llama"])) as engine:
        ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        ref = await collect(engine, list(ids), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
        r = await c.post("/v1/chat/completions", json=body)
        s = await c.post(
            "/v1/chat/completions", json=dict(body, stream=True, stream_options={"include_usage": True})
        )
    out = r.json()
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"] == {"role": "assistant", "content": ref.text}
    assert out["usage"]["prompt_tokens"] == len(ids)
    chunks = data_events(s.content)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks[1:-1]) == ref.text
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8


def test_logprobs_models_and_health(server: ServerProcess, tiny_models: dict[str, Path]) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post(
            "/v1/completions", json={"prompt": "abc", "max_tokens": 5, "logprobs": 2, "temperature": 0}
        )
        lp = r.json()["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
        assert all(x <= 0 for x in lp["token_logprobs"]) and all(1 <= len(t) <= 3 for t in lp["top_logprobs"])
        assert c.get("/v1/models").json()["data"][0]["id"] == str(tiny_models["llama"])
        for name in (str(tiny_models["llama"]), "llama"):  # the served name, or the folder's name
            assert (
                c.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "model": name}).status_code
                == 200
            )
        assert c.get("/health").status_code == 200


def test_a_disconnect_mid_stream_aborts_the_request(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        before = metrics(c)
        body = {"prompt": "abc", "max_tokens": 1500, "ignore_eos": True, "stream": True, "temperature": 0}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            got = 0
            for line in r.iter_lines():
                got += line.startswith("data: ")
                if got == 3:
                    break
        deadline = time.monotonic() + 10
        while True:
            m = metrics(c)
            aborted = m['asyncexec_requests_finished_total{"finish_reason": "abort"}']
            prior = before['asyncexec_requests_finished_total{"finish_reason": "abort"}']
            free, blocks = m["asyncexec_kv_cache_free_blocks{}"], m["asyncexec_kv_cache_blocks{}"]
            if aborted == prior + 1 and free == blocks and m["asyncexec_num_requests_running{}"] == 0:
                break
            assert time.monotonic() < deadline, (
                f"no abort seen: {aborted} (was {prior}), {free}/{blocks} free"
            )
            time.sleep(0.1)
        generated = m["asyncexec_generation_tokens_total{}"] - before["asyncexec_generation_tokens_total{}"]
        assert generated < 1500


async def test_overload_answers_429(server: ServerProcess) -> None:
    body = {"prompt": [1, 2, 3], "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
        rs = await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(16)))
    codes = sorted(r.status_code for r in rs)
    assert set(codes) == {200, 429} and codes.count(200) >= 2, codes
    err = next(r for r in rs if r.status_code == 429).json()["error"]
    assert (
        err["type"] == "rate_limit_exceeded"
        and err["code"] == 429
        and "max_waiting_requests" in err["message"]
    )


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": "x"}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
        ("/v1/completions", {"prompt": [999999]}, 400, "prompt"),
        ("/v1/completions", {"prompt": [1] * 5000}, 400, "prompt"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 1000}, 400, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "seed": 2**70}, 400, "seed"),
        ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 9}, 400, "stop"),
        (
            "/v1/completions",
            {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            400,
            "response_format",
        ),
        ("/v1/completions", {"prompt": "hi", "model": "gpt-9"}, 404, "model"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "nobody", "content": "x"}]}, 400, "messages[0].role"),
        ("/v1/completions", b"{not json", 400, None),
    ],
)
def test_invalid_bodies_answer_400_naming_the_field(
    server: ServerProcess, path: str, body: Any, status: int, param: str | None
) -> None:
    kw: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + path, timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["param"] == param and err["message"]


def test_metrics_parse_and_move(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        before = metrics(c)
        r = c.post("/v1/completions", json={"prompt": [1, 2, 3, 4], "max_tokens": 6, "ignore_eos": True})
        assert r.status_code == 200
        after = metrics(c)
    moved = {k: after[k] - before.get(k, 0.0) for k in after}
    assert moved['asyncexec_requests_finished_total{"finish_reason": "length"}'] == 1
    assert moved["asyncexec_prompt_tokens_total{}"] == 4
    assert moved["asyncexec_generation_tokens_total{}"] == 6
    assert moved["asyncexec_time_to_first_token_seconds_count{}"] == 1
    assert moved["asyncexec_inter_token_latency_seconds_count{}"] == 5
    assert moved["asyncexec_step_time_seconds_count{}"] >= 6
    assert moved["asyncexec_prefix_cache_queries_total{}"] == 4
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_ratio",
        "prefix_cache_hit_rate",
    ):
        assert f"asyncexec_{name}{{}}" in after
    assert after["asyncexec_worker_restarts_total{}"] == 0


def test_health_is_503_after_a_worker_is_killed(tiny_models: dict[str, Path]) -> None:
    with ServerProcess(tiny_models["llama"], *FLAGS, "--executor", "mp") as srv:
        assert srv.proc is not None
        workers = psutil.Process(srv.proc.pid).children()
        assert len(workers) == 1
        workers[0].send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 5
        while (r := httpx.get(srv.url + "/health", timeout=5)).status_code == 200:
            assert time.monotonic() < deadline, "health stayed 200 after the worker died"
            time.sleep(0.05)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
        assert r.status_code == 503 and "died" in r.json()["error"]["message"]
        assert srv.stop() == 0


def test_sigterm_drains_running_requests_then_aborts_the_rest(tiny_models: dict[str, Path]) -> None:
    # 1 s lets 10 tokens finish even on a loaded machine, and 2000 cannot (over 0.5 ms a step is certain).
    with ServerProcess(tiny_models["llama"], *FLAGS, "--shutdown-timeout", "1") as srv:
        assert srv.proc is not None
        short = {"prompt": "a", "max_tokens": 10, "ignore_eos": True, "stream": True, "temperature": 0}
        long = dict(short, prompt="b", max_tokens=2000)
        with (
            httpx.stream("POST", srv.url + "/v1/completions", json=short, timeout=60) as a,
            httpx.stream("POST", srv.url + "/v1/completions", json=long, timeout=60) as b,
        ):
            lines_a, lines_b = a.iter_lines(), b.iter_lines()
            assert next(lines_a).startswith("data: ") and next(lines_b).startswith("data: ")
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            rest_a = [line for line in lines_a if line]
            assert rest_a[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest_a[-2]  # it finished
            rest_b = [line for line in lines_b if line]  # the long one ends once the timeout passes
        assert rest_b[-1] == "data: [DONE]", rest_b[-3:]  # properly: no cut chunked transfer
        err = json.loads(rest_b[-2][len("data: ") :])["error"]
        assert err["code"] == 503 and err["type"] == "service_unavailable" and "shutdown" in err["message"]
        assert all("finish_reason" not in line or '"finish_reason":null' in line for line in rest_b)
        assert srv.proc.wait(30) == 0
        assert 0.9 < time.monotonic() - t0 < 20
        with pytest.raises(httpx.ConnectError):
            httpx.get(srv.url + "/health", timeout=2)
        log = srv.output()
        assert "draining" in log
        assert "Traceback" not in log and "CancelledError" not in log, log
        assert len([line for line in log.splitlines() if "aborted cmpl-" in line]) == 1, log


async def test_chat_without_a_template_is_a_clear_400(tiny_models: dict[str, Path]) -> None:
    from starlette.applications import Starlette

    from asyncexec.entrypoints.api_server import OpenAIServing

    async with AsyncEngine(engine_config(tiny_models["llama"])) as engine:
        engine.tokenizer.chat_template = None
        app = Starlette(routes=OpenAIServing(engine, "llama").routes)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
            ok = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
    assert ok.status_code == 200
