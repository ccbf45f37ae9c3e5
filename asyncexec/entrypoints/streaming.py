"""OpenAI response pieces: choices with logprobs, Server-Sent Event chunks, and client-disconnect handling.

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

from asyncexec.entrypoints.protocol import HTTPError, error_body
from asyncexec.errors import AsyncExecError
from asyncexec.outputs import RequestOutput

__all__ = [
    "ABORTED",
    "SSEResponse",
    "chat_choice",
    "completion_choice",
    "last_output",
    "prepend",
    "race_disconnect",
    "sse_chunks",
    "usage_body",
]

_T = TypeVar("_T")
_encode = msgspec.json.Encoder().encode
_DONE = b"data: [DONE]\n\n"
ABORTED = "the request was aborted: the server is shutting down and its --shutdown-timeout passed"
_ABORTED_TAIL = b"data: " + _encode(error_body(503, ABORTED, "service_unavailable")) + b"\n\n" + _DONE


def usage_body(out: RequestOutput) -> dict[str, int]:
    p, c = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


async def prepend(
    first: RequestOutput, rest: AsyncIterator[RequestOutput]
) -> AsyncGenerator[RequestOutput, None]:
    """`first`, then the rest of its request's outputs (none when `first` is the last)."""
    yield first
    if not first.finished:
        async for out in rest:
            yield out


async def last_output(first: RequestOutput, rest: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The request's final output, `first` being the one already received."""
    last = first
    if not first.finished:
        async for out in rest:
            last = out
    return last


def _token_text(tok: Any, token_id: int) -> str:
    return str(tok.decode([token_id])) if tok is not None else str(token_id)


def _tail(out: RequestOutput, n: int) -> list[dict[int, float]]:
    return out.logprobs[len(out.logprobs) - n :] if out.logprobs is not None and n else []


def completion_choice(
    out: RequestOutput,
    text: str,
    token_ids: list[int],
    tok: Any,
    return_ids: bool,
    finish: str | None,
    stream: bool = False,
) -> dict[str, Any]:
    """A `text_completion` choice; `token_ids`/`text` are the whole output, or a chunk's delta."""
    logprobs = None
    if out.logprobs is not None:
        strings = [_token_text(tok, t) for t in token_ids]
        offsets, at = [], len(out.text or "") - len(text)
        for s in strings:
            offsets.append(at)
            at += len(s)
        lps = _tail(out, len(token_ids))
        logprobs = {
            "tokens": strings,
            "token_logprobs": [d.get(t) for d, t in zip(lps, token_ids, strict=True)],
            "top_logprobs": [{_token_text(tok, k): v for k, v in d.items()} for d in lps],
            "text_offset": offsets,
        }
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
    if return_ids:
        choice["token_ids"] = token_ids
    return choice


def chat_choice(
    out: RequestOutput,
    text: str,
    token_ids: list[int],
    tok: Any,
    return_ids: bool,
    finish: str | None,
    stream: bool = False,
) -> dict[str, Any]:
    """A `chat.completion` choice (`message`), or a `chat.completion.chunk` one (`delta`)."""
    logprobs = None
    if out.logprobs is not None:
        content = []
        for d, t in zip(_tail(out, len(token_ids)), token_ids, strict=True):
            s = _token_text(tok, t)
            top = [
                {"token": (k_s := _token_text(tok, k)), "logprob": v, "bytes": list(k_s.encode())}
                for k, v in d.items()
            ]
            content.append({"token": s, "logprob": d.get(t), "bytes": list(s.encode()), "top_logprobs": top})
        logprobs = {"content": content}
    key, message = (
        ("delta", {"content": text}) if stream else ("message", {"role": "assistant", "content": text})
    )
    choice: dict[str, Any] = {"index": 0, key: message, "logprobs": logprobs, "finish_reason": finish}
    if return_ids:
        choice["token_ids"] = token_ids
    return choice


async def sse_chunks(
    outputs: AsyncIterator[RequestOutput],
    head: dict[str, Any],
    choice: Callable[..., dict[str, Any]],
    tok: Any,
    return_ids: bool,
    include_usage: bool,
) -> AsyncGenerator[bytes, None]:
    """`data: {chunk}` events in OpenAI's format, an optional usage chunk, then `data: [DONE]`."""
    sent = 0
    last: RequestOutput | None = None
    prefix = b"data: " + _encode(head)[:-1] + b',"choices":['  # the head is encoded once per request
    if head["object"] == "chat.completion.chunk":
        first = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        yield prefix + _encode(first) + b"]}\n\n"
    try:
        async for out in outputs:
            last = out
            text = out.text or ""
            c = choice(out, text[sent:], out.new_token_ids, tok, return_ids, out.finish_reason, stream=True)
            sent = len(text)
            yield prefix + _encode(c) + b"]}\n\n"
    except AsyncExecError as e:  # the headers are gone: the error travels as an event
        yield (
            b"data: "
            + _encode(error_body(503, f"the engine cannot serve: {e}", "service_unavailable"))
            + b"\n\n"
        )
    if include_usage and last is not None:
        p, n = len(last.prompt_token_ids), len(last.token_ids)
        usage = {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}
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
