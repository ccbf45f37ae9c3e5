"""Drives an executor's workers with the engine's own step (`EngineCore`: the `Scheduler`, no
tokenizer), so the worker tests see the `SchedulerOutput`s that production sends: new requests in full,
cached ones as deltas, chunked prefill, steps that mix prefill and decode, and preemption with
recompute when blocks run out. Requests can arrive late; each stops at its `max_tokens` (EOS is
ignored, so that the schedule does not depend on the sampled tokens), and the driver counts what
happened so a test can assert it did.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import msgspec

from asyncexec import Executor, SamplingParams, SchedulerOutput
from asyncexec.core.scheduler import Request, Scheduler
from asyncexec.engine.core import EngineCore


@dataclass
class Req:
    req_id: str
    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    arrive: int = 0  # the step at which it is added to the scheduler
    out: list[int] = field(default_factory=list)


class Driver:
    def __init__(self, executor: Executor, num_blocks: int, block_size: int, budget: int, max_seqs: int = 64):
        assert block_size == executor.config.block_size, "the workers address blocks of their own size"
        assert budget <= executor.config.max_num_batched_tokens, "the workers' buffers bound a step"
        self.ex = executor
        self.num_blocks = num_blocks
        self.config = dataclasses.replace(
            executor.config,
            max_num_batched_tokens=budget,
            max_num_seqs=min(max_seqs, executor.config.max_num_seqs),
        )
        self.reqs: list[Req] = []
        self.max_blocks_in_use = 0
        self.num_preemptions = 0
        self.mixed_steps = 0  # steps holding both a decode and a prefill chunk
        self.chunked = 0  # prefill chunks that did not reach the end of their prompt
        self.stats: dict[str, float] = {}  # the scheduler's, at the end (speculative decoding's counters)

    def add(self, req: Req) -> None:
        self.reqs.append(req)

    async def run(self, max_steps: int = 10_000) -> dict[str, list[int]]:
        info = (await self.ex.collective_rpc("get_model_info"))[0]
        sched = Scheduler(self.config, self.num_blocks, info["max_model_len"], info["eos_token_ids"])
        core = EngineCore(sched)
        pending = sorted(self.reqs, key=lambda r: r.arrive)
        step = 0
        while pending or sched.has_work():
            assert step < max_steps, "the scheduler made no progress"
            while pending and pending[0].arrive <= step:
                r = pending.pop(0)
                sp = msgspec.structs.replace(r.params, max_tokens=r.max_tokens, ignore_eos=True)
                sched.add_request(Request(r.req_id, list(r.prompt), sp))
            step += 1
            if sched.has_work():
                await self._step(core)
        self.num_preemptions = sched.num_preemptions
        self.stats = sched.stats()
        return {r.req_id: r.out for r in self.reqs}

    async def _step(self, core: EngineCore) -> None:
        step = await core.schedule_and_run(self.ex)
        assert step.error is None and step.output is not None, step.error
        self._count(core.scheduler, step.scheduler_output)
        progressed, failed = core.update(step)
        assert not failed, failed
        self.chunked += sum(1 for toks in step.output.sampled_token_ids if not toks)
        by_id = {r.req_id: r for r in self.reqs}
        for req, _ in progressed:
            by_id[req.request_id].out = list(req.output_token_ids)

    def _count(self, sched: Scheduler, so: SchedulerOutput) -> None:
        pool = sched.kv.pool
        self.max_blocks_in_use = max(self.max_blocks_in_use, pool.num_usable - pool.num_free)
        n = so.num_scheduled_tokens
        decodes = any(k == 1 and sched.requests[rid].output_token_ids for rid, k in n.items())
        self.mixed_steps += decodes and any(k > 1 for k in n.values())
