"""An OpenAI-compatible HTTP server over one `AsyncEngine`, on Starlette and uvicorn.

`OpenAIServing(engine, model_name).routes` are plain Starlette routes: mount them in any Starlette or
FastAPI app whose lifespan starts the engine (see `examples/embed_fastapi.py`). `build_app(config)` is
the stand-alone app whose lifespan owns the engine, behind a Host check (and CORS only when origins are
given); `run_server` serves it with uvicorn, whose SIGTERM handling drains: stop accepting, let running
requests finish up to `shutdown_timeout`, then end the rest properly (an error event and `[DONE]` for a
stream, a 503 otherwise) before uvicorn's own, later deadline would cut them. Nothing here installs a
signal handler except `run_server`, through uvicorn.

The event loop never runs long work: bodies are capped (`max_request_bytes`), and prompts are tokenized
by `prompts` (long texts in a thread, and counted in pieces first, so that a text far over `max_model_len`
is refused before it is tokenized whole), then handed to the engine as token ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from asyncexec.config import EngineConfig
from asyncexec.engine import AsyncEngine
from asyncexec.entrypoints.prompts import check_length, encode_chat, encode_text
from asyncexec.entrypoints.protocol import (
    DEFAULT_MAX_REQUEST_BYTES,
    ChatCompletionRequest,
    CompletionRequest,
    HostGuard,
    HTTPError,
    decode_body,
    error_response,
    http_error,
    json_response,
    loopback_hosts,
    read_body,
)
from asyncexec.entrypoints.streaming import (
    ABORTED,
    SSEResponse,
    chat_choice,
    completion_choice,
    last_output,
    prepend,
    race_disconnect,
    sse_chunks,
    usage_body,
)
from asyncexec.sampling_params import SamplingParams

__all__ = ["OpenAIServing", "build_app", "run_server"]

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


class OpenAIServing:
    """The OpenAI endpoints, health and metrics, over `engine` (which the app's lifespan starts)."""

    def __init__(
        self, engine: AsyncEngine, model_name: str, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.max_request_bytes = max_request_bytes
        self.draining = False  # set by the server on SIGTERM: health turns 503, new work is refused
        self.aborting = asyncio.Event()  # set once the drain runs out of time: running requests end now
        self.routes = [
            Route("/v1/completions", self._guard(self.completions), methods=["POST"]),
            Route("/v1/chat/completions", self._guard(self.chat_completions), methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
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
        sp = req.sampling_params(req.max_tokens, req.logprobs)
        prompt = await self._tokenize(req.prompt)
        return await self._respond(request, prompt, sp, req, "cmpl", completion_choice)

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
        ids = await encode_chat(tok, messages, self.engine.model_info["max_model_len"])
        max_tokens = req.max_completion_tokens or req.max_tokens
        if max_tokens is None:
            max_tokens = max(1, self.engine.model_info["max_model_len"] - len(ids))
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        sp = req.sampling_params(max_tokens, logprobs)
        return await self._respond(request, ids, sp, req, "chatcmpl", chat_choice)

    async def models(self, request: Request) -> Response:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "asyncexec",
            "max_model_len": self.engine.model_info.get("max_model_len"),
        }
        return json_response({"object": "list", "data": [card]})

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
        choice: Callable[..., dict[str, Any]],
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
        first = await self._await(request, anext(stream), rid)
        if first is None:  # the client left before the first token
            await stream.aclose()
            return Response(status_code=499)
        tok = self.engine.tokenizer
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            chunks = sse_chunks(prepend(first, stream), head, choice, tok, req.return_token_ids, usage)
            return SSEResponse(chunks, stream, self.aborting, lambda: _log_aborted(rid))
        last = await self._await(request, last_output(first, stream), rid)
        if last is None:
            await stream.aclose()
            return Response(status_code=499)
        body = dict(
            head,
            choices=[
                choice(last, last.text or "", last.token_ids, tok, req.return_token_ids, last.finish_reason)
            ],
        )
        body["usage"] = usage_body(last)
        return json_response(body)


def _log_aborted(rid: str) -> None:
    logger.warning("aborted %s: %s", rid, ABORTED)


def build_app(
    config: EngineConfig,
    served_model_name: str | None = None,
    *,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    allowed_hosts: Sequence[str] | None = None,
    allowed_origins: Sequence[str] = (),
) -> Starlette:
    """A stand-alone app: its lifespan starts the engine and shuts it down (aborting what is left).

    Requests whose Host is not in `allowed_hosts` (default: the loopback names; `*` allows any) get
    421; CORS headers are answered only for `allowed_origins` (default: none).
    """
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    engine = AsyncEngine(config)
    serving = OpenAIServing(engine, served_model_name or _default_name(config), max_request_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with engine:
            logger.info("engine ready: %d KV blocks, model %r", engine.num_blocks, serving.model_name)
            yield
            serving.draining = True

    hosts = list(allowed_hosts) if allowed_hosts is not None else loopback_hosts()
    middleware = [Middleware(HostGuard, allowed=hosts)]
    if allowed_origins:
        middleware.append(
            Middleware(
                CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"], allow_headers=["*"]
            )
        )
    app = Starlette(routes=serving.routes, middleware=middleware, lifespan=lifespan)
    app.state.serving = serving
    return app


def _default_name(config: EngineConfig) -> str:
    assert config.model is not None
    return config.model  # vLLM's default: the --model argument as given


def run_server(
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    shutdown_timeout: int = 30,
    log_level: str = "info",
    *,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    allowed_hosts: Sequence[str] | None = None,
    allowed_origins: Sequence[str] = (),
) -> None:
    """Serve until SIGINT or SIGTERM, then drain for at most `shutdown_timeout` seconds.

    `allowed_hosts` defaults to the loopback names and `host` itself (see `build_app`).
    """
    from asyncexec.entrypoints.draining import serve_draining

    hosts = list(allowed_hosts) if allowed_hosts is not None else loopback_hosts(host)
    if allowed_hosts is None and host in ("0.0.0.0", "::", ""):
        logger.warning("bound to %s, but only Host %s is answered: see --allowed-hosts", host, hosts)
    app = build_app(
        config,
        served_model_name,
        max_request_bytes=max_request_bytes,
        allowed_hosts=hosts,
        allowed_origins=allowed_origins,
    )
    serve_draining(app, app.state.serving, host, port, log_level, shutdown_timeout)
