"""OpenAI request bodies as msgspec Structs, and the error body every failure answers with.

Bodies are decoded straight into typed Structs: a wrong type names its field (`at $.max_tokens`), and
unknown fields are ignored as OpenAI clients send many. Values are checked again by `SamplingParams`.

The HTTP-level guards live here too: `read_body` caps a body's size (by its Content-Length up front, and
by counting what arrives for chunked bodies), and `HostGuard` refuses a Host header the server does not
answer to, so that a web page that rebinds its own DNS name to 127.0.0.1 cannot drive a local server.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Literal

import msgspec
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from asyncexec.errors import AsyncExecError, EngineOverloadedError, InvalidRequestError
from asyncexec.sampling_params import SamplingParams

__all__ = [
    "DEFAULT_MAX_REQUEST_BYTES",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "HTTPError",
    "HostGuard",
    "decode_body",
    "error_body",
    "error_response",
    "http_error",
    "json_response",
    "loopback_hosts",
    "parse_allowed_hosts",
    "parse_allowed_origins",
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


class _Sampling(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A field this server does not implement is refused with a 400 naming it, never ignored
    (`forbid_unknown_fields`); `user` is accepted, as it only labels the caller."""

    model: str | None = None
    user: str | None = None
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

    def check(self) -> None:
        super().check()
        if not self.messages:
            raise HTTPError(400, "messages must not be empty", param="messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise HTTPError(400, "top_logprobs needs logprobs: true", param="top_logprobs")


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


# ----- the Host header ----------------------------------------------------------------------------------


def _host_name(host: str) -> str:
    """`host` without its port, lower-cased, IPv6 in brackets: `[::1]:8000` -> `[::1]`, `A.b.` -> `a.b`."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    elif ":" in host:  # a bare IPv6 address, as given to --host or --allowed-hosts
        host = f"[{host}]"
    return host.rstrip(".")


def loopback_hosts(bound: str | None = None) -> list[str]:
    """The default `allowed_hosts`: the loopback names, and the address the server binds."""
    names = ["localhost", "127.0.0.1", "[::1]"]
    if bound and _host_name(bound) not in names:
        names.append(_host_name(bound))
    return names


def parse_allowed_hosts(value: str) -> list[str]:
    """`--allowed-hosts`: comma-separated host names or addresses (a port is ignored), or `*`."""
    hosts = [h.strip() for h in value.split(",") if h.strip()]
    if not hosts:
        raise ValueError("--allowed-hosts needs at least one host name, or *")
    for h in hosts:
        if "/" in h or " " in h:
            raise ValueError(f"--allowed-hosts takes host names such as example.com, not {h!r}")
    return hosts


def parse_allowed_origins(value: str) -> list[str]:
    """`--allowed-origins`: comma-separated origins such as `https://app.example.com:8443`, or `*`."""
    origins = [o.strip().rstrip("/") for o in value.split(",") if o.strip()]
    if not origins:
        raise ValueError("--allowed-origins needs at least one origin, or *")
    for o in origins:
        if o != "*" and not re.fullmatch(r"https?://[^/\s]+", o):
            raise ValueError(f"--allowed-origins takes origins such as https://example.com, not {o!r}")
    return origins


class HostGuard:
    """ASGI middleware answering 421 to a request whose Host names none of `allowed` (`*` allows all)."""

    def __init__(self, app: ASGIApp, allowed: list[str]) -> None:
        self.app = app
        self.allowed = frozenset(_host_name(h) for h in allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and "*" not in self.allowed:
            host = _host_name(Headers(scope=scope).get("host", ""))
            if host not in self.allowed:
                message = f"this server does not answer to the Host {host!r} (see --allowed-hosts)"
                body = msgspec.json.encode(error_body(421, message, "invalid_request_error"))
                await Response(body, 421, media_type="application/json")(scope, receive, send)
                return
        await self.app(scope, receive, send)
