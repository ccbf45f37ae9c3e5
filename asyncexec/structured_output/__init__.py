"""Structured outputs in the engine process, as vLLM V1 runs them.

A request's life with a constraint:
1. `grammar_init` (at `add_request`) submits its grammar to a thread pool, through a cache keyed by the
   constraint (`backend_guidance.cache_key`): a request with a schema already compiled gets it at once.
2. While it compiles, the request waits in the queue: the scheduler skips it (`waiting_for_grammar`),
   and a step with nothing else to run waits on the compile (`wait_for_grammars`) instead of spinning.
3. A grammar that does not compile fails that request alone (`take_failed`), with an
   `InvalidRequestError` naming the field (a 400 on the server); the engine goes on.
4. Each step, `fill_bitmask` writes one packed int32 row per constrained request that samples in the
   step into the `SchedulerOutput`; every rank masks those rows' logits before sampling.
5. After the step, `accept_tokens` advances each matcher with its sampled token and finishes the
   request with "stop" once its grammar is complete.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections import OrderedDict
from typing import Any

import torch

from asyncexec.core.request import Request, RequestStatus
from asyncexec.errors import InvalidRequestError
from asyncexec.messages import SchedulerOutput
from asyncexec.sampling_params import StructuredOutputsParams
from asyncexec.structured_output.backend_guidance import cache_key, compile_grammar, make_llg_tokenizer
from asyncexec.structured_output.request import StructuredOutputRequest

__all__ = ["StructuredOutputManager", "StructuredOutputRequest"]

GRAMMAR_CACHE_SIZE = 256
# A step with only compiling grammars waits at most this long before looking for other work again.
_WAIT_S = 0.05


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, max_workers: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        workers = max_workers or max(1, min(4, (os.cpu_count() or 2) // 2))
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._workers = workers
        self._llg_tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()
        self._cache: OrderedDict[str, concurrent.futures.Future[Any]] = OrderedDict()
        self._pending: dict[str, Request] = {}  # grammar still compiling
        self._active: dict[str, Request] = {}  # grammar ready, request not finished

    def grammar_init(self, req: Request) -> None:
        """Start compiling `req`'s grammar (a cache hit is ready at once); no-op without a constraint."""
        params = req.sampling_params.structured_outputs
        if params is None:
            return
        if self.tokenizer is None:
            raise InvalidRequestError(
                "structured_outputs: needs a tokenizer in the model folder", param="structured_outputs"
            )
        key = cache_key(params)
        fut = self._cache.get(key)
        if fut is None:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self._workers, thread_name_prefix="asyncexec-grammar"
                )
            fut = self._cache[key] = self._pool.submit(self._compile, params)
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        req.structured_output_request = StructuredOutputRequest(params, fut)
        self._pending[req.request_id] = req

    def _compile(self, params: StructuredOutputsParams) -> Any:
        with self._tokenizer_lock:
            if self._llg_tokenizer is None:
                self._llg_tokenizer = make_llg_tokenizer(self.tokenizer, self.vocab_size)
        return compile_grammar(self._llg_tokenizer, params)

    def take_failed(self) -> list[tuple[Request, Exception]]:
        """Requests whose grammar failed to compile (each to be failed alone); moves the ones whose
        grammar is ready to the active set."""
        failed: list[tuple[Request, Exception]] = []
        for rid, req in list(self._pending.items()):
            so = req.structured_output_request
            if req.status is RequestStatus.FINISHED:
                del self._pending[rid]
            elif so.poll():
                del self._pending[rid]
                if so.error is None:
                    self._active[rid] = req
                else:
                    err = so.error
                    if not isinstance(err, InvalidRequestError):
                        err = InvalidRequestError(f"{so.params.kind}: {err}", param=so.params.kind)
                    failed.append((req, err))
        return failed

    async def wait_for_grammars(self) -> None:
        """Wait until a pending grammar is compiled (at most a moment: new work may arrive meanwhile)."""
        loop = asyncio.get_running_loop()
        compiled = asyncio.Event()

        def wake(_: object) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(compiled.set)

        for req in list(self._pending.values()):
            req.structured_output_request.compiled.add_done_callback(wake)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(compiled.wait(), _WAIT_S)

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def fill_bitmask(self, so: SchedulerOutput, requests: dict[str, Request]) -> None:
        """Attach to `so` the mask rows of the constrained requests that sample in this step."""
        if not self._active:
            return
        ids: list[str] = []
        matchers: list[Any] = []
        for rid, n in so.num_scheduled_tokens.items():
            req = self._active.get(rid)
            if req is None or req.num_computed_tokens + n != req.num_tokens:
                continue  # unconstrained, or a prefill chunk that samples nothing
            sor = req.structured_output_request
            sor.sync(req.output_token_ids)
            ids.append(rid)
            matchers.append(sor.matcher)
        if ids:
            import llguidance.torch

            bitmask = torch.empty(len(ids), (self.vocab_size + 31) // 32, dtype=torch.int32)
            llguidance.torch.fill_next_token_bitmask_par(
                self._executor(), [(m, i) for i, m in enumerate(matchers)], bitmask
            )
            so.structured_output_request_ids, so.grammar_bitmask = ids, bitmask

    def _executor(self) -> Any:
        import llguidance

        if not hasattr(self, "_llg_executor"):
            self._llg_executor = llguidance.LLExecutor()
        return self._llg_executor

    def accept_tokens(
        self, progressed: list[tuple[Request, list[int]]], finish: Any
    ) -> list[tuple[Request, Exception]]:
        """Advance each constrained request's matcher with its new tokens; a request whose grammar is
        complete is finished with "stop" (through `finish(req_id, reason)`). Returns the requests whose
        matcher rejected a token, to be failed alone, and takes them out of `progressed`."""
        failed: list[tuple[Request, Exception]] = []
        for rid in [r for r, req in self._active.items() if req.status is RequestStatus.FINISHED]:
            del self._active[rid]  # finished elsewhere (a stop, a length, an abort)
        for req, toks in progressed:
            if req.request_id not in self._active or not toks:
                continue
            sor = req.structured_output_request
            try:
                sor.sync(req.output_token_ids)
            except Exception as e:
                failed.append((req, e))
                continue
            if req.finish_reason is None and sor.is_terminated:
                sor.terminated = True
                finish(req.request_id, "stop")
        if failed:
            bad = {id(req) for req, _ in failed}
            progressed[:] = [p for p in progressed if id(p[0]) not in bad]
        return failed

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
