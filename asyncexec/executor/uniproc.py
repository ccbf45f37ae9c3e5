"""`UniProcExecutor`: the ranks live in this process, each on its own thread, off the event loop.

Arguments and results pass by reference (no codec). Each rank has one dedicated thread, so its calls run
in order and the event loop stays responsive while a rank computes. A call that times out keeps running
on its thread; the next call to that rank waits behind it.
"""

from __future__ import annotations

import asyncio
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asyncexec.errors import ExecutorTimeoutError, WorkerStartupError
from asyncexec.executor.abstract import Executor
from asyncexec.messages import RemoteError
from asyncexec.worker.worker import MethodSpec, Worker, build_worker, lookup_method

__all__ = ["UniProcExecutor"]

_Reply = tuple[Any, RemoteError | None]


class UniProcExecutor(Executor):
    """Every rank in-process; `tensor_parallel_size` ranks, one thread each."""

    _workers: list[Worker]
    _threads: list[ThreadPoolExecutor]

    async def _start(self) -> None:
        self._threads = [
            ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"asyncexec-rank{rank}")
            for rank in range(self.world_size)
        ]
        self._specs: list[dict[str, MethodSpec]] = [{} for _ in range(self.world_size)]
        loop = asyncio.get_running_loop()
        built = await asyncio.gather(
            *(loop.run_in_executor(t, self._build, rank) for rank, t in enumerate(self._threads)),
            return_exceptions=True,
        )
        for rank, w in enumerate(built):
            if isinstance(w, BaseException):
                tb = "".join(traceback.format_exception(type(w), w, w.__traceback__))
                raise WorkerStartupError(rank, f"{type(w).__qualname__}: {w}", tb) from w
        self._workers = built  # type: ignore[assignment]

    def _build(self, rank: int) -> Worker:
        return build_worker(self.config, rank, rank, self.world_size)

    def _invoke(self, rank: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Reply:
        try:
            spec = self._specs[rank].get(method)
            if spec is None:
                spec = self._specs[rank][method] = lookup_method(self._workers[rank], method)
            return spec.fn(*args, **kwargs), None
        except Exception as e:
            return None, RemoteError(type(e).__qualname__, str(e), traceback.format_exc())

    async def _collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None,
        result_type: Any,
    ) -> list[Any]:
        loop = asyncio.get_running_loop()
        futs = [
            loop.run_in_executor(t, self._invoke, r, method, args, kwargs)
            for r, t in enumerate(self._threads)
        ]
        if len(futs) == 1 and timeout is None:
            return self._gather(method, [await futs[0]])
        _, pending = await asyncio.wait(futs, timeout=timeout)
        if pending:
            assert timeout is not None
            raise ExecutorTimeoutError(method, timeout, [r for r, f in enumerate(futs) if f in pending])
        return self._gather(method, [f.result() for f in futs])

    async def _shutdown(self) -> None:
        loop = asyncio.get_running_loop()
        workers = getattr(self, "_workers", [])
        threads = getattr(self, "_threads", [])
        await asyncio.gather(
            *(loop.run_in_executor(t, w.shutdown) for w, t in zip(workers, threads, strict=False)),
            return_exceptions=True,
        )
        for t in threads:
            t.shutdown(wait=False, cancel_futures=True)
