"""An OpenAI-compatible HTTP server over one `AsyncEngine`, on Starlette and uvicorn.

`OpenAIServing(engine, model_name).routes` are plain Starlette routes: mount them in any Starlette or
FastAPI app whose lifespan starts the engine (see `examples/embed_fastapi.py`). `build_app(config)` is
the stand-alone app whose lifespan owns the engine; `run_server` serves it with uvicorn, whose SIGTERM
handling drains: stop accepting, let running requests finish up to `shutdown_timeout`, abort the rest.
Nothing here installs a signal handler except `run_server`, through uvicorn.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from asyncexec.config import EngineConfig
from asyncexec.engine import AsyncEngine
from asyncexec.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    HTTPError,
    decode_body,
    error_body,
)
from asyncexec.entrypoints.streaming import (
    SSEResponse,
    chat_choice,
    completion_choice,
    race_disconnect,
    sse_chunks,
)
from asyncexec.errors import AsyncExecError, EngineOverloadedError, InvalidRequestError
from asyncexec.outputs import RequestOutput
from asyncexec.sampling_params import SamplingParams

__all__ = ["OpenAIServing", "build_app", "run_server"]

logger = logging.getLogger(__name__)
_encode = msgspec.json.Encoder().encode


def json_response(body: Any, status: int = 200) -> Response:
    return Response(_encode(body), status, media_type="application/json")


def _error(e: HTTPError) -> Response:
    return json_response(error_body(e.status, e.message, e.type, e.param), e.status)


class OpenAIServing:
    """The OpenAI endpoints, health and metrics, over `engine` (which the app's lifespan starts)."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.draining = False  # set by the server on SIGTERM: health turns 503, new work is refused
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
            except HTTPError as e:
                return _error(e)
            except InvalidRequestError as e:
                return _error(HTTPError(400, str(e), param=e.param))
            except EngineOverloadedError as e:
                return _error(HTTPError(429, str(e), "rate_limit_exceeded"))
            except AsyncExecError as e:
                logger.error("request failed: %s", e)
                return _error(HTTPError(503, f"the engine cannot serve: {e}", "service_unavailable"))

        return guarded

    # ----- endpoints --------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        req: CompletionRequest = decode_body(await request.body(), CompletionRequest)
        self._check_model(req.model)
        sp = req.sampling_params(req.max_tokens, req.logprobs)
        return await self._respond(request, req.prompt, sp, req, "cmpl", completion_choice)

    async def chat_completions(self, request: Request) -> Response:
        req: ChatCompletionRequest = decode_body(await request.body(), ChatCompletionRequest)
        self._check_model(req.model)
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise HTTPError(
                400, "this model's tokenizer has no chat template; use /v1/completions", param="messages"
            )
        messages = [m.as_dict() for m in req.messages]
        try:
            ids = list(
                tok.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
        except Exception as e:  # a template that rejects these messages
            raise HTTPError(400, f"the chat template rejected the messages: {e}", param="messages") from None
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
        return _error(HTTPError(503, why, "service_unavailable"))

    async def metrics(self, request: Request) -> Response:
        return Response(self.engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # ----- the shared path --------------------------------------------------------------------------

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
        first = await race_disconnect(request, anext(stream))
        if first is None:  # the client left before the first token
            await stream.aclose()
            return Response(status_code=499)
        tok = self.engine.tokenizer
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            chunks = sse_chunks(_prepend(first, stream), head, choice, tok, req.return_token_ids, usage)
            return SSEResponse(chunks, stream)
        last = await race_disconnect(request, _last(first, stream))
        if last is None:
            await stream.aclose()
            return Response(status_code=499)
        body = dict(
            head,
            choices=[
                choice(last, last.text or "", last.token_ids, tok, req.return_token_ids, last.finish_reason)
            ],
        )
        body["usage"] = _usage(last)
        return json_response(body)


def _usage(out: RequestOutput) -> dict[str, int]:
    p, c = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


async def _prepend(
    first: RequestOutput, rest: AsyncIterator[RequestOutput]
) -> AsyncGenerator[RequestOutput, None]:
    yield first
    if not first.finished:
        async for out in rest:
            yield out


async def _last(first: RequestOutput, rest: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = first
    if not first.finished:
        async for out in rest:
            last = out
    return last


def build_app(config: EngineConfig, served_model_name: str | None = None) -> Starlette:
    """A stand-alone app: its lifespan starts the engine and shuts it down (aborting what is left)."""
    engine = AsyncEngine(config)
    serving = OpenAIServing(engine, served_model_name or _default_name(config))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with engine:
            logger.info("engine ready: %d KV blocks, model %r", engine.num_blocks, serving.model_name)
            yield
            serving.draining = True

    app = Starlette(routes=serving.routes, lifespan=lifespan)
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
) -> None:
    """Serve until SIGINT or SIGTERM, then drain for at most `shutdown_timeout` seconds."""
    import uvicorn

    app = build_app(config, served_model_name)
    serving: OpenAIServing = app.state.serving

    class _DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if not serving.draining:
                logger.info("draining: finishing running requests for up to %d s", shutdown_timeout)
            serving.draining = True
            super().handle_exit(sig, frame)

    cfg = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        log_level=log_level,
        timeout_graceful_shutdown=shutdown_timeout,
        access_log=False,
    )
    _DrainingServer(cfg).run()
