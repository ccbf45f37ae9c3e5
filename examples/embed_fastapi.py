"""Embed `AsyncEngine` in an existing FastAPI app, through the app's lifespan.

    python examples/embed_fastapi.py --model DIR [--host 127.0.0.1 --port 8000]

The app keeps its own endpoints (`POST /summarize` here calls the engine directly) and gains the
OpenAI-compatible ones (`/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`,
`/metrics`). docs/embedding.md walks through it.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from asyncexec import AsyncEngine, EngineConfig, EngineOverloadedError, InvalidRequestError, SamplingParams
from asyncexec.entrypoints.api_server import OpenAIServing


class SummarizeIn(BaseModel):
    text: str
    max_tokens: int = 32


class SummarizeOut(BaseModel):
    summary: str
    tokens: int


def create_app(model: str) -> FastAPI:
    # 1. Create the engine anywhere: nothing in it is bound to an event loop until it starts.
    engine = AsyncEngine(EngineConfig(model=model, max_waiting_requests=256))

    # 2. Start it in the app's lifespan, on the serving loop; leaving aborts what is still running.
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with engine:
            yield

    app = FastAPI(lifespan=lifespan)

    # 3. The OpenAI endpoints are plain Starlette routes over the same engine.
    app.router.routes.extend(OpenAIServing(engine, model_name="tiny").routes)

    # 4. Map the engine's errors to HTTP statuses for your own endpoints.
    @app.exception_handler(InvalidRequestError)
    async def invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return JSONResponse({"error": {"message": str(exc), "type": "invalid_request_error"}}, 400)

    @app.exception_handler(EngineOverloadedError)
    async def overloaded(request: Request, exc: EngineOverloadedError) -> JSONResponse:
        return JSONResponse({"error": {"message": str(exc), "type": "rate_limit_exceeded"}}, 429)

    # 5. Your own endpoint, calling the engine directly.
    @app.post("/summarize")
    async def summarize(body: SummarizeIn) -> SummarizeOut:
        sp = SamplingParams(max_tokens=body.max_tokens, temperature=0.0)
        last = None
        async for out in engine.generate(body.text, sp):
            last = out
        assert last is not None
        return SummarizeOut(summary=last.text or "", tokens=len(last.token_ids))

    return app


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a model folder (make one: asyncexec make-model DIR)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()
    uvicorn.run(create_app(args.model), host=args.host, port=args.port, loop="uvloop")
