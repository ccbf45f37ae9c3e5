"""The server's structured outputs and tool calls over real HTTP, on the tiny model (one token per byte):
response_format, vLLM's structured_outputs and guided_* aliases, named and required tool choices (whole
and streamed), the hermes parser, and 400s naming the field while the server keeps serving."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import msgspec
import pytest

from asyncexec.entrypoints.tool_calls import MAX_TOOL_CALLS, ChatTool, ToolCalls, parse_hermes, tool_calls_for
from asyncexec.outputs import RequestOutput
from tests.entrypoints.server import ServerProcess
from tests.entrypoints.test_server import FLAGS, data_events

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "ping", "parameters": {
        "type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"],
        "additionalProperties": False}}},
]  # fmt: skip
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client(tiny_models: dict[str, Path]) -> Iterator[httpx.Client]:
    with (
        ServerProcess(tiny_models["llama"], *FLAGS, "--tool-call-parser", "hermes") as srv,
        httpx.Client(base_url=srv.url, timeout=120) as c,
    ):
        yield c


def chat(client: httpx.Client, **kw: Any) -> dict[str, Any]:
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 60, "seed": 1, **kw})
    assert r.status_code == 200, r.text
    return dict(r.json())


def complete(client: httpx.Client, **kw: Any) -> str:
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 60, "seed": 1, **kw})
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def test_response_format_json_schema_and_json_object_hold(client: httpx.Client) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        body = chat(client, response_format=fmt, seed=seed)
        jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), SCHEMA)
        assert body["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(complete(client, response_format=fmt)), SCHEMA)
    text = chat(client, response_format={"type": "json_object"}, max_tokens=8)["choices"][0]["message"]
    assert text["content"].startswith("{")


def test_vllm_structured_outputs_and_the_guided_aliases_hold(client: httpx.Client) -> None:
    assert complete(client, guided_choice=["yes", "no"]) in ("yes", "no")
    assert complete(client, structured_outputs={"choice": ["left", "right"]}) in ("left", "right")
    assert re.fullmatch(r"[a-z]{3}\d", complete(client, guided_regex=r"[a-z]{3}\d"))
    assert re.fullmatch(r"[0-9]{1,3}!", complete(client, structured_outputs={"regex": "[0-9]{1,3}!"}))
    jsonschema.validate(json.loads(complete(client, guided_json=SCHEMA)), SCHEMA)
    jsonschema.validate(json.loads(complete(client, structured_outputs={"json": SCHEMA})), SCHEMA)
    spaced = complete(client, guided_json=SCHEMA, guided_whitespace_pattern="  ")
    assert "  " in spaced and json.loads(spaced)  # the pattern is the whitespace allowed
    assert re.fullmatch("ab+c", complete(client, guided_grammar='start: "a" "b"+ "c"'))


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"guided_regex": "(ab"}, "guided_regex", "cannot be compiled"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_json": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "guided_json", "nope"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}, "required": ["a"]}}}},
         "response_format", "nowhere"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"grammar": "start: nothing"}}, "structured_outputs", "cannot be compiled"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "both constrain"),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "guided_json"),
        ({"guided_regex": r"[^\s\S]"}, "guided_regex", "no output can satisfy it"),
        ({"guided_json": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}, "guided_json",
         "no output can satisfy it"),
        ({"guided_grammar": 'start: A\nA: "a" & "b"'}, "guided_grammar", "no output can satisfy it"),
        ({"guided_regex": "(?=a)b"}, "guided_regex", "invalid regex: look-around"),
    ],
)  # fmt: skip
def test_bad_constraints_answer_400_naming_the_field_and_the_server_goes_on(
    client: httpx.Client, body: dict[str, Any], param: str, needle: str
) -> None:
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err
    assert "\n" not in err["message"] and len(err["message"]) < 160, err  # one line, no llguidance dump
    assert complete(client, max_tokens=2)  # the engine keeps serving


def test_a_named_tool_choice_returns_a_tool_call_of_that_function(client: httpx.Client) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    body = chat(client, tools=TOOLS, tool_choice=choice)
    c = body["choices"][0]
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
    (call,) = c["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA)


def test_a_function_without_parameters_is_called_with_no_arguments(client: httpx.Client) -> None:
    tools = [{"type": "function", "function": {"name": "now"}}]
    body = chat(client, tools=tools, tool_choice={"type": "function", "function": {"name": "now"}}, seed=3)
    c = body["choices"][0]
    assert c["finish_reason"] == "tool_calls", c
    (call,) = c["message"]["tool_calls"]
    assert call["function"]["name"] == "now" and json.loads(call["function"]["arguments"]) == {}


def test_required_calls_are_a_choice_of_the_tools(client: httpx.Client) -> None:
    def check(body: dict[str, Any]) -> list[dict[str, Any]]:
        c = body["choices"][0]
        assert c["finish_reason"] == "tool_calls", c
        for call in c["message"]["tool_calls"]:
            tool = next(t for t in TOOLS if t["function"]["name"] == call["function"]["name"])
            jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])
        return list(c["message"]["tool_calls"])

    names = set()
    for seed in range(4):  # one call each: the random model would go on adding calls to max_tokens
        body = chat(
            client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=seed, max_tokens=100
        )
        (call,) = check(body)
        names.add(call["function"]["name"])
    assert names <= {"get_weather", "ping"}
    two = chat(client, tools=TOOLS, tool_choice="required", seed=0, max_tokens=20)
    cut = two["choices"][0]  # cut by max_tokens before a call completed: the text as content
    assert cut["finish_reason"] == "length" and cut["message"]["content"].startswith("[{")
    assert "tool_calls" not in cut["message"]


def test_required_calls_of_functions_without_parameters_stop_after_one_each(client: httpx.Client) -> None:
    """A function without parameters is called at most once: the array ends, not `max_tokens`."""
    now = {"type": "function", "function": {"name": "now"}}
    for seed in range(4):
        c = chat(client, tools=[now], tool_choice="required", seed=seed, max_tokens=300)["choices"][0]
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None, c
        (call,) = c["message"]["tool_calls"]
        assert call["function"] == {"name": "now", "arguments": "{}"}
    today = {"type": "function", "function": {"name": "today"}}
    c = chat(client, tools=[now, today], tool_choice="required", temperature=0, max_tokens=300)["choices"][0]
    assert c["finish_reason"] == "tool_calls" and 1 <= len(c["message"]["tool_calls"]) <= 2, c


def test_required_calls_are_bounded_in_number() -> None:
    _, mixed = tool_calls_for([msgspec.convert(t, ChatTool) for t in TOOLS], "required", None, None)
    assert mixed is not None and mixed["maxItems"] == MAX_TOOL_CALLS
    _, one = tool_calls_for([msgspec.convert(t, ChatTool) for t in TOOLS], "required", False, None)
    assert one is not None and one["maxItems"] == 1


def test_a_required_turn_cut_by_length_keeps_its_complete_calls() -> None:
    text = '[{"name": "ping", "parameters": {"b": true}}, {"name": "get_weather", "parameters": {"n'
    cut = RequestOutput("r", [1], [], [], text, True, "length")
    msg, finish = ToolCalls("required").message(cut, text)
    assert finish == "length" and msg["content"] is None
    (call,) = msg["tool_calls"]  # the cut call is dropped
    assert call["function"] == {"name": "ping", "arguments": '{"b": true}'}


def test_a_streamed_named_call_arrives_as_argument_deltas(client: httpx.Client) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    body = {"messages": MESSAGES, "max_tokens": 60, "seed": 1, "tools": TOOLS, "tool_choice": choice}
    whole = chat(client, **{k: v for k, v in body.items() if k != "messages"})
    r = client.post("/v1/chat/completions", json={**body, "stream": True})
    events = data_events(r.content)
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]][1:]  # after the role chunk
    calls = [d["tool_calls"][0] for d in deltas if d.get("tool_calls")]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert all("name" not in c["function"] and "id" not in c for c in calls[1:])
    assert len([c for c in calls if c["function"]["arguments"]]) > 3  # token by token, not at once
    args = "".join(c["function"]["arguments"] for c in calls)
    assert args == whole["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_choice_auto_and_none_are_accepted_with_the_hermes_parser(client: httpx.Client) -> None:
    for choice in ("auto", "none"):
        body = chat(client, tools=TOOLS, tool_choice=choice, max_tokens=4)
        assert body["choices"][0]["finish_reason"] == "length"
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "tool_choice": "auto"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"  # no tools
    bad = {"type": "function", "function": {"name": "nope"}}
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS, "tool_choice": bad})
    assert r.status_code == 400 and "nope" in r.json()["error"]["message"]


def _out(text: str, finished: bool, index: int = 0) -> RequestOutput:
    return RequestOutput("r", [1], [], [], text, finished, "stop" if finished else None, index=index)


def test_the_hermes_parser_reads_calls_and_keeps_text_as_content() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"n": 3}}\n</tool_call>'
    assert parse_hermes(text) == ("Let me check.", [("get_weather", '{"n": 3}')])
    assert parse_hermes("no calls here") == ("no calls here", [])
    assert parse_hermes("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    auto = ToolCalls("auto")
    msg, finish = auto.message(_out(text, True), text)
    assert finish == "tool_calls" and msg["content"] == "Let me check."
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"n": 3}'}


def test_hermes_streaming_holds_back_a_tag_and_sends_each_call_whole() -> None:
    auto = ToolCalls("auto")
    full = 'Hi <tool_call>{"name": "ping", "arguments": {"b": true}}</tool_call>'
    pieces = ["Hi <tool", full[: full.index("{")] + '{"name": "pi', full]
    deltas = [auto.delta(_out(p, p == full), "")[0] for p in pieces]
    assert deltas[0] == {"content": "Hi "}  # "<tool" may begin a call: held back
    assert deltas[1] == {}
    (call,) = deltas[2]["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "ping", "arguments": '{"b": true}'}
    assert auto.delta(_out(full, True), "")[1] == "tool_calls"
    plain = ToolCalls("auto")
    assert plain.delta(_out("a <", True, index=1), "")[0] == {"content": "a <"}  # flushed at the end
