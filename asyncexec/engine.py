"""`AsyncEngine`: continuous batching over the paged KV cache, for asyncio programs.

`step()` is the whole data path, top to bottom: `Scheduler.schedule()` -> `await
executor.execute_model(out)` -> `Scheduler.update_from_output()` -> one `RequestOutput` per request
that progressed. Steps are serialized by a lock, so a direct `step()` caller and the background loop
never interleave. The background loop runs only while `generate()` callers are waiting.

Nothing bound to an event loop exists before `start()`, so an engine may be created anywhere and
several engines can share a process and a loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncGenerator, Sequence
from types import TracebackType
from typing import Any

from asyncexec.config import EngineConfig
from asyncexec.detokenizer import IncrementalDetokenizer
from asyncexec.errors import ConfigError, EngineOverloadedError, ExecutorClosedError, InvalidRequestError
from asyncexec.executor import Executor
from asyncexec.outputs import RequestOutput
from asyncexec.sampling_params import SamplingParams
from asyncexec.scheduler import Request, Scheduler

__all__ = ["AsyncEngine"]

logger = logging.getLogger(__name__)

_Item = RequestOutput | BaseException


class AsyncEngine:
    """An LLM engine: `async with AsyncEngine(config) as engine: async for out in engine.generate(...)`."""

    def __init__(self, config: EngineConfig) -> None:
        if config.model is None:
            raise ConfigError("AsyncEngine needs config.model (a local model folder)")
        self.config = config
        self.executor: Executor | None = None
        self.scheduler: Scheduler | None = None
        self.tokenizer: Any = None
        self.model_info: dict[str, Any] = {}
        self.num_blocks = 0
        self._streams: dict[str, asyncio.Queue[_Item]] = {}
        self._lock: asyncio.Lock | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._dead: BaseException | None = None
        self._closed = False
        self._ids = itertools.count()
        self._detok: dict[str, IncrementalDetokenizer] = {}

    # ----- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the executor, size and initialize the KV cache on every rank, load the tokenizer."""
        if self.executor is not None:
            raise ExecutorClosedError("engine was already started")
        self._lock = asyncio.Lock()
        self.executor = Executor.create(self.config)
        try:
            await self.executor.start()
            self.num_blocks = await self._initialize_kv_cache(self.executor)
            self.scheduler = Scheduler(
                self.config,
                self.num_blocks,
                self.model_info["max_model_len"],
                self.model_info["eos_token_ids"],
            )
            self.tokenizer = await asyncio.to_thread(_load_tokenizer, self.config.model)
        except BaseException:
            await self.executor.shutdown()
            raise

    async def _initialize_kv_cache(self, executor: Executor) -> int:
        self.model_info = (await executor.collective_rpc("get_model_info"))[0]
        block_bytes = max(await executor.collective_rpc("get_kv_cache_block_bytes"))
        available = await executor.determine_available_memory()
        bs = self.config.block_size
        per_seq = -(-self.model_info["max_model_len"] // bs)
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
        return int(num_blocks)

    async def shutdown(self) -> None:
        """Abort what is in flight, stop the background loop and the executor. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        for q in self._streams.values():
            q.put_nowait(ExecutorClosedError("engine shut down while the request was running"))
        if self.executor is not None:
            await self.executor.shutdown()

    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.shutdown()

    # ----- requests ---------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; validates synchronously and returns its id."""
        sched = self._live_scheduler()
        sp = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(sp, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be a SamplingParams, got {type(sp).__name__}")
        ids = self._tokenize(prompt)
        rid = f"req-{next(self._ids)}" if request_id is None else request_id
        if not isinstance(rid, str) or not rid:
            raise InvalidRequestError(f"request_id must be a non-empty string, got {rid!r}")
        if rid in sched.requests or rid in self._streams:
            raise InvalidRequestError(f"request_id {rid!r} is already in use")
        if len(sched.waiting) >= self.config.max_waiting_requests:
            limit = self.config.max_waiting_requests
            raise EngineOverloadedError(
                f"{len(sched.waiting)} requests are waiting (max_waiting_requests={limit})"
            )
        sched.add_request(Request(rid, ids, sp))
        return rid

    def _tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        max_len, vocab = self.model_info["max_model_len"], self.model_info["vocab_size"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "prompt: text needs a tokenizer in the model folder; pass token ids"
                )
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=True))
        elif isinstance(prompt, (list, tuple)):
            bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(
                    f"prompt: token ids must be integers in [0, {vocab}), got {bad[:5]}"
                )
            ids = list(prompt)
        else:
            raise InvalidRequestError(
                f"prompt must be a str or a list of token ids, got {type(prompt).__name__}"
            )
        if not ids:
            raise InvalidRequestError("prompt is empty")
        if len(ids) >= max_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens, but max_model_len={max_len} leaves no room to generate"
            )
        if -(-(len(ids) + 1) // self.config.block_size) > self.num_blocks - 1:
            raise InvalidRequestError(
                f"prompt of {len(ids)} tokens needs more KV blocks than the cache holds"
            )
        return ids

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks; its stream, if any, ends with finish_reason "abort"."""
        if self.scheduler is None:
            return
        req = self.scheduler.finish(request_id, "abort")
        q = self._streams.get(request_id)
        if req is not None and q is not None:
            q.put_nowait(self._output(req, []))
        self._detok.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_unfinished_requests()

    def stats(self) -> dict[str, float]:
        """Scheduler and KV-cache counters: queue sizes, block usage, prefix-cache hits, preemptions."""
        sched = self._live_scheduler() if self.scheduler is None else self.scheduler
        kv = sched.kv
        return {
            "num_running": len(sched.running),
            "num_waiting": len(sched.waiting),
            "num_blocks": kv.pool.num_usable,
            "num_free_blocks": kv.pool.num_free,
            "kv_cache_usage": kv.usage,
            "prefix_cache_queries": kv.stats.queries,
            "prefix_cache_hits": kv.stats.hits,
            "prefix_cache_hit_rate": kv.stats.hit_rate,
            "num_preemptions": sched.num_preemptions,
        }

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
        """One scheduling step: an output for every request that progressed or finished in it."""
        sched = self._live_scheduler()
        assert self._lock is not None and self.executor is not None
        async with self._lock:
            if self._dead is not None:
                raise ExecutorClosedError(f"engine has failed: {self._dead}") from self._dead
            if not sched.has_work():
                return []
            so = sched.schedule()
            try:
                out = await self.executor.execute_model(so)
            except BaseException as e:
                if not isinstance(e, asyncio.CancelledError):
                    self._die(e)
                raise
            outputs = [self._output(req, toks) for req, toks in sched.update_from_output(so, out)]
        for o in outputs:
            q = self._streams.get(o.request_id)
            if q is not None:
                q.put_nowait(o)
        return outputs

    async def generate(
        self,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream a request's outputs. Leaving early, `aclose()` or cancellation aborts it."""
        rid = self.add_request(prompt, sampling_params, request_id)
        q: asyncio.Queue[_Item] = asyncio.Queue()
        self._streams[rid] = q
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
                finished = item.finished
                yield item
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self.abort(rid)

    async def _run(self) -> None:
        """The background loop: step while anyone is waiting on `generate`."""
        while self._streams and self._dead is None and not self._closed:
            try:
                await self.step()
            except Exception:
                return  # _die already handed the error to every stream
            await asyncio.sleep(0)

    def _die(self, exc: BaseException) -> None:
        self._dead = exc
        logger.error("engine failed: %s", exc)
        for q in self._streams.values():
            q.put_nowait(exc)

    def _live_scheduler(self) -> Scheduler:
        if self._dead is not None:
            raise ExecutorClosedError(f"engine has failed: {self._dead}") from self._dead
        if self._closed:
            raise ExecutorClosedError("engine is shut down")
        if self.scheduler is None:
            raise ExecutorClosedError("engine is not started: use `async with` or `await engine.start()`")
        return self.scheduler

    def _output(self, req: Request, new_tokens: list[int]) -> RequestOutput:
        text = None
        if self.tokenizer is not None:
            detok = self._detok.get(req.request_id)
            if detok is None:
                detok = self._detok[req.request_id] = IncrementalDetokenizer(self.tokenizer)
            detok.update(req.output_token_ids)
            if req.finish_reason is not None:
                detok.flush(req.output_token_ids)
                del self._detok[req.request_id]
            text = detok.text
        return RequestOutput(
            req.request_id,
            req.prompt_token_ids,
            list(req.output_token_ids),
            list(new_tokens),
            text,
            req.finish_reason is not None,
            req.finish_reason,  # type: ignore[arg-type]
            list(req.logprobs) if req.sampling_params.logprobs is not None else None,
        )


def _load_tokenizer(path: str | None) -> Any:
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        logger.info("no tokenizer in %s (%s); prompts must be token ids", path, e)
        return None
