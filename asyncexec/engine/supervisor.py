"""`ExecutorSupervisor`: the one owner of an engine's executor, which it starts, sizes the KV cache of,
and replaces after a worker death.

With `restart_on_worker_failure`, `restart()` shuts the failed executor down, lets the engine reset what
the old workers held (`on_replaced`), and starts a fresh executor with a KV cache of the same size. Every
attempt, including one whose new workers die while starting, counts against `max_worker_restarts`, so it
never loops. With the mp executor it keeps one spare worker process per rank, its torch and model code
already imported, so a restart skips most of a process's start-up (~1 s instead of ~9 s on 2 cores;
each spare costs a few hundred MB), as long as a restart is left.

Once no restart is left, a worker death releases everything at once (the executor is shut down: the dead
worker's segment, the survivors, our arena; the spares are closed), not when the engine shuts down; so
does a failure of the engine itself (`release_soon`). A restart in progress counts as serving
(`is_serving`), even the last allowed one, whose attempt is already counted in `num_restarts`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from asyncexec.config import EngineConfig
from asyncexec.core.kv_cache import tokens_held
from asyncexec.engine.metrics import EngineMetrics
from asyncexec.errors import ConfigError, ExecutorClosedError, WorkerDiedError, WorkerStartupError
from asyncexec.executor import Executor, MultiProcExecutor
from asyncexec.executor.spares import SpareWorkers
from asyncexec.model_registry import resolve_config

__all__ = ["ExecutorSupervisor", "worker_death"]

logger = logging.getLogger(__name__)


class ExecutorSupervisor:
    def __init__(self, config: EngineConfig, metrics: EngineMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.executor: Executor | None = None
        self.num_restarts = 0
        self.restart_seconds: list[float] = []  # each successful replacement, death seen to ready
        self._spares: SpareWorkers | None = None
        self._restarting = False  # a restart is in progress: it may still succeed
        self._releasing: asyncio.Task[None] | None = None
        self._closed = False

    async def start(self) -> tuple[dict[str, Any], int]:
        """Start the first executor and size its KV cache; returns the model's info and the block count."""
        self.config = await asyncio.to_thread(resolve_config, self.config)  # a built-in name -> its folder
        self.executor = Executor.create(self.config)
        await self.executor.start()
        info: dict[str, Any] = (await self.executor.collective_rpc("get_model_info"))[0]
        num_blocks = await self._initialize_kv_cache(self.executor, info["max_model_len"])
        self._watch(self.executor)
        return info, num_blocks

    async def _initialize_kv_cache(self, executor: Executor, max_model_len: int) -> int:
        block_bytes = max(await executor.collective_rpc("get_kv_cache_block_bytes"))
        available = await executor.determine_available_memory()
        bs = self.config.block_size
        per_seq = -(-max_model_len // bs)
        # More than twice what max_num_seqs full-length sequences hold only feeds the prefix cache.
        num_blocks = min(available // block_bytes, 2 * self.config.max_num_seqs * per_seq + 1)
        if num_blocks < 2:
            raise ConfigError(
                f"{available} bytes hold no KV block of {block_bytes} bytes; raise the KV cache memory"
            )
        await executor.initialize_kv_cache(num_blocks)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB per rank)",
            num_blocks,
            bs,
            num_blocks * block_bytes / 2**20,
        )
        holds = tokens_held(num_blocks, bs)
        if holds + 1 < max_model_len:  # vLLM refuses to start; the requests that fit are still served
            logger.warning(
                "the KV cache holds %d tokens (%d blocks of %d), fewer than one sequence of "
                "max_model_len=%d: requests whose prompt and max_tokens need more are refused; raise "
                "kv_cache_memory_bytes "
                "(%d bytes hold a whole sequence) or lower max_model_len",
                holds,
                num_blocks - 1,
                bs,
                max_model_len,
                (per_seq + 1) * block_bytes,
            )
        return int(num_blocks)

    @property
    def can_restart(self) -> bool:
        """Whether a worker death now would be healed: restarts are on and the budget is not spent."""
        return self.config.restart_on_worker_failure and self.num_restarts < self.config.max_worker_restarts

    @property
    def is_serving(self) -> bool:
        """Whether the executor serves or will again: not failed, being replaced, or replaceable. A
        restart in progress counts, even the last allowed one (its attempt is already counted)."""
        ex = self.executor
        return ex is not None and (not ex.is_failed or self._restarting or self.can_restart)

    def fill_spares(self) -> None:
        """With restarts on (mp) and not spent, keep one spare process per rank waiting; else close them."""
        wanted = self._restarting or self.can_restart
        if not wanted or self.config.executor_kind != "mp" or self._closed:
            self._close_spares()
            return
        if self._spares is None:
            self._spares = SpareWorkers(self.config.model)
        self._spares.fill(self.config.world_size)

    def _close_spares(self) -> None:
        if self._spares is not None:
            self._spares.close()

    def _watch(self, executor: Executor) -> None:
        """Once `executor` serves: have it report a worker death to us at once (mp, Ray)."""
        if isinstance(executor, MultiProcExecutor):
            executor.on_failure = self._on_executor_failed

    def _on_executor_failed(self, exc: BaseException) -> None:
        # Past the budget nothing will use the failed executor or the spares again: release the dead
        # worker's segment, the survivors and the idle spares now, not when the engine shuts down.
        if not (self._restarting or self.can_restart):
            self.release_soon()

    def release_soon(self) -> None:
        """Shut the executor down and close the spares in the background (the engine has failed, or will
        when it next steps); `shutdown()` waits for it."""
        if self._releasing is None and not self._closed:
            self._releasing = asyncio.get_running_loop().create_task(
                self._release(), name="asyncexec-release-executor"
            )

    async def _release(self) -> None:
        self._close_spares()
        if self.executor is not None:
            await self.executor.shutdown()

    async def restart(self, cause: WorkerDiedError, num_blocks: int, on_replaced: Callable[[], int]) -> None:
        """Replace the executor after `cause`. `on_replaced()` resets the engine's view of the workers and
        returns how many requests will be recomputed. Raises the last failure once the budget is spent,
        with the executor shut down and the spares closed (the engine fails with it)."""
        self._restarting = True
        try:
            await self._replace(cause, num_blocks, on_replaced)
        except BaseException:
            self._close_spares()
            raise
        finally:
            self._restarting = False
        self.fill_spares()  # for the next restart, or none where the budget is spent

    async def _replace(self, cause: WorkerDiedError, num_blocks: int, on_replaced: Callable[[], int]) -> None:
        assert self.executor is not None
        t0 = time.monotonic()
        while True:
            self.num_restarts += 1
            self.metrics.worker_restarts.inc()
            await self.executor.shutdown()
            pending = on_replaced()
            logger.warning(
                "%s; restarting the executor (restart %d of %d), %d requests to recompute",
                cause,
                self.num_restarts,
                self.config.max_worker_restarts,
                pending,
            )
            self.fill_spares()
            self.executor = Executor.create(self.config)
            if isinstance(self.executor, MultiProcExecutor):
                self.executor.spares = self._spares
            try:
                await self.executor.start()
                await self.executor.initialize_kv_cache(num_blocks)
                self.restart_seconds.append(time.monotonic() - t0)
                self.metrics.restart_time.observe(self.restart_seconds[-1])
                logger.info("executor restarted in %.2f s", self.restart_seconds[-1])
                self._watch(self.executor)
                return
            except (WorkerDiedError, WorkerStartupError, ExecutorClosedError) as e:
                logger.error("executor restart %d failed: %s", self.num_restarts, e)
                if not self.can_restart:
                    await self.executor.shutdown()
                    raise
                cause = worker_death(e) or cause

    async def shutdown(self) -> None:
        self._closed = True
        if self._releasing is not None:
            await asyncio.gather(self._releasing, return_exceptions=True)
        if self.executor is not None:
            await self.executor.shutdown()
        self._close_spares()


def worker_death(exc: BaseException | None) -> WorkerDiedError | None:
    """The `WorkerDiedError` behind `exc` (a pending call's, or the one that closed the executor)."""
    while exc is not None:
        if isinstance(exc, WorkerDiedError):
            return exc
        exc = exc.__cause__
    return None
