"""OpenAI request bodies as msgspec Structs, and the error body every failure answers with.

Bodies are decoded straight into typed Structs: a wrong type names its field (`at $.max_tokens`), and
unknown fields are ignored as OpenAI clients send many. Values are checked again by `SamplingParams`.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from asyncexec.sampling_params import SamplingParams

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "HTTPError",
    "decode_body",
    "error_body",
]


class HTTPError(Exception):
    """An error answered as `{"error": {...}}` with its HTTP status."""

    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def error_body(status: int, message: str, type_: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _Sampling(msgspec.Struct, kw_only=True):
    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False  # an extension: each choice also carries its `token_ids`

    def check(self) -> None:
        if self.n != 1:
            raise HTTPError(400, f"n must be 1, got {self.n}", param="n")
        if self.stop:
            raise HTTPError(400, "stop strings are not supported; use stop_token_ids", param="stop")

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            seed=self.seed,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
        )


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[int]
    max_tokens: int = 16
    logprobs: int | None = None
    echo: bool = False

    def check(self) -> None:
        super().check()
        if self.echo:
            raise HTTPError(400, "echo is not supported", param="echo")


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str = ""


class ChatMessage(msgspec.Struct, kw_only=True):
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

    def check(self) -> None:
        super().check()
        if not self.messages:
            raise HTTPError(400, "messages must not be empty", param="messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise HTTPError(400, "top_logprobs needs logprobs: true", param="top_logprobs")


_AT = re.compile(r"at `\$\.?([^`]*)`|missing required field `([^`]*)`")


def decode_body(body: bytes, kind: type[Any]) -> Any:
    """`body` as a `kind` Struct, or `HTTPError(400)` naming the offending field."""
    try:
        req = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        m = _AT.search(str(e))
        param = (m.group(1) or m.group(2)) if m else None
        raise HTTPError(400, f"invalid request body: {e}", param=param or None) from None
    except msgspec.DecodeError as e:
        raise HTTPError(400, f"the body is not valid JSON: {e}") from None
    req.check()
    return req
