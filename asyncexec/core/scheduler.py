"""vLLM-style continuous batching: an FCFS waiting queue, a running set, chunked prefill, and
preemption by recompute.

`schedule()` fills one step's token budget (`max_num_batched_tokens`, at most `max_num_seqs` requests):
running requests first, in order; when a running request needs a block and none is free, the most
recently admitted running request is preempted (its blocks freed, its tokens kept; it goes back to the
front of the queue and is recomputed later). Then waiting requests are admitted in order, after a prefix
cache lookup, while budget, sequence slots and blocks last. A prompt longer than the remaining budget is
prefilled in chunks over several steps, and while other requests run, no prefill takes more than
`long_prefill_token_threshold` tokens of a step.

The output carries new requests in full and cached ones as deltas (new blocks and computed counts). A
request the workers do not know (never sent, or the workers were replaced) is sent in full, with every
token so far as its prompt.

`update_from_output()` applies a step's `ModelRunnerOutput`: it appends sampled tokens (and gathers
prompt logprobs), stops requests on a stop token (EOS unless `ignore_eos`, once `min_tokens` are out),
`max_tokens` or `max_model_len`, frees finished requests' blocks and returns the requests that made
progress. A request whose own update raises is finished with "error" and returned apart; the others
are not held back by it. Stop strings are found later, on the detokenized text, by the engine's
output processor, which finishes the request through `finish()` in the same step.

Speculative decoding (`config.speculative_config`): a running request that is decoding proposes draft
tokens (`spec_decode.SpecDecodePolicy`, in this process), scheduled as extra query tokens of its row
(`scheduled_spec_decode_tokens`): they count against the token budget and get KV slots. A request whose
drafts do not fit the free blocks decodes without them before anyone is preempted. The workers return
the accepted drafts and one more token; the rejected drafts' slots stay the request's and the next step
overwrites them (a block enters the prefix cache only once its tokens are computed and accepted).
Requests with structured outputs do not speculate.

Parallel sampling: a request's copies (`add_request(req, copies)`) wait until its prompt is computed;
in the step that samples its first token, `_fork` shares its prompt blocks with them, so the prompt is
prefilled once and each copy computes at most one block of it.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from asyncexec.config import EngineConfig
from asyncexec.core.kv_cache import KVCacheManager, tokens_held
from asyncexec.core.request import Request, RequestStatus
from asyncexec.messages import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    PromptLogprobs,
    SchedulerOutput,
)
from asyncexec.spec_decode.policy import SpecDecodePolicy

__all__ = ["Request", "RequestStatus", "Scheduler"]


@dataclass
class _StepBuilder:
    """The step `schedule()` is building: its remaining token budget and what it has scheduled."""

    budget: int
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled: dict[str, int] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    speculate: bool = False  # whether decoding requests propose drafts in this step


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        max_model_len: int,
        eos_token_ids: list[int],
        attention_crossover: int | None = None,
    ) -> None:
        self.config = config
        self.attention_crossover = attention_crossover  # see `_cap_prefill`
        self.eos_token_ids = set(eos_token_ids)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        # A request stops ("length") before it outgrows the whole cache, so one running alone always gets
        # its blocks: never preempted for blocks that cannot come (the engine refuses a request whose
        # max_tokens would reach this bound first; see `InputProcessor.check_fits`).
        self.max_model_len = min(max_model_len, tokens_held(num_blocks, config.block_size) + 1)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self._step_ids = itertools.count()
        self.num_preemptions = 0
        # Parallel sampling: the copies of a request that wait for its prompt to be computed once.
        self.forks: dict[str, list[Request]] = {}
        spec = config.speculative_config
        self.spec = SpecDecodePolicy(spec) if spec is not None else None

    # ----- requests ---------------------------------------------------------------------------------

    def add_request(self, req: Request, copies: Sequence[Request] = ()) -> None:
        """Queue `req`; its `copies` (same prompt) wait until its prompt is computed, then share its
        prompt blocks (see `_fork`)."""
        for r in (req, *copies):
            self.requests[r.request_id] = r
            if r.sampling_params.prompt_logprobs is not None:  # every prompt position needs its logits
                self.kv.no_prefix_lookup.add(r.request_id)
        self.waiting.append(req)
        if copies:
            self.forks[req.request_id] = list(copies)

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
        if self.spec is not None:
            self.spec.forget(req_id)
        self.kv.no_prefix_lookup.discard(req_id)
        if req.known_to_workers:
            self._finished_ids.append(req_id)
        for copies in self.forks.values():
            if req in copies:
                copies.remove(req)
        self.waiting.extend(self.forks.pop(req_id, ()))  # never forked: they compute the prompt alone
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
        stats, old_no_lookup = self.kv.stats, self.kv.no_prefix_lookup
        self.kv = KVCacheManager(
            self.kv.pool.num_usable + 1,
            self.config.block_size,
            self.kv.enable_prefix_caching,
            self.kv.hash_fn,
        )
        self.kv.stats = stats
        self.kv.no_prefix_lookup = {r for r in self.requests if r in old_no_lookup}
        for req in self.waiting:
            req.num_computed_tokens = 0
            req.known_to_workers = False
        self._finished_ids.clear()
        return len(self.waiting)

    def resend_finished(self, req_ids: Sequence[str]) -> None:
        """Tell the workers again, in the next step, that `req_ids` finished (a step they failed to apply)."""
        self._finished_ids.extend(req_ids)

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
            **(self.spec.stats.as_dict() if self.spec is not None else {}),
        }

    # ----- one step ---------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        step = _StepBuilder(self.config.max_num_batched_tokens)
        step.speculate = self.spec is not None and self.spec.enabled_for_batch(len(self.running))
        self._schedule_running(step)
        if not step.preempted:  # no admission in a step that had to preempt
            self._schedule_waiting(step)
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(
            next(self._step_ids),
            step.new_reqs,
            step.cached,
            step.num_scheduled,
            sum(step.num_scheduled.values()),
            finished,
            step.preempted,
            scheduled_spec_decode_tokens=step.spec_tokens,
        )

    def _schedule_running(self, step: _StepBuilder) -> None:
        """Running requests, in order; a request that needs a block when none is free preempts the most
        recently admitted one (itself, last)."""
        for req in list(self.running):
            if step.budget == 0 or req.status is not RequestStatus.RUNNING:
                continue
            drafts = self._drafts(req, step)
            n = self._cap_prefill(req, min(req.num_tokens - req.num_computed_tokens, step.budget))
            new_blocks = self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n + len(drafts))
            if new_blocks is None:  # decode without the drafts before preempting anyone for them
                drafts = []
            while (
                new_blocks is None
                and (new_blocks := self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n))
                is None
            ):
                victim = self.running[-1]
                self._preempt(victim)
                step.preempted.append(victim.request_id)
                if victim is req:
                    break
            if new_blocks is not None:
                if drafts:
                    step.spec_tokens[req.request_id] = drafts
                self._emit(step, req, n + len(drafts), new_blocks)

    def _drafts(self, req: Request, step: _StepBuilder) -> list[int]:
        """A decoding request's draft tokens for this step (speculative decoding), within what the step's
        budget, its `max_tokens` and the model length leave for them; [] for a request that does not
        speculate now."""
        if not step.speculate or req.num_tokens - req.num_computed_tokens != 1:
            return []
        if req.structured_output_request is not None:  # its grammar would have to check every draft
            return []
        assert self.spec is not None
        limit = min(
            step.budget - 1,
            req.sampling_params.max_tokens - len(req.output_token_ids) - 1,
            self.max_model_len - req.num_tokens - 1,
        )
        return self.spec.propose(req.request_id, req.all_token_ids, limit) if limit > 0 else []

    def _schedule_waiting(self, step: _StepBuilder) -> None:
        """Waiting requests, in order, after a prefix-cache lookup, while budget, sequence slots and
        blocks last; those waiting for their grammar keep their place in the queue."""
        skipped: list[Request] = []
        while self.waiting and step.budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.waiting_for_grammar:
                skipped.append(self.waiting.popleft())
                continue
            if req.num_computed_tokens == 0:
                req.num_computed_tokens = self.kv.get_computed_blocks(req.request_id, req.all_token_ids)
            n = self._cap_prefill(req, min(req.num_tokens - req.num_computed_tokens, step.budget))
            new_blocks = self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n)
            if new_blocks is None:  # give the prefix hits back; look again next step
                self.kv.free(req.request_id)
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            resumed = req.status is RequestStatus.PREEMPTED
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._emit(step, req, n, self.kv.block_ids(req.request_id) if resumed else new_blocks, resumed)
        self.waiting.extendleft(reversed(skipped))

    def _cap_prefill(self, req: Request, n: int) -> int:
        """A long prefill takes at most `long_prefill_token_threshold` tokens of a step while other
        requests run, so their streams keep a steady gap (vLLM's cap); alone, it takes the budget.

        A chunk's tokens cost more the longer the context they attend to: with the model's
        `attention_crossover` C (the context at which a token's attention costs as much as its linear
        layers), a chunk starting at context c gets cap x C / (C + c) tokens (at least one block), so a
        step costs about the same at the end of a long prompt as at its start."""
        cap = self.config.long_prefill_token_threshold
        if not cap or n <= min(cap, self.config.block_size) or all(r is req for r in self.running):
            return n
        if self.attention_crossover:
            c = self.attention_crossover
            cap = max(min(cap, self.config.block_size), cap * c // (c + req.num_computed_tokens))
        return min(n, cap)

    def _emit(
        self, step: _StepBuilder, req: Request, n: int, new_blocks: list[int], resumed: bool = False
    ) -> None:
        """Schedule `n` tokens of `req`: in full where the workers do not know it, else as a delta."""
        step.num_scheduled[req.request_id] = n
        step.budget -= n
        if not req.known_to_workers:
            blocks = self.kv.block_ids(req.request_id)
            step.new_reqs.append(
                NewRequestData(
                    req.request_id,
                    req.all_token_ids,
                    req.sampling_params,
                    blocks,
                    req.num_computed_tokens,
                    len(req.prompt_token_ids),
                )
            )
            req.known_to_workers = True
            return
        cached = step.cached
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
        row = 0  # `out.logprobs` has a row per sampled token, requests in order
        for rid, toks in zip(out.req_ids, out.sampled_token_ids, strict=True):
            first, row = row, row + len(toks)
            req = self.requests.get(rid)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            try:
                plp = out.prompt_logprobs.get(rid)
                drafts = so.scheduled_spec_decode_tokens.get(rid, ())
                new = self._update_request(
                    req, so.num_scheduled_tokens[rid], toks, out, first, plp, len(drafts)
                )
                if new is not None:
                    progressed.append((req, new))
            except Exception as e:
                self.finish(rid, "error")
                failed.append((req, e))
        return progressed, failed

    def _update_request(
        self,
        req: Request,
        num_scheduled: int,
        toks: list[int],
        out: ModelRunnerOutput,
        row: int,
        plp: PromptLogprobs | None,
        num_drafts: int = 0,
    ) -> list[int] | None:
        """Apply one request's share of a step; the tokens it produced, or None if it produced none.
        `toks` holds one token per logprobs row from `row` on; after `num_drafts` draft tokens, the
        accepted drafts and the token after them (the rejected drafts' KV is not counted computed)."""
        rid = req.request_id
        if num_drafts:
            if not 1 <= len(toks) <= num_drafts + 1:
                raise ValueError(f"{len(toks)} tokens back for a step with {num_drafts} draft tokens")
            req.num_computed_tokens += len(toks)  # the last token and the accepted drafts
            assert self.spec is not None
            self.spec.record(rid, num_drafts, len(toks) - 1)
        else:
            req.num_computed_tokens += num_scheduled
        if plp is not None:
            req.add_prompt_logprobs(plp)
        if not toks:
            self._cache_blocks(req)
            return None
        if rid in self.forks:  # its prompt is computed: the copies share it before it can finish
            self._fork(req)
        if req.sampling_params.max_tokens == 0:  # scoring only: the prompt logprobs were the point
            self._cache_blocks(req)
            self.finish(rid, "length")
            return []
        reason = None
        for i, tok in enumerate(toks):  # a stop ends the request at its token: later ones are dropped
            req.append_output([tok], out.logprobs, row + i)
            reason = self._stop_reason(req, tok)
            if reason is not None:
                toks = toks[: i + 1]
                break
        self._cache_blocks(req)
        if reason is not None:
            self.finish(rid, reason)
        return toks

    def _cache_blocks(self, req: Request) -> None:
        """Register the request's full, computed blocks in the prefix cache (once per block, not per step)."""
        if self.kv.has_uncached_full_blocks(req.request_id, req.num_computed_tokens):
            self.kv.cache_full_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens)

    def _fork(self, parent: Request) -> None:
        """Give each waiting copy of `parent` its prompt blocks (all but the block holding the last
        prompt token, whose logits each copy computes itself) and queue it first."""
        shared = len(parent.prompt_token_ids) - 1
        copies = self.forks.pop(parent.request_id)
        for c in copies:
            c.num_computed_tokens = self.kv.fork(parent.request_id, c.request_id, shared)
        self.waiting.extendleft(reversed(copies))

    def _stop_reason(self, req: Request, token: int) -> str | None:
        sp = req.sampling_params
        if len(req.output_token_ids) >= sp.min_tokens:
            if token in sp.stop_token_ids:
                req.stop_reason = token  # vLLM names the stop token; EOS has no stop_reason
                return "stop"
            if token in self.eos_token_ids and not sp.ignore_eos:
                return "stop"
        if len(req.output_token_ids) >= sp.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None
