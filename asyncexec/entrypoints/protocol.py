"""OpenAI request bodies as msgspec Structs, and the error body every failure answers with.

Bodies are decoded straight into typed Structs: a wrong type names its field (`at $.max_tokens`), and a
field this server does not implement is refused with a 400 naming it (`forbid_unknown_fields`), never
ignored. Field names are OpenAI's, and vLLM's for its extensions (`top_k`, `min_p`, `repetition_penalty`,
`min_tokens`, `bad_words`, `stop_token_ids`, `include_stop_str_in_output`, `ignore_eos`,
`prompt_logprobs`, `stream_options.continuous_usage_stats`, structured outputs: see `structured`), and
chat's `tools`, `tool_choice` and `parallel_tool_calls` (see `tool_calls`); `return_token_ids` is this
server's own.
Values are checked again by `SamplingParams`. `read_body` caps a body's size (by its Content-Length up
front, and by counting what arrives for chunked bodies).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Literal

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from asyncexec.entrypoints.structured import StructuredFields
from asyncexec.entrypoints.tool_calls import ChatTool, ToolChoice
from asyncexec.errors import AsyncExecError, EngineOverloadedError, InvalidRequestError
from asyncexec.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "DEFAULT_MAX_REQUEST_BYTES",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "DetokenizeRequest",
    "HTTPError",
    "TokenizeRequest",
    "decode_body",
    "error_body",
    "error_response",
    "http_error",
    "json_response",
    "read_body",
]
logger = logging.getLogger(__name__)
_encode = msgspec.json.Encoder().encode
DEFAULT_MAX_REQUEST_BYTES = 4 << 20


class HTTPError(Exception):
    """An error answered as `{"error": {...}}` with its HTTP status."""

    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def error_body(status: int, message: str, type_: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def json_response(body: Any, status: int = 200) -> Response:
    return Response(_encode(body), status, media_type="application/json")


def error_response(e: HTTPError) -> Response:
    return json_response(error_body(e.status, e.message, e.type, e.param), e.status)


def http_error(e: Exception) -> HTTPError:
    """The answer to a request that raised `e`: 400 for a bad request, 429 when the engine's queue is
    full, 503 when the engine cannot serve, 500 (logged with its traceback) for a bug."""
    if isinstance(e, HTTPError):
        return e
    if isinstance(e, InvalidRequestError):
        return HTTPError(400, str(e), param=e.param)
    if isinstance(e, EngineOverloadedError):
        return HTTPError(429, str(e), "rate_limit_exceeded")
    if isinstance(e, AsyncExecError):
        logger.error("request failed: %s", e)
        return HTTPError(503, f"the engine cannot serve: {e}", "service_unavailable")
    logger.error("request failed unexpectedly", exc_info=e)
    return HTTPError(500, "internal server error", "internal_server_error")


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far (with include_usage)


class _Sampling(StructuredFields, kw_only=True, forbid_unknown_fields=True):
    """The fields both endpoints share; `user` is accepted, as it only labels the caller."""

    model: str | None = None
    user: str | None = None
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    bad_words: list[str] = msgspec.field(default_factory=list)
    prompt_logprobs: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False  # an extension: each choice also carries its `token_ids`

    def check(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise HTTPError(400, "stream_options needs stream: true", param="stream_options")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return (
            self.include_usage
            and self.stream_options is not None
            and self.stream_options.continuous_usage_stats
        )

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None,
        best_of: int | None = None,
        structured: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            best_of=best_of,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            bad_words=self.bad_words,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=self.logit_bias,
            structured_outputs=structured,
        )


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[int]
    max_tokens: int = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None

    def check(self) -> None:
        super().check()
        if self.max_tokens == 0 and not self.echo:
            raise HTTPError(400, "max_tokens must be >= 1 (0 only with echo: true)", param="max_tokens")
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise HTTPError(400, "best_of > n cannot stream: the best are known at the end", param="best_of")

    def to_sampling_params(self, structured: StructuredOutputsParams | None = None) -> SamplingParams:
        """vLLM's mapping: with `echo`, `logprobs` also asks for the prompt's (unless `prompt_logprobs`
        is given); `max_tokens: 0` with `echo` scores the prompt without generating."""
        plp = self.prompt_logprobs
        if plp is None and self.echo and (self.logprobs is not None or self.max_tokens == 0):
            plp = self.logprobs or 0
        return self.sampling_params(self.max_tokens, self.logprobs, plp, self.best_of, structured)


class ContentPart(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    text: str = ""


class ChatMessage(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None

    def as_dict(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            if any(p.type != "text" for p in content):
                raise HTTPError(400, "only text content parts are supported", param="messages")
            content = "".join(p.text for p in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def check(self) -> None:
        super().check()
        if not self.messages:
            raise HTTPError(400, "messages must not be empty", param="messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise HTTPError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        for name in ("max_completion_tokens", "max_tokens"):  # a chat always generates (no echo to score)
            value = getattr(self, name)
            if value is not None and value < 1:
                raise HTTPError(400, f"{name} must be >= 1, got {value}", param=name)


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `/tokenize`: a `prompt`, or chat `messages` rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (vLLM's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise HTTPError(400, "give exactly one of prompt and messages", param="prompt")
        if self.add_generation_prompt and self.continue_final_message and self.messages is not None:
            raise HTTPError(
                400, "continue_final_message and add_generation_prompt exclude each other", param="messages"
            )


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[int]

    def check(self) -> None:
        pass


_AT = re.compile(r"at `\$\.?([^`]*)`|missing required field `([^`]*)`")
_UNKNOWN = re.compile(r"unknown field `([^`]*)`(?: - at `\$\.?([^`]*)`)?")


def decode_body(body: bytes, kind: type[Any]) -> Any:
    """`body` as a `kind` Struct, or `HTTPError(400)` naming the offending field."""
    try:
        req = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        u = _UNKNOWN.search(str(e))
        if u is not None:
            name = f"{u.group(2)}.{u.group(1)}" if u.group(2) else u.group(1)
            raise HTTPError(400, f"{name} is not supported by this server", param=name) from None
        m = _AT.search(str(e))
        param = (m.group(1) or m.group(2)) if m else None
        raise HTTPError(400, f"invalid request body: {e}", param=param or None) from None
    except msgspec.DecodeError as e:
        raise HTTPError(400, f"the body is not valid JSON: {e}") from None
    except RecursionError:  # msgspec recurses into nested arrays/objects, unknown fields included
        raise HTTPError(400, "the body is not valid here: JSON nested too deeply") from None
    req.check()
    return req


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, or `HTTPError(413)` once it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:  # a chunked body, or one longer than it declared
            raise _too_large(limit)
        parts.append(chunk)
    return b"".join(parts)


def _too_large(limit: int) -> HTTPError:
    return HTTPError(413, f"the request body is larger than {limit} bytes (--max-request-bytes)")
