"""`OutputStreams`: where a step's outputs go. One queue per `generate()` caller, keyed by the id it
asked with; a copy's output (`n > 1`) goes to its parent's stream, merged by `ParentRequests`."""

from __future__ import annotations

import asyncio

from asyncexec.engine.parallel_sampling import ParentRequest, ParentRequests
from asyncexec.errors import InvalidRequestError, RequestFailedError
from asyncexec.outputs import RequestOutput

__all__ = ["OutputStreams", "StreamItem"]

StreamItem = RequestOutput | BaseException


class OutputStreams:
    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[StreamItem]] = {}
        self._parents = ParentRequests()

    def __bool__(self) -> bool:
        """Whether any `generate()` caller waits."""
        return bool(self._queues)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._queues or request_id in self._parents

    def add_parent(self, parent: ParentRequest) -> None:
        self._parents.add(parent)

    def request_ids(self, request_id: str) -> list[str]:
        """The scheduled requests behind `request_id`: its copies, or itself."""
        parent = self._parents.parents.get(request_id)
        return list(parent.child_ids) if parent is not None else [request_id]

    def open(self, request_id: str) -> asyncio.Queue[StreamItem]:
        q: asyncio.Queue[StreamItem] = asyncio.Queue()
        self._queues[request_id] = q
        return q

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._parents.forget(request_id)

    def deliver(self, out: RequestOutput) -> list[RequestOutput]:
        """Hand `out` (as its parent's, for a copy) to its stream, if one waits; returns what was sent."""
        routed = self._parents.route(out)
        for o in routed:
            q = self._queues.get(o.request_id)
            if q is not None:
                q.put_nowait(o)
        return routed

    def fail(self, request_id: str, exc: Exception) -> None:
        """End the stream of `request_id` (or of its parent) with `exc`: a request refused for its own
        input (its grammar) gets that error, a 400; any other failure as `RequestFailedError`."""
        q = self._queues.pop(self._parents.stream_id(request_id), None)
        if q is not None:
            q.put_nowait(exc if isinstance(exc, InvalidRequestError) else RequestFailedError(request_id, exc))

    def fail_all(self, exc: BaseException) -> None:
        """Every waiting stream gets `exc` (the engine failed or shut down)."""
        for q in self._queues.values():
            q.put_nowait(exc)
