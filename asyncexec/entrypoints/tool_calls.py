"""Chat tool calling: `tools` with `tool_choice`, answered in OpenAI's `tool_calls` shape.

- A named `tool_choice` (`{"type": "function", "function": {"name": ...}}`) constrains the output to
  that function's `parameters` schema; the output is the call's `arguments`.
- `"required"` constrains the output to a JSON array of `{"name", "parameters"}` objects, each one of
  the tools (vLLM's schema), of at most `MAX_TOOL_CALLS` items: one with `parallel_tool_calls: false`,
  and one per tool where no tool takes parameters (calling such a function twice in a turn only repeats
  it; a model would otherwise go on repeating `{"name": "now", "parameters": {}}` to `max_tokens`).
- `"auto"` (the default with tools) and `"none"` leave the output free, so telling a call from text
  needs the model's own format: `--tool-call-parser hermes` reads `<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>` blocks (Hermes, Qwen 2.5 and others write them). Without a parser
  the server answers 400. With `"none"` nothing is parsed: the output is the message's content.
A choice that made calls ends with `finish_reason: "tool_calls"`. A length stop stays "length", as in
OpenAI; with `"required"` its message then carries the calls completed before the cut as `tool_calls`
(what a stream had already sent) and drops the cut one, or has the text as `content` if none completed.
Streamed, a named call's arguments arrive token by token; `"required"` and hermes calls arrive whole,
each in its own delta, as soon as they are complete (text before a hermes call streams as content).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from asyncexec.errors import InvalidRequestError
from asyncexec.outputs import RequestOutput

__all__ = [
    "MAX_TOOL_CALLS",
    "TOOL_CALL_PARSERS",
    "ChatTool",
    "NamedToolChoice",
    "ToolCalls",
    "parse_hermes",
    "tool_calls_for",
]

TOOL_CALL_PARSERS = ("hermes",)
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_HERMES_OPEN = "<tool_call>"
# OpenAI: a function without `parameters` takes none, so its arguments are exactly `{}`
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
# The most calls in one `"required"` turn: more than a turn plausibly needs, few enough that a model
# repeating one call stops within a few hundred tokens
MAX_TOOL_CALLS = 16


class FunctionDefinition(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function"]
    function: ToolChoiceFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def parse_hermes(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """`text`'s content before its first tool call (None if empty) and its `(name, arguments JSON)` calls;
    text with no well-formed call is all content."""
    calls = []
    for m in _HERMES.finditer(text):
        try:
            call = json.loads(m.group(1))
            calls.append((str(call["name"]), json.dumps(call.get("arguments", {}))))
        except (ValueError, KeyError, TypeError):
            return text, []
    if not calls:
        return text, []
    content = text[: text.find(_HERMES_OPEN)].strip()
    return content or None, calls


@dataclass
class ToolCalls:
    """How one chat request's choices become tool calls: `mode` "named", "required" or "auto"."""

    mode: Literal["named", "required", "auto"]
    name: str | None = None
    parallel: bool = True
    _streams: dict[int, _StreamState] = field(default_factory=dict)

    def calls(self, text: str) -> tuple[str | None, list[tuple[str, str]]]:
        """The content and the `(name, arguments)` calls of a whole output."""
        if self.mode == "named":
            return None, [(self.name or "", text)]
        if self.mode == "auto":
            content, calls = parse_hermes(text)
            return content, calls if self.parallel else calls[:1]
        calls = _required_calls(text)
        if not calls or not text.rstrip().endswith("]"):
            return text, []
        return None, calls

    def message(self, out: RequestOutput, text: str) -> tuple[dict[str, Any], str | None]:
        """The non-streamed `message` and `finish_reason` of a choice."""
        if out.finish_reason != "length" or self.mode == "auto":
            content, calls = self.calls(text)
        elif self.mode == "required" and (done := _required_calls(text)):
            content, calls = None, done
        else:
            content, calls = text, []
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = [_call(name, args) for name, args in calls]
        return msg, _finish(out, bool(calls))

    def delta(self, out: RequestOutput, text: str) -> tuple[dict[str, Any], str | None]:
        """A streamed chunk's `delta` (from this choice's whole text so far) and its `finish_reason`."""
        st = self._streams.setdefault(out.index, _StreamState())
        full = out.text or ""
        delta: dict[str, Any] = {}
        if self.mode == "named":
            piece = full[st.sent :]
            st.sent = len(full)
            head = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function"} if not st.calls else {}
            fn = {"name": self.name, "arguments": piece} if not st.calls else {"arguments": piece}
            st.calls = st.calls or 1
            delta["tool_calls"] = [{"index": 0, **head, "function": fn}]
            return delta, _finish(out, True)
        if self.mode == "required":
            calls = _required_calls(full)
        else:
            content_end = full.find(_HERMES_OPEN)
            if content_end < 0:  # hold back what may start a tool call
                content_end = len(full) - _open_prefix(full) if not out.finished else len(full)
            if content_end > st.sent:
                delta["content"] = full[st.sent : content_end]
                st.sent = content_end
            calls = parse_hermes(full)[1] if content_end < len(full) else []
            calls = calls if self.parallel else calls[:1]
        new = [dict(_call(n, a), index=st.calls + k) for k, (n, a) in enumerate(calls[st.calls :])]
        if new:
            delta["tool_calls"] = new
            st.calls = len(calls)
        return delta, _finish(out, st.calls > 0)


@dataclass
class _StreamState:
    sent: int = 0  # characters of the text already sent (as content or named arguments)
    calls: int = 0  # tool calls already sent


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _finish(out: RequestOutput, called: bool) -> str | None:
    if out.finish_reason == "stop" and called:
        return "tool_calls"
    return out.finish_reason


def _open_prefix(text: str) -> int:
    """How many characters at the end of `text` begin `<tool_call>`."""
    for k in range(min(len(_HERMES_OPEN) - 1, len(text)), 0, -1):
        if _HERMES_OPEN.startswith(text[-k:]):
            return k
    return 0


def _required_calls(text: str) -> list[tuple[str, str]]:
    """The `(name, arguments)` of each complete item of a `"required"` array written so far."""
    return [(str(i["name"]), json.dumps(i["parameters"])) for i in _complete_items(text)]


def _complete_items(text: str) -> list[dict[str, Any]]:
    """The complete objects of a JSON array written so far (`[{...}, {...}, {..` gives two)."""
    dec = json.JSONDecoder()
    pos, items = text.find("[") + 1, list[dict[str, Any]]()
    if pos == 0:
        return []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            item, pos = dec.raw_decode(text, pos)
        except ValueError:
            return items
        if isinstance(item, dict) and "name" in item and "parameters" in item:
            items.append(item)


def tool_calls_for(
    tools: list[ChatTool] | None,
    choice: ToolChoice | None,
    parallel: bool | None,
    parser: str | None,
) -> tuple[ToolCalls | None, dict[str, Any] | None]:
    """The request's tool-call mode and the schema it constrains the output to (both None: no tools)."""
    if not tools:
        for name, value in (("tool_choice", choice), ("parallel_tool_calls", parallel)):
            if value is not None:
                raise InvalidRequestError(f"{name} needs tools", param=name)
        return None, None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError(f"tools: function names must be distinct, got {names}", param="tools")
    params = {t.function.name: t.function.parameters or _EMPTY_PARAMETERS for t in tools}
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in params:
            raise InvalidRequestError(
                f"tool_choice: no tool is named {choice.function.name!r} (tools: {names})",
                param="tool_choice",
            )
        return ToolCalls("named", choice.function.name), params[choice.function.name]
    if choice == "required":
        return ToolCalls("required", parallel=parallel is not False), _required_schema(params, parallel)
    if parser is None:
        field_name = "tools" if choice is None else "tool_choice"
        raise InvalidRequestError(
            f"{field_name}: tool_choice {choice or 'auto'!r} needs the server started with "
            f"--tool-call-parser (one of {', '.join(TOOL_CALL_PARSERS)}); a named tool_choice or "
            "'required' needs none",
            param=field_name,
        )
    return (ToolCalls("auto", parallel=parallel is not False) if choice != "none" else None), None


def _required_schema(params: dict[str, dict[str, Any]], parallel: bool | None) -> dict[str, Any]:
    """vLLM's schema for `"required"`: an array of calls, each `{"name": <a tool>, "parameters": ...}`,
    bounded as the module's notes say."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, schema in params.items()
    ]
    most = len(params) if all(schema == _EMPTY_PARAMETERS for schema in params.values()) else MAX_TOOL_CALLS
    if parallel is False:
        most = 1
    return {
        "type": "array",
        "minItems": 1,
        "maxItems": min(most, MAX_TOOL_CALLS),
        "items": {"anyOf": options},
    }
