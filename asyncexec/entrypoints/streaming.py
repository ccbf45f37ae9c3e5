"""Server-Sent Event chunks, the outputs of every choice, and client-disconnect handling.

A client that leaves aborts its request: `race_disconnect` cancels the wait for the engine, and
`SSEResponse` listens for `http.disconnect` beside the stream and closes the engine's generator, whose
`finally` aborts the request and frees its blocks.

A draining server that runs out of time sets its `abort` event: `race_disconnect` then raises
`HTTPError(503)`, and `SSEResponse` stops its stream between two chunks and ends it properly, with an
error event and `data: [DONE]`, instead of leaving the client a cut chunked transfer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from asyncexec.entrypoints.choices import ChoiceFormat, usage_body
from asyncexec.entrypoints.protocol import HTTPError, error_body
from asyncexec.errors import AsyncExecError
from asyncexec.outputs import RequestOutput

__all__ = ["ABORTED", "SSEResponse", "final_outputs", "prepend", "race_disconnect", "sse_chunks"]

_T = TypeVar("_T")
_encode = msgspec.json.Encoder().encode
_DONE = b"data: [DONE]\n\n"
ABORTED = "the request was aborted: the server is shutting down and its --shutdown-timeout passed"
_ABORTED_TAIL = b"data: " + _encode(error_body(503, ABORTED, "service_unavailable")) + b"\n\n" + _DONE


async def prepend(
    first: RequestOutput, rest: AsyncIterator[RequestOutput]
) -> AsyncGenerator[RequestOutput, None]:
    """`first`, then the rest of its request's outputs (the engine's stream ends after the last)."""
    yield first
    async for out in rest:
        yield out


async def final_outputs(first: RequestOutput, rest: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    """Each choice's final output, by index, `first` being the request's output already received."""
    last: dict[int, RequestOutput] = {}
    async for out in prepend(first, rest):
        last[out.index] = out
    return [last[i] for i in sorted(last)]


async def sse_chunks(
    outputs: AsyncIterator[RequestOutput],
    head: dict[str, Any],
    fmt: ChoiceFormat,
    n: int,
    include_usage: bool,
    continuous_usage: bool,
) -> AsyncGenerator[bytes, None]:
    """`data: {chunk}` events in OpenAI's format, one choice each (its `index`), an optional usage
    chunk, then `data: [DONE]`. With `continuous_usage`, every chunk carries its choice's usage so far."""
    sent: dict[int, int] = {}  # characters of each choice's text already sent
    counts: dict[int, int] = {}  # tokens of each choice so far
    prompt_tokens = 0
    prefix = b"data: " + _encode(head)[:-1] + b',"choices":['  # the head is encoded once per request
    if fmt.chat:  # the role comes first, once per choice, as OpenAI streams it
        for i in range(n):
            first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
            yield prefix + _encode(dict(first, finish_reason=None)) + b"]}\n\n"
    try:
        async for out in outputs:
            i, text = out.index, out.text or ""
            c = fmt.choice(out, text[sent.get(i, 0) :], out.new_token_ids, stream=True, first=i not in sent)
            sent[i], counts[i], prompt_tokens = len(text), len(out.token_ids), len(out.prompt_token_ids)
            tail = b"]}\n\n"
            if continuous_usage:
                tail = b'],"usage":' + _encode(usage_body(prompt_tokens, counts[i])) + b"}\n\n"
            yield prefix + _encode(c) + tail
    except AsyncExecError as e:  # the headers are gone: the error travels as an event
        yield (
            b"data: "
            + _encode(error_body(503, f"the engine cannot serve: {e}", "service_unavailable"))
            + b"\n\n"
        )
    if include_usage and counts:
        usage = usage_body(prompt_tokens, sum(counts.values()))
        yield b"data: " + _encode(dict(head, choices=[], usage=usage)) + b"\n\n"
    yield _DONE


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def race_disconnect(
    request: Request, aw: Awaitable[_T], abort: asyncio.Event | None = None
) -> _T | None:
    """`await aw`, unless the client disconnects first (then `aw` is cancelled and None returned), or
    `abort` is set first (then `aw` is cancelled and `HTTPError(503)` raised)."""
    task: asyncio.Future[_T] = asyncio.ensure_future(aw)
    watches: list[asyncio.Future[Any]] = [asyncio.ensure_future(_disconnected(request.receive))]
    if abort is not None:
        watches.append(asyncio.ensure_future(abort.wait()))
    try:
        await asyncio.wait([task, *watches], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in watches:
            w.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if not task.cancelled():
        return task.result()
    if abort is not None and abort.is_set():
        raise HTTPError(503, ABORTED, "service_unavailable")
    return None


class SSEResponse(StreamingResponse):
    """A `text/event-stream` response that closes `generator` (aborting its request) however it ends.

    When `abort` is set first, the stream stops between two chunks, `on_abort` is called, and the
    response ends with an error event and `data: [DONE]`.
    """

    def __init__(
        self,
        chunks: AsyncGenerator[bytes, None],
        generator: AsyncGenerator[Any, None],
        abort: asyncio.Event | None = None,
        on_abort: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._chunks, self._generator = chunks, generator
        self._abort, self._on_abort = abort, on_abort

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sent = {"started": False, "ended": False}

        async def tracked(message: Message) -> None:
            await send(message)
            sent["started"] = True
            sent["ended"] = message["type"] == "http.response.body" and not message.get("more_body")

        aborted = False
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    with contextlib.suppress(OSError):
                        await self.stream_response(tracked)
                    tg.cancel_scope.cancel()

                async def watch_abort(abort: asyncio.Event) -> None:
                    nonlocal aborted
                    await abort.wait()
                    aborted = True
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                if self._abort is not None:
                    tg.start_soon(watch_abort, self._abort)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
            if aborted and not sent["ended"]:
                if self._on_abort is not None:
                    self._on_abort()
                with contextlib.suppress(OSError):
                    if not sent["started"]:
                        await send(
                            {"type": "http.response.start", "status": 200, "headers": self.raw_headers}
                        )
                    await send({"type": "http.response.body", "body": _ABORTED_TAIL, "more_body": False})
        finally:
            await self._chunks.aclose()
            await self._generator.aclose()
