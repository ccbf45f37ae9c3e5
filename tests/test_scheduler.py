"""The scheduler's decisions, without workers: token budget, chunked prefill, preemption order, prefix
hits, stop conditions, new requests in full and cached ones as deltas, and per-request failures."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from asyncexec import EngineConfig, SamplingParams
from asyncexec.core.scheduler import Request, RequestStatus, Scheduler
from asyncexec.messages import ModelRunnerOutput, SchedulerOutput

BS = 4
EOS = 2


def make(num_blocks: int = 64, max_model_len: int = 256, **kw: object) -> Scheduler:
    fields: dict[str, object] = {"block_size": BS, "max_num_batched_tokens": 16, "max_num_seqs": 8}
    fields.update(kw)
    return Scheduler(EngineConfig(**fields), num_blocks, max_model_len, [EOS])  # type: ignore[arg-type]


def add(sched: Scheduler, rid: str, n: int, **sp: object) -> Request:
    params: dict[str, object] = {"temperature": 0.0, "max_tokens": 100}
    params.update(sp)
    prompt = [(ord(rid[0]) * 7 + i) % 250 for i in range(n)]  # no two ids share a first block
    req = Request(rid, prompt, SamplingParams(**params))  # type: ignore[arg-type]
    sched.add_request(req)
    return req


def step(
    sched: Scheduler, sample: Callable[[str], int] = lambda rid: 7
) -> tuple[SchedulerOutput, list[tuple[Request, list[int]]]]:
    """One step with a fake worker: a request whose scheduled tokens reach its end samples one token."""
    so = sched.schedule()
    ids, toks = [], []
    for rid, n in so.num_scheduled_tokens.items():
        req = sched.requests[rid]
        ids.append(rid)
        toks.append([sample(rid)] if req.num_computed_tokens + n >= req.num_tokens else [])
    progressed, failed = sched.update_from_output(so, ModelRunnerOutput(ids, toks))
    assert not failed
    return so, progressed


def test_the_token_budget_is_filled_in_arrival_order_and_running_requests_go_first() -> None:
    sched = make()
    for rid in "abc":
        add(sched, rid, 10)
    so, progressed = step(sched)
    assert so.num_scheduled_tokens == {"a": 10, "b": 6}  # c does not fit in the 16 tokens
    assert so.total_num_scheduled_tokens == 16
    assert [r.request_id for r, _ in progressed] == ["a"], "b's prefill is not finished: no token"
    assert [r.request_id for r in sched.waiting] == ["c"]
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 4, "c": 10}, "a decodes, b ends its prefill, then c"
    assert list(so.num_scheduled_tokens) == ["a", "b", "c"]


def test_max_num_seqs_bounds_the_running_set() -> None:
    sched = make(max_num_seqs=2)
    for rid in "abc":
        add(sched, rid, 2)
    so, _ = step(sched)
    assert set(so.num_scheduled_tokens) == {"a", "b"} and len(sched.running) == 2


def test_a_long_prompt_is_prefilled_in_chunks_and_samples_only_at_its_end() -> None:
    sched = make()
    req = add(sched, "long", 40)
    chunks, sampled = [], []
    while not req.output_token_ids:
        so, progressed = step(sched)
        chunks.append(so.num_scheduled_tokens["long"])
        sampled.append(bool(progressed))
    assert chunks == [16, 16, 8] and sampled == [False, False, True]
    assert req.num_computed_tokens == 40 and len(sched.kv.block_ids("long")) == 10


def test_the_newest_running_request_is_preempted_first_and_resumed_in_full() -> None:
    # 6 usable blocks; three prompts of 8 tokens hold 2 blocks each, and each needs a third to decode
    sched = make(num_blocks=7, max_num_batched_tokens=32, enable_prefix_caching=False)
    a = add(sched, "a", 8, max_tokens=2)
    add(sched, "b", 8)
    c = add(sched, "c", 8)
    step(sched)
    assert sched.kv.pool.num_free == 0
    so, _ = step(sched)
    assert so.preempted_req_ids == ["c"], "the most recently admitted request goes, not b"
    assert c.status is RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert sched.kv.block_ids("c") == [] and list(sched.waiting) == [c]
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}, "no waiting request is admitted in that step"
    assert a.finish_reason == "length" and sched.num_preemptions == 1
    so, _ = step(sched)
    assert so.finished_req_ids == ["a"]
    cached = so.scheduled_cached_reqs
    assert so.scheduled_new_reqs == [] and cached.req_ids == ["b", "c"]
    i = cached.req_ids.index("c")
    assert cached.resumed_from_preemption == [False, True]
    assert cached.new_block_ids[i] == sched.kv.block_ids("c") and len(cached.new_block_ids[i]) == 3
    assert cached.num_computed_tokens[i] == 0 and so.num_scheduled_tokens["c"] == 9, "recomputed"
    assert [r.request_id for r in sched.running] == ["b", "c"] and not sched.waiting


def test_a_shared_prefix_is_hit_and_only_the_rest_is_computed() -> None:
    sched = make()
    a = add(sched, "a", 10, max_tokens=1)
    step(sched)
    assert a.finish_reason == "length"
    a_blocks = [b.block_id for b in sched.kv.pool.cached.values()]
    b = Request("b", [*a.prompt_token_ids[:8], 99, 98, 97], SamplingParams(temperature=0.0))
    sched.add_request(b)
    so, _ = step(sched)
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 8 and new.block_ids[:2] == a_blocks[:2]
    assert so.num_scheduled_tokens == {"b": 3}
    other = Request("c", [1, *a.prompt_token_ids[1:8], 5], SamplingParams(temperature=0.0))
    sched.add_request(other)
    so, _ = step(sched)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0, "a different first block shares nothing"


@pytest.mark.parametrize(
    ("sp", "tokens", "reason", "n_out"),
    [
        ({"stop_token_ids": [5]}, [9, 5, 9], "stop", 2),
        ({}, [9, EOS, 9], "stop", 2),
        ({"ignore_eos": True, "max_tokens": 3}, [EOS, EOS, EOS, EOS], "length", 3),
        ({"max_tokens": 2}, [9, 9, 9], "length", 2),
        ({"max_tokens": 100}, [9] * 10, "length", 3),  # max_model_len=8: 5 prompt + 3 generated
    ],
    ids=["stop-token", "eos", "ignore-eos", "max-tokens", "max-model-len"],
)
def test_stop_conditions(sp: dict[str, object], tokens: list[int], reason: str, n_out: int) -> None:
    sched = make(max_model_len=8)
    req = add(sched, "r", 5, **sp)
    it = iter(tokens)
    while req.finish_reason is None:
        step(sched, lambda rid: next(it))
    assert req.finish_reason == reason and len(req.output_token_ids) == n_out
    assert req.status is RequestStatus.FINISHED and "r" not in sched.requests
    assert sched.kv.pool.num_free == sched.kv.pool.num_usable, "a finished request's blocks are freed"
    assert sched.schedule().finished_req_ids == ["r"], "the workers are told once"
    assert sched.schedule().finished_req_ids == []


def test_new_requests_travel_in_full_and_cached_ones_as_deltas() -> None:
    sched = make()
    req = add(sched, "r", 7)
    so, _ = step(sched)
    (new,) = so.scheduled_new_reqs
    assert new.prompt_token_ids == req.prompt_token_ids and new.num_computed_tokens == 0
    assert new.block_ids == sched.kv.block_ids("r") and len(new.block_ids) == 2
    assert so.scheduled_cached_reqs.num_reqs == 0
    so, _ = step(sched)  # 8 tokens: still two blocks
    c = so.scheduled_cached_reqs
    assert so.scheduled_new_reqs == [] and c.req_ids == ["r"]
    assert c.new_block_ids == [[]] and c.new_token_ids == [[]] and c.num_computed_tokens == [7]
    assert c.resumed_from_preemption == [False]
    so, _ = step(sched)  # the 9th token needs a third block: only that one travels
    assert so.scheduled_cached_reqs.new_block_ids == [sched.kv.block_ids("r")[2:]]
    assert sched.reset_for_new_workers() == 1  # new workers know nothing: sent in full, all tokens
    so = sched.schedule()
    (new,) = so.scheduled_new_reqs
    assert new.prompt_token_ids == req.all_token_ids and new.num_computed_tokens == 0
    assert so.num_scheduled_tokens == {"r": 10}


def test_a_request_whose_own_update_raises_fails_alone() -> None:
    sched = make()
    a, b = add(sched, "a", 3), add(sched, "b", 3)
    real = sched._stop_reason

    def stop_reason(req: Request, token: int) -> str | None:
        if req.request_id == "b":
            raise RuntimeError("bad stop check")
        return real(req, token)

    sched._stop_reason = stop_reason  # type: ignore[method-assign]
    so = sched.schedule()
    progressed, failed = sched.update_from_output(so, ModelRunnerOutput(["a", "b"], [[7], [7]]))
    assert [r.request_id for r, _ in progressed] == ["a"]
    assert [(r.request_id, str(e)) for r, e in failed] == [("b", "bad stop check")]
    assert b.finish_reason == "error" and "b" not in sched.requests and sched.kv.block_ids("b") == []
    assert a.status is RequestStatus.RUNNING
    so, _ = step(sched)
    assert so.finished_req_ids == ["b"] and list(so.num_scheduled_tokens) == ["a"]


def test_finish_frees_a_request_wherever_it_is() -> None:
    sched = make()
    add(sched, "run", 3)
    add(sched, "wait", 3)
    sched.schedule()  # both admitted and sent to the workers
    add(sched, "queued", 3)
    assert sched.finish("queued", "abort") is not None and not sched.waiting
    assert sched.finish("run", "abort") is not None and sched.finish("run", "abort") is None
    assert [r.request_id for r in sched.finish_all("error")] == ["wait"]
    assert sched.kv.pool.num_free == sched.kv.pool.num_usable and not sched.has_unfinished_requests()
    assert sched.schedule().finished_req_ids == ["run", "wait"], "queued was never sent: not named"


def test_copies_wait_for_the_prompt_then_share_it_so_it_is_prefilled_once() -> None:
    sched = make(max_num_batched_tokens=64)
    prompt = list(range(30, 60))  # 30 tokens: 7 full blocks and 2 tokens
    leader = Request("0_r", prompt, SamplingParams(temperature=1.0, seed=1, max_tokens=3))
    copies = [
        Request(f"{i}_r", list(prompt), SamplingParams(temperature=1.0, seed=1 + i, max_tokens=3))
        for i in (1, 2)
    ]
    sched.add_request(leader, copies)
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"0_r": 30}, "only the leader prefills"
    assert [r.request_id for r in sched.waiting] == ["1_r", "2_r"]
    so, _ = step(sched)
    new = {n.req_id: n for n in so.scheduled_new_reqs}
    assert so.num_scheduled_tokens == {"0_r": 1, "1_r": 2, "2_r": 2}, "each copy computes 2 prompt tokens"
    shared = sched.kv.block_ids("0_r")[:7]
    assert new["1_r"].block_ids[:7] == new["2_r"].block_ids[:7] == shared
    assert new["1_r"].num_computed_tokens == 28 and new["1_r"].num_prompt_tokens == 30
    assert all(sched.kv.pool.blocks[b].ref_cnt == 3 for b in shared)
    while sched.has_unfinished_requests():
        step(sched)
    assert sched.kv.pool.num_free == sched.kv.pool.num_usable


def test_aborting_a_leader_before_its_prefill_lets_its_copies_prefill_alone() -> None:
    sched = make()
    leader = Request("0_r", list(range(8)), SamplingParams(max_tokens=2))
    copy = Request("1_r", list(range(8)), SamplingParams(max_tokens=2))
    sched.add_request(leader, [copy])
    sched.finish("0_r", "abort")
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"1_r": 8} and not sched.forks


def test_prompt_logprobs_requests_skip_the_prefix_cache_and_max_tokens_0_only_scores() -> None:
    sched = make()
    add(sched, "a", 12, max_tokens=1)
    step(sched)
    req = add(sched, "a2", 12, max_tokens=0, prompt_logprobs=1)  # the same prompt: all of it is cached
    so, progressed = step(sched)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0 and so.num_scheduled_tokens == {"a2": 12}
    assert progressed == [(req, [])] and req.finish_reason == "length" and req.output_token_ids == []


def test_a_long_prefill_takes_at_most_the_threshold_while_others_run() -> None:
    sched = make(num_blocks=256, max_num_batched_tokens=64, long_prefill_token_threshold=8)
    add(sched, "a", 4)
    step(sched)  # a is decoding now
    add(sched, "b", 40)
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 8}, "b is capped: a keeps its steady gap"
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 8}


def test_the_prefill_cap_shrinks_as_the_chunk_attends_to_more_context() -> None:
    cfg = EngineConfig(
        block_size=4, max_num_batched_tokens=64, max_num_seqs=8, long_prefill_token_threshold=32
    )
    sched = Scheduler(cfg, 256, 512, [EOS], attention_crossover=32)
    add(sched, "a", 4)
    step(sched)  # a is decoding now
    b = add(sched, "b", 200)
    sizes = []
    while b.num_computed_tokens < 200:
        so, _ = step(sched)
        sizes.append(so.num_scheduled_tokens["b"])
    # cap x C // (C + context): 32 at context 0, 16 at 32, 12 at 48, 11 at 60, 9 at 71, 9 at 80
    assert sizes[:6] == [32, 16, 12, 11, 9, 9], sizes
    assert min(sizes[:-1]) == 4 and sum(sizes) == 200, "never below one block, but for the last tokens"


def test_a_lone_long_prefill_takes_the_whole_budget() -> None:
    sched = make(num_blocks=256, max_num_batched_tokens=64, long_prefill_token_threshold=8)
    add(sched, "b", 40)
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"b": 40}


def test_a_lone_request_stops_at_what_the_cache_holds_and_is_never_preempted() -> None:
    # 6 usable blocks of 4 hold 24 computed tokens, far under max_model_len=256: the request ends there
    # ("length", 25 tokens: the last sampled one is never computed) instead of preempting itself for a
    # seventh block that can never come, and waiting for it forever at the head of the queue
    sched = make(num_blocks=7, max_num_batched_tokens=32, enable_prefix_caching=False)
    req = add(sched, "a", 8, ignore_eos=True)
    behind = add(sched, "b", 3, max_tokens=1)
    for _ in range(40):
        if not sched.has_unfinished_requests():
            break
        step(sched)
    assert req.finish_reason == "length" and req.num_tokens == 25 and len(req.output_token_ids) == 17
    assert behind.finish_reason == "length", "the request behind it is served"
    assert sched.num_preemptions == 0
    assert sched.kv.pool.num_free == sched.kv.pool.num_usable
