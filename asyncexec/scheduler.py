"""vLLM-style continuous batching: an FCFS waiting queue, a running set, chunked prefill, and
preemption by recompute.

`schedule()` fills one step's token budget (`max_num_batched_tokens`, at most `max_num_seqs` requests):
running requests first, in order; when a running request needs a block and none is free, the most
recently admitted running request is preempted (its blocks freed, its tokens kept; it goes back to the
front of the queue and is recomputed later). Then waiting requests are admitted in order, after a prefix
cache lookup, while budget, sequence slots and blocks last. A prompt longer than the remaining budget is
prefilled in chunks over several steps.

The output carries new requests in full and cached ones as deltas (new blocks and computed counts). A
request the workers do not know (never sent, or the workers were replaced) is sent in full, with every
token so far as its prompt.

`update_from_output()` applies a step's `ModelRunnerOutput`: it appends sampled tokens, stops requests
on a stop token (EOS unless `ignore_eos`), `max_tokens` or `max_model_len`, frees finished requests'
blocks and returns the requests that made progress. A request whose own update raises is finished with
"error" and returned apart; the others are not held back by it.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from asyncexec.config import EngineConfig
from asyncexec.kv_cache import KVCacheManager
from asyncexec.messages import (
    CachedRequestData,
    Logprobs,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from asyncexec.sampling_params import SamplingParams

__all__ = ["Request", "RequestStatus", "Scheduler"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    known_to_workers: bool = False
    finish_reason: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float = 0.0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class Scheduler:
    def __init__(
        self, config: EngineConfig, num_blocks: int, max_model_len: int, eos_token_ids: list[int]
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self._step_ids = itertools.count()
        self.num_preemptions = 0

    # ----- requests ---------------------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish(self, req_id: str, reason: str) -> Request | None:
        """Finish (abort, error, ...) a request wherever it is; its blocks are freed at once."""
        req = self.requests.pop(req_id, None)
        if req is None:
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
        self.kv.free(req_id)
        if req.known_to_workers:
            self._finished_ids.append(req_id)
        return req

    def finish_all(self, reason: str) -> list[Request]:
        """Finish every request (the engine failed); returns them."""
        return [req for rid in list(self.requests) if (req := self.finish(rid, reason)) is not None]

    def reset_for_new_workers(self) -> int:
        """The workers were replaced: every running request is preempted (its tokens kept, to recompute),
        the KV cache's blocks and prefix hashes are dropped, and every request is sent anew in full.
        Returns how many requests will be recomputed."""
        for req in reversed(self.running):
            req.status = RequestStatus.PREEMPTED
            self.waiting.appendleft(req)
        self.running.clear()
        stats = self.kv.stats
        self.kv = KVCacheManager(
            self.kv.pool.num_usable + 1,
            self.config.block_size,
            self.kv.enable_prefix_caching,
            self.kv.hash_fn,
        )
        self.kv.stats = stats
        for req in self.waiting:
            req.num_computed_tokens = 0
            req.known_to_workers = False
        self._finished_ids.clear()
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def has_work(self) -> bool:
        return self.has_unfinished_requests() or bool(self._finished_ids)

    def stats(self) -> dict[str, float]:
        """Queue sizes, block usage, prefix-cache hits and preemptions."""
        kv = self.kv
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_blocks": kv.pool.num_usable,
            "num_free_blocks": kv.pool.num_free,
            "kv_cache_usage": kv.usage,
            "prefix_cache_queries": kv.stats.queries,
            "prefix_cache_hits": kv.stats.hits,
            "prefix_cache_hit_rate": kv.stats.hit_rate,
            "num_preemptions": self.num_preemptions,
        }

    # ----- one step ---------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        num_scheduled: dict[str, int] = {}
        preempted: list[str] = []
        for req in list(self.running):
            if budget == 0 or req.status is not RequestStatus.RUNNING:
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while (new_blocks := self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n)) is None:
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if new_blocks is None:
                continue
            self._emit(req, n, new_blocks, new_reqs, cached)
            num_scheduled[req.request_id] = n
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not preempted:
            req = self.waiting[0]
            if req.num_computed_tokens == 0:
                req.num_computed_tokens = self.kv.get_computed_blocks(req.request_id, req.all_token_ids)
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            new_blocks = self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n)
            if new_blocks is None:  # give the prefix hits back; look again next step
                self.kv.free(req.request_id)
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            resumed = req.status is RequestStatus.PREEMPTED
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._emit(
                req,
                n,
                self.kv.block_ids(req.request_id) if resumed else new_blocks,
                new_reqs,
                cached,
                resumed,
            )
            num_scheduled[req.request_id] = n
            budget -= n
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(
            next(self._step_ids),
            new_reqs,
            cached,
            num_scheduled,
            sum(num_scheduled.values()),
            finished,
            preempted,
        )

    def _emit(
        self,
        req: Request,
        n: int,
        new_blocks: list[int],
        new_reqs: list[NewRequestData],
        cached: CachedRequestData,
        resumed: bool = False,
    ) -> None:
        if not req.known_to_workers:
            blocks = self.kv.block_ids(req.request_id)
            new_reqs.append(
                NewRequestData(
                    req.request_id, req.all_token_ids, req.sampling_params, blocks, req.num_computed_tokens
                )
            )
            req.known_to_workers = True
            return
        cached.req_ids.append(req.request_id)
        cached.resumed_from_preemption.append(resumed)
        cached.new_token_ids.append([])  # the workers hold every token: they append what they sample
        cached.new_block_ids.append(new_blocks)
        cached.num_computed_tokens.append(req.num_computed_tokens)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update_from_output(
        self, so: SchedulerOutput, out: ModelRunnerOutput
    ) -> tuple[list[tuple[Request, list[int]]], list[tuple[Request, Exception]]]:
        """Apply a step's output. Returns `(request, new tokens)` for every request that progressed, and
        `(request, error)` for every request whose own update raised: those are finished with "error"
        (their blocks freed), and the others go on."""
        progressed: list[tuple[Request, list[int]]] = []
        failed: list[tuple[Request, Exception]] = []
        for i, (rid, toks) in enumerate(zip(out.req_ids, out.sampled_token_ids, strict=True)):
            req = self.requests.get(rid)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            try:
                if self._update_request(req, so.num_scheduled_tokens[rid], toks, out.logprobs, i):
                    progressed.append((req, toks))
            except Exception as e:
                self.finish(rid, "error")
                failed.append((req, e))
        return progressed, failed

    def _update_request(
        self, req: Request, num_scheduled: int, toks: list[int], logprobs: Logprobs | None, row: int
    ) -> bool:
        """Apply one request's share of a step; whether it produced tokens."""
        rid = req.request_id
        req.num_computed_tokens += num_scheduled
        if self.kv.has_uncached_full_blocks(rid, req.num_computed_tokens):  # once per block, not per token
            self.kv.cache_full_blocks(rid, req.all_token_ids, req.num_computed_tokens)
        if not toks:
            return False
        req.output_token_ids.extend(toks)
        if logprobs is not None and req.sampling_params.logprobs is not None:
            n = req.sampling_params.logprobs + 1
            req.logprobs.append(
                dict(zip(logprobs.token_ids[row][:n], logprobs.logprobs[row][:n], strict=True))
            )
        reason = self._stop_reason(req, toks[-1])
        if reason is not None:
            self.finish(rid, reason)
        return True

    def _stop_reason(self, req: Request, token: int) -> str | None:
        sp = req.sampling_params
        if token in sp.stop_token_ids or (token in self.eos_token_ids and not sp.ignore_eos):
            return "stop"
        if len(req.output_token_ids) >= sp.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None
