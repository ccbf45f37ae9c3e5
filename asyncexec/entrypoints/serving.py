"""`OpenAIServing`: the OpenAI endpoints (completions, chat), vLLM's tokenize/detokenize/version, the
model list, health and metrics, as plain Starlette routes over one `AsyncEngine`.

A request's prompt is tokenized here (see `prompts`), its fields become `SamplingParams`, and its
outputs (one per choice `index` with `n > 1`) are written as OpenAI's JSON or SSE chunks by `choices`
and `streaming`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from asyncexec import __version__
from asyncexec.engine import AsyncEngine
from asyncexec.entrypoints.choices import ChoiceFormat, prompt_logprobs_body, usage_body
from asyncexec.entrypoints.prompts import check_length, encode_chat, encode_text
from asyncexec.entrypoints.protocol import (
    DEFAULT_MAX_REQUEST_BYTES,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    HTTPError,
    TokenizeRequest,
    decode_body,
    error_response,
    http_error,
    json_response,
    read_body,
)
from asyncexec.entrypoints.streaming import (
    ABORTED,
    SSEResponse,
    final_outputs,
    prepend,
    race_disconnect,
    sse_chunks,
)
from asyncexec.entrypoints.structured import structured_outputs_from
from asyncexec.entrypoints.tokenization import detokenize, tokenize
from asyncexec.entrypoints.tool_calls import TOOL_CALL_PARSERS, tool_calls_for
from asyncexec.errors import InvalidRequestError
from asyncexec.sampling_params import SamplingParams

__all__ = ["OpenAIServing"]

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


class OpenAIServing:
    """The OpenAI endpoints, health and metrics, over `engine` (which the app's lifespan starts)."""

    def __init__(
        self,
        engine: AsyncEngine,
        model_name: str,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        tool_call_parser: str | None = None,
    ) -> None:
        if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {tool_call_parser!r}")
        self.tool_call_parser = tool_call_parser
        self.engine = engine
        self.model_name = model_name
        self.max_request_bytes = max_request_bytes
        self.draining = False  # set by the server on SIGTERM: health turns 503, new work is refused
        self.aborting = asyncio.Event()  # set once the drain runs out of time: running requests end now
        self.routes = [
            Route("/v1/completions", self._guard(self.completions), methods=["POST"]),
            Route("/v1/chat/completions", self._guard(self.chat_completions), methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/tokenize", self._guard(self.tokenize), methods=["POST"]),
            Route("/detokenize", self._guard(self.detokenize), methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/version", self.version, methods=["GET"]),
        ]

    def _guard(
        self, handler: Callable[[Request], Awaitable[Response]]
    ) -> Callable[[Request], Awaitable[Response]]:
        async def guarded(request: Request) -> Response:
            try:
                if self.draining:
                    raise HTTPError(503, "the server is shutting down", "service_unavailable")
                return await handler(request)
            except Exception as e:  # in the error shape, a bug included: the connection stays usable
                return error_response(http_error(e))

        return guarded

    def abort_running(self) -> None:
        """End every running request now (the drain ran out of time): streams get an error event."""
        self.aborting.set()

    # ----- endpoints --------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        body = await read_body(request, self.max_request_bytes)
        req: CompletionRequest = decode_body(body, CompletionRequest)
        self._check_model(req.model)
        structured = structured_outputs_from(req)
        sp = req.to_sampling_params(structured[1] if structured else None)
        prompt = await self._tokenize(req.prompt)
        tok = self.engine.tokenizer
        echo = None
        if req.echo:
            echo = req.prompt if isinstance(req.prompt, str) else _decode(tok, req.prompt)
        fmt = ChoiceFormat(
            chat=False,
            tok=tok,
            return_ids=req.return_token_ids,
            echo_text=echo,
            echo_logprobs=req.echo and req.logprobs is not None,
            prompt_logprobs=req.prompt_logprobs is not None,
        )
        return await self._respond(request, prompt, sp, req, "cmpl", fmt, structured and structured[0])

    async def chat_completions(self, request: Request) -> Response:
        body = await read_body(request, self.max_request_bytes)
        req: ChatCompletionRequest = decode_body(body, ChatCompletionRequest)
        self._check_model(req.model)
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise HTTPError(
                400, "this model's tokenizer has no chat template; use /v1/completions", param="messages"
            )
        messages = [m.as_dict() for m in req.messages]
        tools, schema = tool_calls_for(
            req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_call_parser
        )
        structured = structured_outputs_from(req, schema)
        tool_defs = [msgspec.to_builtins(t) for t in req.tools] if req.tools else None
        ids = await encode_chat(tok, messages, self.engine.model_info["max_model_len"], tool_defs)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:
            max_tokens = max(1, self.engine.max_seq_len - len(ids))  # what the KV cache holds, too
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        sp = req.sampling_params(
            max_tokens, logprobs, req.prompt_logprobs, structured=structured[1] if structured else None
        )
        fmt = ChoiceFormat(
            chat=True,
            tok=tok,
            return_ids=req.return_token_ids,
            prompt_logprobs=req.prompt_logprobs is not None,
            tools=tools,
        )
        return await self._respond(request, ids, sp, req, "chatcmpl", fmt, structured and structured[0])

    async def models(self, request: Request) -> Response:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "asyncexec",
            "max_model_len": self.engine.model_info.get("max_model_len"),
        }
        return json_response({"object": "list", "data": [card]})

    async def tokenize(self, request: Request) -> Response:
        req: TokenizeRequest = decode_body(await read_body(request, self.max_request_bytes), TokenizeRequest)
        self._check_model(req.model)
        info = self.engine.model_info
        return json_response(await tokenize(self.engine.tokenizer, req, info["max_model_len"]))

    async def detokenize(self, request: Request) -> Response:
        body = await read_body(request, self.max_request_bytes)
        req: DetokenizeRequest = decode_body(body, DetokenizeRequest)
        self._check_model(req.model)
        return json_response(
            await detokenize(self.engine.tokenizer, req, self.engine.model_info["vocab_size"])
        )

    async def version(self, request: Request) -> Response:
        return json_response({"version": __version__})

    async def health(self, request: Request) -> Response:
        if self.engine.is_healthy and not self.draining:
            return json_response({"status": "ok"})
        why = "shutting down" if self.draining or self.engine.is_closed else "the engine cannot serve"
        return error_response(HTTPError(503, why, "service_unavailable"))

    async def metrics(self, request: Request) -> Response:
        return Response(self.engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # ----- the shared path --------------------------------------------------------------------------

    async def _tokenize(self, prompt: str | list[int]) -> str | list[int]:
        """Text as token ids, exactly as the engine tokenizes it (see `prompts`); ids are length-checked."""
        tok, max_len = self.engine.tokenizer, self.engine.model_info["max_model_len"]
        if isinstance(prompt, str) and tok is not None:
            return await encode_text(tok, prompt, max_len)
        if isinstance(prompt, list):
            check_length(prompt, max_len)
        return prompt

    async def _await(self, request: Request, aw: Awaitable[_T], rid: str) -> _T | None:
        """`aw`, or None when the client left; `HTTPError(503)` when the drain ran out of time."""
        try:
            return await race_disconnect(request, aw, self.aborting)
        except HTTPError:
            _log_aborted(rid)
            raise

    def _check_model(self, model: str | None) -> None:
        """`model` may be the served name, the model folder as configured, or that folder's name."""
        path = self.engine.config.model or ""
        if model is not None and model not in (self.model_name, path, path.rstrip("/").rsplit("/", 1)[-1]):
            raise HTTPError(
                404,
                f"model {model!r} does not exist; this server serves {self.model_name!r}",
                "model_not_found",
                "model",
            )

    async def _respond(
        self,
        request: Request,
        prompt: str | list[int],
        sp: SamplingParams,
        req: CompletionRequest | ChatCompletionRequest,
        prefix: str,
        fmt: ChoiceFormat,
        structured_field: str | None = None,
    ) -> Response:
        rid = f"{prefix}-{uuid.uuid4().hex}"
        obj = (
            "text_completion"
            if prefix == "cmpl"
            else "chat.completion.chunk"
            if req.stream
            else "chat.completion"
        )
        head = {"id": rid, "object": obj, "created": int(time.time()), "model": self.model_name}
        stream = self.engine.generate(prompt, sp, rid)
        try:
            first = await self._await(request, anext(stream), rid)
        except InvalidRequestError as e:  # its grammar did not compile: name the field the request used
            if structured_field is None:
                raise
            raise HTTPError(400, f"{structured_field}: {e}", param=structured_field) from None
        if first is None:  # the client left before the first token
            await stream.aclose()
            return Response(status_code=499)
        if req.stream:
            chunks = sse_chunks(
                prepend(first, stream), head, fmt, sp.n, req.include_usage, req.continuous_usage
            )
            return SSEResponse(chunks, stream, self.aborting, lambda: _log_aborted(rid))
        finals = await self._await(request, final_outputs(first, stream), rid)
        if finals is None:
            await stream.aclose()
            return Response(status_code=499)
        body = dict(
            head, choices=[fmt.choice(o, o.text or "", o.token_ids, stream=False, first=True) for o in finals]
        )
        if fmt.chat and fmt.prompt_logprobs:
            body["prompt_logprobs"] = prompt_logprobs_body(fmt.tok, finals[0])
        body["usage"] = usage_body(len(first.prompt_token_ids), sum(len(o.token_ids) for o in finals))
        return json_response(body)


def _decode(tok: Any, ids: list[int]) -> str:
    return str(tok.decode(ids)) if tok is not None else ""


def _log_aborted(rid: str) -> None:
    logger.warning("aborted %s: %s", rid, ABORTED)
