"""`AsyncEngine`: continuous batching over the paged KV cache, for asyncio programs.

`step()` is the whole data path, in two halves: `EngineCore.schedule_and_run()` (`Scheduler.schedule()`
-> `await executor.execute_model(so)`), then `_process_outputs()` (`Scheduler.update_from_output()`, the
detokenizer and stop strings of `OutputProcessor`) -> one `RequestOutput` per request that progressed,
handed to its stream (`OutputStreams`). Steps are serialized by a lock, so a direct `step()` caller and
the background loop never interleave; the loop runs only while `generate()` callers wait. `n > 1` fans
a request out to copies (`parallel_sampling`) that share its prompt.

Self-healing (`restart_on_worker_failure`): when a worker dies, the step that saw it has the
`ExecutorSupervisor` replace the executor, and re-queues every running request as preempted with the
tokens it has, so recompute continues it; streams see a gap, not an error. Past `max_worker_restarts`,
`WorkerDiedError` reaches every caller.

Nothing bound to an event loop exists before `start()`, so an engine may be created anywhere and
several engines can share a process and a loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from types import TracebackType
from typing import Any

from asyncexec.config import EngineConfig
from asyncexec.core.scheduler import Request, Scheduler
from asyncexec.engine.core import EngineCore, ScheduledStep
from asyncexec.engine.metrics import EngineMetrics
from asyncexec.engine.parallel_sampling import make_requests
from asyncexec.engine.processor import InputProcessor, OutputProcessor, load_tokenizer
from asyncexec.engine.streams import OutputStreams
from asyncexec.engine.supervisor import ExecutorSupervisor, worker_death
from asyncexec.errors import (
    AsyncExecError,
    ConfigError,
    EngineOverloadedError,
    EngineStepError,
    ExecutorClosedError,
    InvalidRequestError,
)
from asyncexec.executor import Executor
from asyncexec.outputs import RequestOutput
from asyncexec.sampling_params import SamplingParams
from asyncexec.structured_output import StructuredOutputManager

__all__ = ["AsyncEngine"]

logger = logging.getLogger(__name__)


class AsyncEngine:
    """An LLM engine: `async with AsyncEngine(config) as engine: async for out in engine.generate(...)`."""

    def __init__(self, config: EngineConfig) -> None:
        if config.model is None:
            raise ConfigError("AsyncEngine needs config.model (a local model folder or a built-in name)")
        self.config = config
        self.scheduler: Scheduler | None = None
        self.tokenizer: Any = None
        self.model_info: dict[str, Any] = {}
        self.num_blocks = 0
        self.metrics = EngineMetrics(self.stats)
        self._supervisor = ExecutorSupervisor(config, self.metrics)
        self._inputs: InputProcessor | None = None
        self._structured: StructuredOutputManager | None = None
        self._core: EngineCore | None = None
        self._outputs = OutputProcessor(None)
        self._streams = OutputStreams()
        self._lock: asyncio.Lock | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._dead: BaseException | None = None
        self._closed = False
        self._ids = itertools.count()

    # ----- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the executor, size and initialize the KV cache on every rank, load the tokenizer."""
        if self.executor is not None:
            raise ExecutorClosedError("engine was already started")
        self._lock = asyncio.Lock()
        try:
            self.model_info, self.num_blocks = await self._supervisor.start()
            self.scheduler = Scheduler(
                self.config,
                self.num_blocks,
                self.model_info["max_model_len"],
                self.model_info["eos_token_ids"],
                self.model_info.get("attention_crossover"),
            )
            # after the workers: with the uni executor they import transformers in this process, and
            # transformers' lazy module is not safe to import from two threads at once
            self.tokenizer = await asyncio.to_thread(load_tokenizer, self._supervisor.config.model)
            self._inputs = InputProcessor(self.config, self.tokenizer, self.model_info, self.num_blocks)
            self._outputs = OutputProcessor(self.tokenizer, self.scheduler.finish)
            self._structured = StructuredOutputManager(self.tokenizer, self.model_info["vocab_size"])
            self._core = EngineCore(self.scheduler, self._structured)
        except BaseException:
            await self._supervisor.shutdown()
            raise
        self._supervisor.fill_spares()

    async def shutdown(self) -> None:
        """Abort what is in flight, stop the background loop and the executor. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        self._streams.fail_all(ExecutorClosedError("engine shut down while the request was running"))
        await self._supervisor.shutdown()
        if self._structured is not None:
            self._structured.shutdown()

    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.shutdown()

    @property
    def executor(self) -> Executor | None:
        """The executor running the workers now (a restart replaces it)."""
        return self._supervisor.executor

    @property
    def num_restarts(self) -> int:
        """Executor restarts so far, failed attempts included."""
        return self._supervisor.num_restarts

    @property
    def restart_seconds(self) -> list[float]:
        """How long each successful restart took: from the death being seen to the new executor ready."""
        return list(self._supervisor.restart_seconds)

    @property
    def max_seq_len(self) -> int:
        """The most tokens (prompt and output) one request can reach: `max_model_len`, or fewer where the
        KV cache holds fewer. A request whose prompt and `max_tokens` need more is refused."""
        if self._inputs is None:
            raise ExecutorClosedError("engine is not started: use `async with` or `await engine.start()`")
        return self._inputs.max_seq_len

    @property
    def is_closed(self) -> bool:
        """True once `shutdown()` has begun."""
        return self._closed

    @property
    def is_healthy(self) -> bool:
        """True while the engine can serve: started, not shut down, and no failure it cannot heal."""
        if self.scheduler is None or self._closed or self._dead is not None:
            return False
        return self._supervisor.is_serving  # a restart in progress or still allowed counts as serving

    # ----- requests ---------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; validates synchronously and returns its id. With `n > 1` (or `best_of`) its
        copies are queued too, as one parent whose outputs carry each copy's `index`."""
        sched = self._live_scheduler()
        assert self._inputs is not None
        sp = self._inputs.sampling_params(sampling_params)
        ids = self._inputs.tokenize(prompt)
        self._inputs.check_fits(len(ids), sp)
        rid = f"req-{next(self._ids)}" if request_id is None else request_id
        if not isinstance(rid, str) or not rid:
            raise InvalidRequestError(f"request_id must be a non-empty string, got {rid!r}")
        reqs, parent = make_requests(rid, ids, sp)
        for r in {rid, *(r.request_id for r in reqs)}:
            if r in sched.requests or r in self._streams:
                raise InvalidRequestError(f"request_id {r!r} is already in use")
        if len(sched.waiting) >= self.config.max_waiting_requests:
            limit = self.config.max_waiting_requests
            raise EngineOverloadedError(
                f"{len(sched.waiting)} requests are waiting (max_waiting_requests={limit})"
            )
        assert self._structured is not None
        for copy in reqs:  # each copy has its own matcher; they share the compiled grammar
            self._structured.grammar_init(copy)
        sched.add_request(reqs[0], reqs[1:])
        if parent is not None:
            self._streams.add_parent(parent)
        self.metrics.prompt_tokens.inc(len(ids))
        return rid

    def abort(self, request_id: str) -> None:
        """Stop a request (every copy of it) and free its blocks; its stream, if any, ends with
        finish_reason "abort"."""
        if self.scheduler is None:
            return
        for rid in self._streams.request_ids(request_id):
            req = self.scheduler.finish(rid, "abort")
            if req is not None:
                self.metrics.on_finished("abort")
                self._streams.deliver(self._outputs.make_output(req, []))
            self._outputs.forget(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_unfinished_requests()

    def stats(self) -> dict[str, float]:
        """Scheduler and KV-cache counters: queue sizes, block usage, prefix-cache hits, preemptions."""
        sched = self._live_scheduler() if self.scheduler is None else self.scheduler
        return {**sched.stats(), "num_restarts": self.num_restarts}

    async def collective_rpc(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        self._live_scheduler()
        assert self.executor is not None
        return await self.executor.collective_rpc(method, args, kwargs, timeout)

    # ----- stepping ---------------------------------------------------------------------------------

    async def step(self) -> list[RequestOutput]:
        """One scheduling step: an output for every request that progressed or finished in it. An error a
        rank raised running the step (`WorkerFailedError`) finishes the step's requests with "error" and
        the engine serves on; any other failure of the step fails the engine and reaches every caller
        (unless a restart heals a worker death); one of a request's own processing (stop check,
        detokenization) finishes it alone with "error"."""
        sched = self._live_scheduler()
        assert self._lock is not None
        async with self._lock:
            if self._dead is not None:
                raise ExecutorClosedError(f"engine has failed: {self._dead}") from self._dead
            if not sched.has_work():
                return []
            assert self._core is not None and self._structured is not None
            executor = self._supervisor.executor
            assert executor is not None
            t0 = time.perf_counter()
            outputs = [self._fail_request(sched, r, e) for r, e in self._structured.take_failed()]
            try:
                step = await self._core.schedule_and_run(executor)
            except asyncio.CancelledError:
                raise
            except BaseException as e:
                await self._heal_or_die(e, sched)
                return []
            if step.error is not None and executor.is_failed:  # the rank died with the call
                await self._heal_or_die(step.error, sched)
                return []
            if step.error is not None:  # a rank raised in the step (a kernel's error) and serves on
                outputs += [self._fail_request(sched, req, step.error) for req in self._core.fail_step(step)]
            elif step.output is not None:
                outputs += self._process_outputs(sched, step, t0)
        return [routed for o in outputs for routed in self._streams.deliver(o)]

    def _process_outputs(self, sched: Scheduler, step: ScheduledStep, t0: float) -> list[RequestOutput]:
        """The step's second half: the scheduler and grammars updated, then detokenization and stop
        strings (which finish their requests here); a failure here fails the engine."""
        assert self._core is not None
        try:
            progressed, failed = self._core.update(step)
            outputs, bad = self._outputs.make_outputs(progressed)
            outputs += [self._fail_request(sched, req, exc) for req, exc in [*failed, *bad]]
            done = [p for p in progressed if p[0].finish_reason != "error"]
            self.metrics.on_step(time.perf_counter() - t0, done)
        except Exception as e:
            raise self._die(e)  # noqa: B904 (EngineStepError chains e; an asyncexec error is e)
        return outputs

    async def _heal_or_die(self, exc: BaseException, sched: Scheduler) -> None:
        """Replace the executor if a worker died and the budget allows, else fail the engine and raise."""
        death = worker_death(exc)
        if death is not None and self._supervisor.can_restart:
            try:
                await self._supervisor.restart(death, self.num_blocks, sched.reset_for_new_workers)
                return
            except BaseException as failed:
                exc, death = failed, worker_death(failed)
        raise self._die(death or exc)  # the death behind a closed executor; a non-asyncexec error wrapped

    def _fail_request(self, sched: Scheduler, req: Request, exc: Exception) -> RequestOutput:
        """Finish one request with "error" (its blocks freed); its stream gets the error, not an output."""
        logger.error("request %s failed: %r", req.request_id, exc)
        sched.finish(req.request_id, "error")  # a no-op where the scheduler already did
        self.metrics.on_finished("error")
        self._streams.fail(req.request_id, exc)
        return self._outputs.error_output(req)

    async def generate(
        self,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream a request's outputs (with `n > 1`, every copy's, each with its `index`, until all have
        finished). Leaving early, `aclose()` or cancellation aborts it."""
        rid = self.add_request(prompt, sampling_params, request_id)
        left = sampling_params.n if sampling_params is not None else 1  # outputs with `finished` to come
        q = self._streams.open(rid)
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(
                self._run(), name="asyncexec-engine-loop"
            )
        finished = False
        try:
            while not finished:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                left -= item.finished
                finished = left == 0
                yield item
        finally:
            if not finished:
                self.abort(rid)
            self._streams.close(rid)

    async def _run(self) -> None:
        """The background loop: step while anyone is waiting on `generate`."""
        while self._streams and self._dead is None and not self._closed:
            try:
                await self.step()
            except Exception as e:
                if self._dead is None and not self._closed:
                    self._die(e)  # not one stream may be left waiting
                return  # _die handed the error to every stream
            await asyncio.sleep(0)

    def _die(self, exc: BaseException) -> BaseException:
        """Fail the engine: every request and stream gets `exc` (an `Exception` not of asyncexec wrapped
        in `EngineStepError`), which is returned."""
        foreign = isinstance(exc, Exception) and not isinstance(exc, AsyncExecError)
        err = EngineStepError(exc) if foreign else exc
        self._dead = err
        logger.error("engine failed: %s", err)
        if self.scheduler is not None:
            self.metrics.on_finished("error", len(self.scheduler.finish_all("error")))
        self._streams.fail_all(err)
        self._supervisor.release_soon()  # nothing will use the workers or the spares again
        return err

    def _live_scheduler(self) -> Scheduler:
        if self._dead is not None:
            raise ExecutorClosedError(f"engine has failed: {self._dead}") from self._dead
        if self._closed:
            raise ExecutorClosedError("engine is shut down")
        if self.scheduler is None:
            raise ExecutorClosedError("engine is not started: use `async with` or `await engine.start()`")
        return self.scheduler
