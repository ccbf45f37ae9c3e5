"""`PendingCalls`: the calls an executor sent to every rank and awaits, each completed when its last rank
answers. A call fails early on a rank's error in a start-up call (its peers would wait in the process
group's rendezvous), on its timeout (naming the ranks that did not answer), or on a failure of the
executor (every pending call at once)."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any

from asyncexec.errors import ExecutorTimeoutError, WorkerFailedError
from asyncexec.executor.abstract import FAIL_FAST_METHODS
from asyncexec.messages import RemoteError

__all__ = ["PendingCalls", "Reply", "fail_future", "resolve_future"]

Reply = tuple[Any, RemoteError | None]  # a rank's result, or its error


@dataclass
class _Call:
    method: str
    result_type: Any
    future: asyncio.Future[list[Reply]]
    replies: list[Reply | None]
    remaining: set[int] = field(default_factory=set)


class PendingCalls:
    def __init__(self, loop: asyncio.AbstractEventLoop, world_size: int) -> None:
        self._loop = loop
        self._world_size = world_size
        self._ids = itertools.count()
        self._calls: dict[int, _Call] = {}

    def open(self, method: str, result_type: Any) -> tuple[int, asyncio.Future[list[Reply]]]:
        """A new call's id and the future of its replies, one per rank in rank order."""
        call_id = next(self._ids)
        call = _Call(method, result_type, self._loop.create_future(), [None] * self._world_size)
        call.remaining.update(range(self._world_size))
        self._calls[call_id] = call
        return call_id, call.future

    def close(self, call_id: int) -> None:
        """Forget a call that returned, failed or was cancelled: a late reply to it is dropped."""
        self._calls.pop(call_id, None)

    def result_type(self, call_id: int) -> Any:
        """The type to decode a successful reply to `call_id` as (Any for an unknown call)."""
        call = self._calls.get(call_id)
        return call.result_type if call is not None else Any

    def reply(self, call_id: int, rank: int, reply: Reply) -> None:
        """Rank `rank`'s decoded reply to `call_id`."""
        call = self._calls.get(call_id)
        if call is None or rank not in call.remaining:
            return  # a late reply to a call that timed out or was cancelled
        call.replies[rank] = reply
        call.remaining.discard(rank)
        err = reply[1]
        if err is not None and call.method in FAIL_FAST_METHODS and call.remaining:
            del self._calls[call_id]
            failed = WorkerFailedError(rank, call.method, err.type, err.message, err.traceback)
            fail_future(call.future, failed)
        elif not call.remaining:
            del self._calls[call_id]
            resolve_future(call.future, call.replies)

    def expire(self, call_id: int, timeout: float) -> None:
        """`call_id` ran out of time: it fails naming the ranks that did not answer."""
        call = self._calls.pop(call_id, None)
        if call is not None:
            fail_future(call.future, ExecutorTimeoutError(call.method, timeout, sorted(call.remaining)))

    def fail_all(self, exc: BaseException) -> None:
        """Every pending call fails with `exc` (a worker died, or the executor shut down)."""
        for call in self._calls.values():
            fail_future(call.future, exc)
        self._calls.clear()


def resolve_future(fut: asyncio.Future[Any], value: Any) -> None:
    """`fut`'s result, unless it already has one (or an error)."""
    if not fut.done():
        fut.set_result(value)


def fail_future(fut: asyncio.Future[Any], exc: BaseException) -> None:
    """`fut`'s error, unless it already has a result (or one)."""
    if not fut.done():
        fut.set_exception(exc)
