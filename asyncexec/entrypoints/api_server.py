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

import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

from asyncexec.config import EngineConfig
from asyncexec.engine import AsyncEngine
from asyncexec.entrypoints.guards import APIKeyGuard, HostGuard, loopback_hosts
from asyncexec.entrypoints.protocol import DEFAULT_MAX_REQUEST_BYTES
from asyncexec.entrypoints.serving import OpenAIServing
from asyncexec.gguf.file import is_gguf

__all__ = ["OpenAIServing", "build_app", "run_server"]

logger = logging.getLogger(__name__)


def build_app(
    config: EngineConfig,
    served_model_name: str | None = None,
    *,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    allowed_hosts: Sequence[str] | None = None,
    allowed_origins: Sequence[str] = (),
    api_key: str | None = None,
    tool_call_parser: str | None = None,
) -> Starlette:
    """A stand-alone app: its lifespan starts the engine and shuts it down (aborting what is left).

    Requests whose Host is not in `allowed_hosts` (default: the loopback names; `*` allows any) get
    421; CORS headers are answered only for `allowed_origins` (default: none). With `api_key`, the API
    routes need `Authorization: Bearer <api_key>` (see `guards.APIKeyGuard`). `tool_call_parser`
    ("hermes") enables `tool_choice` "auto" and "none" (see `tool_calls`).
    """
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    engine = AsyncEngine(config)
    name = served_model_name or _default_name(config)
    serving = OpenAIServing(engine, name, max_request_bytes, tool_call_parser)

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
    if api_key is not None:  # inside CORS, so that a browser's preflight is answered without the key
        middleware.append(Middleware(APIKeyGuard, api_key=api_key))
    app = Starlette(routes=serving.routes, middleware=middleware, lifespan=lifespan)
    app.state.serving = serving
    return app


def _default_name(config: EngineConfig) -> str:
    assert config.model is not None
    if is_gguf(config.model):
        return Path(config.model).stem  # a GGUF file: its name without the folder and suffix
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
    api_key: str | None = None,
    tool_call_parser: str | None = None,
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
        api_key=api_key,
        tool_call_parser=tool_call_parser,
    )
    serve_draining(app, app.state.serving, host, port, log_level, shutdown_timeout)
