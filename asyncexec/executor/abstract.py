"""The executor interface, identical for every backend, and the factory that picks one.

An executor owns its ranks. Every call goes to every rank and waits for every reply: one result per rank
in rank order, or the error of the lowest failing rank (`WorkerFailedError`, with all failures attached).
Lifecycle: new -> `start()` -> running -> `shutdown()` -> closed. A dead worker moves it to failed, where
every call raises `ExecutorClosedError` chained from the `WorkerDiedError` that pending calls received.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from asyncexec.config import EngineConfig
from asyncexec.errors import (
    ExecutorClosedError,
    RankDisagreementError,
    WorkerFailedError,
    WorkerStartupError,
)
from asyncexec.messages import ModelRunnerOutput, RemoteError, SchedulerOutput

__all__ = ["FAIL_FAST_METHODS", "HEALTH_CHECK_TIMEOUT_S", "START_METHODS", "Executor"]

logger = logging.getLogger(__name__)

HEALTH_CHECK_TIMEOUT_S = 10.0
# The start-up calls (`_start_model`). A rank failing one leaves its peers waiting in the process-group
# rendezvous, so an executor fails such a call on its first error rather than wait for replies that
# will not come.
START_METHODS = ("init_device", "load_model")
FAIL_FAST_METHODS = frozenset(START_METHODS)


class Executor(abc.ABC):
    """Runs calls on `config.world_size` worker ranks; an async context manager.

    `Executor.create(config)` returns one not yet started: no rank runs until `start()` (or `async with`).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._started = False
        self._closed = False
        self._failure: BaseException | None = None

    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        """The executor class for `config.executor_kind`."""
        kind = config.executor_kind
        if kind == "uni":
            from asyncexec.executor.uniproc import UniProcExecutor

            return UniProcExecutor
        if kind == "mp":
            from asyncexec.executor.multiproc import MultiProcExecutor

            return MultiProcExecutor
        from asyncexec.executor.ray_executor import RayExecutor, import_ray

        import_ray()  # a clear error naming the extra where Ray is not installed
        return RayExecutor

    @classmethod
    def create(cls, config: EngineConfig) -> Executor:
        """A new executor of the kind `config` asks for. It is not started: `await executor.start()` (or
        `async with`) starts the ranks."""
        return cls.get_class(config)(config)

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def is_failed(self) -> bool:
        return self._failure is not None

    # ----- the public API ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start every rank; raises `WorkerStartupError` (with its rank) if any fails."""
        if self._started:
            raise ExecutorClosedError("executor was already started")
        self._started = True
        try:
            if self.config.model is not None:  # a built-in name becomes its folder before any rank starts
                from asyncexec.model_registry import resolve_config

                self.config = await asyncio.to_thread(resolve_config, self.config)
            await self._start()
            if self.config.model is not None:
                await self._start_model()
        except BaseException:
            await self.shutdown()
            raise

    async def _start_model(self) -> None:
        timeout = self.config.worker_start_timeout_s
        try:
            for method in START_METHODS:
                await self.collective_rpc(method, timeout=timeout)
        except WorkerFailedError as e:
            raise WorkerStartupError(
                e.rank, f"{e.remote_type}: {e.remote_message}", e.remote_traceback
            ) from e

    async def collective_rpc(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """Call `method(*args, **kwargs)` on every rank; one result per rank, in rank order.

        `timeout` defaults to `config.rpc_timeout_s`; on expiry `ExecutorTimeoutError` names the ranks
        that did not reply and the executor stays usable.
        """
        self._check_usable()
        timeout = self.config.rpc_timeout_s if timeout is None else timeout
        return await self._collective_rpc(method, tuple(args), dict(kwargs or {}), timeout, Any)

    async def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; ranks sample identically, so rank 0's output is returned."""
        self._check_usable()
        outputs: list[ModelRunnerOutput] = await self._collective_rpc(
            "execute_model", (scheduler_output,), {}, self.config.rpc_timeout_s, ModelRunnerOutput
        )
        if self.config.check_rank_agreement:
            for rank, out in enumerate(outputs[1:], start=1):
                if out.req_ids != outputs[0].req_ids or out.sampled_token_ids != outputs[0].sampled_token_ids:
                    raise RankDisagreementError(
                        f"step {scheduler_output.step_id}: rank {rank} sampled {out.sampled_token_ids}, "
                        f"rank 0 sampled {outputs[0].sampled_token_ids}"
                    )
        return outputs[0]

    async def determine_available_memory(self) -> int:
        """Bytes for the KV cache: the minimum over ranks."""
        return min(int(m) for m in await self.collective_rpc("determine_available_memory"))

    async def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate `num_blocks` KV-cache blocks on every rank."""
        await self.collective_rpc("initialize_kv_cache", (num_blocks,))

    async def check_health(self) -> None:
        """Raises if any rank is dead, failed or unresponsive."""
        await self.collective_rpc("check_health", timeout=HEALTH_CHECK_TIMEOUT_S)

    async def shutdown(self) -> None:
        """Stop every rank and release every process, socket and segment. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._shutdown()

    async def __aenter__(self) -> Executor:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.shutdown()

    # ----- for subclasses ---------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise ExecutorClosedError(f"executor has failed: {self._failure}") from self._failure
        if self._closed:
            raise ExecutorClosedError("executor is shut down")
        if not self._started:
            raise ExecutorClosedError("executor is not started: use `async with` or `await executor.start()`")

    @staticmethod
    def _gather(method: str, replies: Sequence[tuple[Any, RemoteError | None]]) -> list[Any]:
        """Rank-ordered results, or `WorkerFailedError` for the lowest failing rank, all attached."""
        failures = [
            WorkerFailedError(rank, method, err.type, err.message, err.traceback)
            for rank, (_, err) in enumerate(replies)
            if err is not None
        ]
        if failures:
            first = failures[0]
            raise WorkerFailedError(
                first.rank, method, first.remote_type, first.remote_message, first.remote_traceback, failures
            )
        return [result for result, _ in replies]

    @abc.abstractmethod
    async def _start(self) -> None: ...

    @abc.abstractmethod
    async def _collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None,
        result_type: Any,
    ) -> list[Any]: ...

    @abc.abstractmethod
    async def _shutdown(self) -> None: ...
