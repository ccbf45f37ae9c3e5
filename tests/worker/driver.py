"""A minimal hand scheduler for the worker tests: it builds `SchedulerOutput`s the way a real one would
(full data for new requests, deltas for cached ones), so the model runner can be tested before the
engine's scheduler exists. Requests can arrive late, finish early, and be preempted and resumed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncexec import CachedRequestData, Executor, NewRequestData, SamplingParams, SchedulerOutput
from asyncexec.messages import ModelRunnerOutput


@dataclass
class Req:
    req_id: str
    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    arrive: int = 0
    preempt_at: int | None = None  # step after which it is preempted (then resumed when blocks allow)
    out: list[int] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    sent: bool = False
    resumed: bool = False
    done: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out


class Driver:
    def __init__(self, executor: Executor, num_blocks: int, block_size: int, budget: int, max_seqs: int = 64):
        self.ex = executor
        self.free = list(range(1, num_blocks))  # block 0 is the null block
        self.bs = block_size
        self.budget = budget
        self.max_seqs = max_seqs
        self.reqs: list[Req] = []
        self.step_id = 0
        self.finished: list[str] = []
        self.preempted: list[str] = []
        self.max_blocks_in_use = 0
        self.num_preemptions = 0
        self.mixed_steps = 0  # steps holding both a decode and a prefill chunk
        self.chunked = 0  # prefill chunks that did not reach the end of their prompt

    def add(self, req: Req) -> None:
        self.reqs.append(req)

    def _schedule(self) -> SchedulerOutput:
        budget, new, cached = self.budget, [], CachedRequestData()
        sched: dict[str, int] = {}
        for r in self.reqs:
            if r.done or r.arrive > self.step_id or budget == 0 or len(sched) == self.max_seqs:
                continue
            n = min(len(r.tokens) - r.computed, budget)
            need = -(-(r.computed + n) // self.bs) - len(r.blocks)
            if need > len(self.free):
                continue
            fresh = [self.free.pop(0) for _ in range(need)]
            r.blocks += fresh
            if not r.sent:
                new.append(NewRequestData(r.req_id, list(r.prompt), r.params, list(r.blocks), r.computed))
                r.sent = True
            else:
                cached.req_ids.append(r.req_id)
                cached.resumed_from_preemption.append(r.resumed)
                cached.new_token_ids.append([])
                cached.new_block_ids.append(list(r.blocks) if r.resumed else fresh)
                cached.num_computed_tokens.append(r.computed)
                r.resumed = False
            sched[r.req_id] = n
            budget -= n
        self.max_blocks_in_use = max(self.max_blocks_in_use, sum(len(r.blocks) for r in self.reqs))
        self.mixed_steps += 1 in sched.values() and any(n > 1 for n in sched.values())
        so = SchedulerOutput(
            self.step_id, new, cached, sched, sum(sched.values()), self.finished, self.preempted
        )
        self.finished, self.preempted = [], []
        return so

    def _update(self, so: SchedulerOutput, out: ModelRunnerOutput) -> None:
        by_id = {r.req_id: r for r in self.reqs}
        for i, (rid, toks) in enumerate(zip(out.req_ids, out.sampled_token_ids, strict=True)):
            r = by_id[rid]
            r.computed += so.num_scheduled_tokens[rid]
            r.out += toks
            self.chunked += not toks
            if toks and out.logprobs is not None:
                r.logprobs.append(out.logprobs.logprobs[i])
            if len(r.out) >= r.max_tokens:
                r.done = True
                self.free += r.blocks
                r.blocks = []
                self.finished.append(rid)
            elif r.preempt_at is not None and self.step_id >= r.preempt_at and r.out and not r.resumed:
                r.preempt_at = None  # preempt once: free the blocks, recompute from scratch later
                self.free += r.blocks
                r.blocks, r.computed, r.resumed = [], 0, True
                self.preempted.append(rid)
                self.num_preemptions += 1

    async def run(self, max_steps: int = 10_000) -> dict[str, list[int]]:
        while not all(r.done for r in self.reqs):
            assert self.step_id < max_steps, "the driver made no progress"
            so = self._schedule()
            out = await self.ex.execute_model(so)
            self._update(so, out)
            self.step_id += 1
        if self.finished:  # let the workers drop the last finished requests
            await self.ex.execute_model(self._schedule())
        return {r.req_id: r.out for r in self.reqs}
