"""Speculative decoding without a model: the config, the n-gram proposer, the adaptive policy, and the
scheduler's handling of draft tokens (budget, KV slots, rejected drafts, stops, preemption) against a fake
worker that verifies drafts the way the real one does (`worker.spec_verify`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec
import pytest

from asyncexec import CachedRequestData, EngineConfig, NewRequestData, SamplingParams, SchedulerOutput
from asyncexec.core.scheduler import Request, Scheduler
from asyncexec.entrypoints.cli import build_parser
from asyncexec.entrypoints.config_args import engine_config_from_args
from asyncexec.errors import ConfigError, ProtocolError
from asyncexec.messages import ModelRunnerOutput
from asyncexec.spec_decode import SpeculativeConfig
from asyncexec.spec_decode.ngram import NgramProposer
from asyncexec.spec_decode.policy import MAX_BACKOFF_STEPS, SpecDecodePolicy
from asyncexec.worker.input_batch import InputBatch
from asyncexec.worker.spec_verify import accepted_prefix, draft_histories

BS = 4
EOS = 2
Target = Callable[[Sequence[int]], int]

# ----- the config ------------------------------------------------------------------------------------


def test_a_dict_becomes_the_validated_config_and_travels_as_msgpack() -> None:
    cfg = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3})  # type: ignore[arg-type]
    assert cfg.speculative_config == SpeculativeConfig(num_speculative_tokens=3)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(cfg), type=EngineConfig)
    assert back == cfg and isinstance(back.speculative_config, SpeculativeConfig)
    assert EngineConfig().speculative_config is None


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ({"method": "suffix"}, "speculative_config.method='suffix' is not supported"),
        ({"method": "eagle", "model": "x"}, "unknown key(s) 'model'"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be in 1..16, got 0"),
        ({"num_speculative_tokens": 17}, "num_speculative_tokens must be in 1..16, got 17"),
        ({"num_speculative_tokens": True}, "num_speculative_tokens must be an integer"),
        (
            {"prompt_lookup_min": 5, "prompt_lookup_max": 3},
            "prompt_lookup_min=5 is above prompt_lookup_max=3",
        ),
        ({"disable_by_batch_size": 0}, "disable_by_batch_size must be >= 1"),
        ("ngram", "speculative_config must be a dict"),
    ],
)
def test_bad_speculative_configs_are_refused_naming_the_key(value: object, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        EngineConfig(speculative_config=value)  # type: ignore[arg-type]
    assert needle in str(e.value)


def test_the_flag_takes_json() -> None:
    spec = '{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": null}'
    for command in (["generate", "hi"], ["serve"]):
        ns = build_parser().parse_args([*command, "--model", "m", "--speculative-config", spec])
        cfg = engine_config_from_args(ns)
        assert cfg.speculative_config == SpeculativeConfig(
            num_speculative_tokens=2, disable_by_batch_size=None
        )
    ns = build_parser().parse_args(["serve", "--model", "m", "--speculative-config", "none"])
    assert engine_config_from_args(ns).speculative_config is None
    for bad in ('{"method": "x"}', "{not json"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--speculative-config", bad])


# ----- the proposer and the verification rule -------------------------------------------------------


def test_ngram_lookup_proposes_what_followed_the_most_recent_longest_match() -> None:
    p = NgramProposer(2, 4)
    assert p.propose([1, 2, 3, 4, 5, 1, 2, 3], 4) == [4, 5, 1, 2]
    # 3-gram (9, 1, 2) occurred at the start; the 2-gram (1, 2) more recently: the longer match wins
    assert p.propose([9, 1, 2, 7, 8, 1, 2, 5, 9, 1, 2], 2) == [7, 8]
    assert p.propose([5, 1, 2, 9, 1, 2, 6, 1, 2], 1) == [6], "the most recent occurrence of the 2-gram"
    assert p.propose([1, 2, 3, 9, 2, 3], 2) == [9, 2]
    assert p.propose([3, 1, 2, 9, 1, 5, 5, 2, 3], 3) == [], "only a 1-gram matches, below prompt_lookup_min"
    assert p.propose([1, 2], 4) == [] and p.propose([1, 2, 1, 2], 0) == []


def test_a_match_that_runs_into_the_end_repeats_its_period() -> None:
    p = NgramProposer(2, 4)
    assert p.propose([7, 7, 7, 7], 4) == [7, 7, 7, 7]
    assert p.propose([1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]
    assert p.propose([4, 1, 2, 3, 1, 2, 3, 1, 2], 6) == [3, 1, 2, 3, 1, 2]


def test_verification_keeps_the_drafts_up_to_the_first_disagreement() -> None:
    assert accepted_prefix([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accepted_prefix([5, 6, 7], [5, 9, 7, 8]) == 1
    assert accepted_prefix([5, 6, 7], [4, 6, 7, 8]) == 0
    assert draft_histories([1, 2], [5, 6]) == [[1, 2], [1, 2, 5], [1, 2, 5, 6]]


def test_the_policy_backs_off_a_request_that_misses_and_grows_one_that_hits() -> None:
    pol = SpecDecodePolicy(SpeculativeConfig(num_speculative_tokens=4))
    toks = [1, 2, 3, 1, 2, 3, 1, 2]

    def skipped() -> int:
        n = 0
        while not pol.propose("r", toks, 10):
            n += 1
        return n

    assert pol.propose("r", toks, 10) == [3, 1, 2, 3]
    pol.record("r", 4, 1)  # one accepted: next time 2
    assert pol.propose("r", toks, 10) == [3, 1]
    pol.record("r", 2, 2)  # all accepted: grows by one
    assert pol.propose("r", toks, 10) == [3, 1, 2]
    pol.record("r", 3, 0)  # one miss after hits: the running mean (1.0 -> 0.75) stays above 0.5
    assert skipped() == 0
    backoff = []
    for _ in range(4):  # misses in a row: skip 1, 2, 4, 8 steps
        pol.record("r", 1, 0)
        backoff.append(skipped())
    assert backoff == [1, 2, 4, 8]
    for _ in range(10):
        pol.record("r", 1, 0)
    assert skipped() == MAX_BACKOFF_STEPS
    pol.record("r", 1, 1)  # a hit: the mean (~0.5) is back up, no skip, the backoff starts over
    assert skipped() == 0 and pol.propose("r", toks, 10) == [3, 1]
    pol.record("r", 2, 0)
    assert skipped() == 1, "0.25: below again, from the first step of the backoff"
    assert pol.propose("r", toks, 1) == [3], "never past the limit the scheduler gives"
    s = pol.stats
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (19, 26, 4)
    assert s.accepted_per_pos[:3] == [3, 1, 0]
    assert pol.enabled_for_batch(4) and not pol.enabled_for_batch(5)


# ----- the scheduler with a fake verifying worker ------------------------------------------------------


def make(num_blocks: int = 64, spec: dict[str, object] | None = None, **kw: object) -> Scheduler:
    fields: dict[str, object] = {"block_size": BS, "max_num_batched_tokens": 32, "max_num_seqs": 8}
    fields["speculative_config"] = spec
    fields.update(kw)
    return Scheduler(EngineConfig(**fields), num_blocks, 512, [EOS])  # type: ignore[arg-type]


def add(sched: Scheduler, rid: str, prompt: list[int], **sp: object) -> Request:
    params: dict[str, object] = {"temperature": 0.0, "max_tokens": 40, "ignore_eos": True}
    params.update(sp)
    req = Request(rid, list(prompt), SamplingParams(**params))  # type: ignore[arg-type]
    sched.add_request(req)
    return req


def periodic(h: Sequence[int]) -> int:
    """A "model" that mostly repeats the last 5 tokens, and breaks the pattern every 11th position."""
    return (h[-1] * 3 + 1) % 50 + 3 if len(h) % 11 == 0 else h[-5]


def step(sched: Scheduler, target: Target = periodic) -> tuple[SchedulerOutput, ModelRunnerOutput]:
    """One step; a worker that samples `target` at every position of a row that reaches its end, and keeps
    the drafts up to the first that differs (the real worker's rule)."""
    so = sched.schedule()
    ids: list[str] = []
    toks: list[list[int]] = []
    for rid, n in so.num_scheduled_tokens.items():
        req = sched.requests[rid]
        drafts = so.scheduled_spec_decode_tokens.get(rid, [])
        ids.append(rid)
        if req.num_computed_tokens + n - len(drafts) < req.num_tokens:
            toks.append([])
            continue
        hist = req.all_token_ids
        sampled = [target(hist + drafts[:j]) for j in range(len(drafts) + 1)]
        toks.append(sampled[: accepted_prefix(drafts, sampled) + 1])
    out = ModelRunnerOutput(ids, toks)
    _, failed = sched.update_from_output(so, out)
    assert not failed
    return so, out


def run(sched: Scheduler, target: Target = periodic, limit: int = 500) -> int:
    steps = 0
    while sched.has_unfinished_requests():
        step(sched, target)
        steps += 1
        assert steps < limit
    return steps


PROMPT = [11, 12, 13, 14, 15, 11, 12, 13, 14, 15, 11, 12]


def test_outputs_with_speculation_equal_plain_decoding_in_fewer_steps() -> None:
    outs, steps = [], []
    specs: list[dict[str, object] | None] = [
        None,
        {"num_speculative_tokens": 4, "disable_by_batch_size": None},
    ]
    for spec in specs:
        sched = make(spec=spec)
        reqs = [add(sched, f"r{i}", [*PROMPT[i:], 20 + i], max_tokens=30 + i) for i in range(3)]
        steps.append(run(sched))
        outs.append([r.output_token_ids for r in reqs])
        stats = sched.stats()
    assert outs[0] == outs[1]
    assert [len(o) for o in outs[1]] == [30, 31, 32]
    assert steps[1] < steps[0] * 0.6, steps
    assert stats["spec_decode_num_accepted_tokens"] > 0.6 * stats["spec_decode_num_draft_tokens"], stats
    assert 1 < stats["spec_decode_mean_acceptance_length"] <= 5


def test_drafts_count_against_the_budget_and_get_kv_slots() -> None:
    sched = make(spec={"num_speculative_tokens": 4})
    req = add(sched, "a", PROMPT)
    step(sched)  # the prefill samples the first token
    so = sched.schedule()
    drafts = so.scheduled_spec_decode_tokens["a"]
    assert drafts == [14, 15, 11, 12] and so.num_scheduled_tokens == {"a": 5}
    assert so.total_num_scheduled_tokens == 5
    assert len(sched.kv.block_ids("a")) * BS >= req.num_computed_tokens + 5
    assert so.scheduled_cached_reqs.num_computed_tokens == [len(PROMPT)]


def test_rejected_drafts_are_not_computed_and_never_reach_the_prefix_cache() -> None:
    sched = make(spec={"num_speculative_tokens": 4})
    req = add(sched, "a", PROMPT)
    step(sched)
    computed = req.num_computed_tokens
    bad = lambda h: 99 if len(h) == len(PROMPT) + 3 else periodic(h)  # noqa: E731  (rejects draft 2)
    so, out = step(sched, bad)
    assert len(so.scheduled_spec_decode_tokens["a"]) == 4 and out.sampled_token_ids == [[14, 15, 99]]
    assert req.num_computed_tokens == computed + 3, "the last token and the two accepted drafts"
    assert req.num_tokens == req.num_computed_tokens + 1
    state = sched.kv.reqs["a"]
    assert state.num_cached * BS <= req.num_computed_tokens
    for i, block in enumerate(state.blocks[: state.num_cached]):
        assert list(block.token_ids) == req.all_token_ids[i * BS : (i + 1) * BS]
    so = sched.schedule()  # the next row starts where the accepted tokens end: it overwrites the slots
    assert so.scheduled_cached_reqs.num_computed_tokens == [computed + 3]


def test_drafts_stop_at_max_tokens_and_at_the_budget() -> None:
    sched = make(spec={"num_speculative_tokens": 4})
    add(sched, "a", PROMPT, max_tokens=3)
    step(sched)
    so, _ = step(sched)
    assert so.scheduled_spec_decode_tokens["a"] == [14], "max_tokens=3: 1 out, so 1 + 1 draft to go"
    assert not sched.has_unfinished_requests()
    sched = make(spec={"num_speculative_tokens": 4, "disable_by_batch_size": None}, max_num_batched_tokens=7)
    add(sched, "a", PROMPT[:7])
    add(sched, "b", [40 + t for t in PROMPT])
    step(sched)  # a's whole prompt
    so = sched.schedule()  # a's 1 + 4 leave b 2 of the 7 tokens
    assert so.num_scheduled_tokens == {"a": 5, "b": 2} and so.total_num_scheduled_tokens == 7
    sched = make(spec={"num_speculative_tokens": 4}, max_num_batched_tokens=3)
    add(sched, "a", PROMPT)
    while not sched.requests["a"].output_token_ids:
        step(sched)
    so = sched.schedule()
    assert so.scheduled_spec_decode_tokens == {"a": [14, 15]} and so.num_scheduled_tokens == {"a": 3}


def test_a_stop_token_among_the_accepted_drafts_ends_the_request_there() -> None:
    sched = make(spec={"num_speculative_tokens": 4})
    req = add(sched, "a", PROMPT, stop_token_ids=[15])
    step(sched)
    assert req.output_token_ids == [13]
    _so, out = step(sched)
    assert out.sampled_token_ids == [[14, 15, 11, 12, 13]], "every draft accepted"
    assert req.output_token_ids == [13, 14, 15] and req.finish_reason == "stop" and req.stop_reason == 15
    assert "a" not in sched.requests


def test_drafts_are_dropped_before_anyone_is_preempted_for_them() -> None:
    # 5 usable blocks: a's 12-token prompt and first token fill 13 of 16 slots after its prefill
    sched = make(num_blocks=5, spec={"num_speculative_tokens": 4, "disable_by_batch_size": None})
    add(sched, "a", PROMPT)
    add(sched, "b", [30, 31, 32, 33, 34])
    step(sched)  # a holds 4 blocks (13 tokens), b 2 (6): 4 + 4 drafts would need a 5th for a
    so = sched.schedule()
    assert not so.preempted_req_ids, "drafts never preempt"
    assert so.num_scheduled_tokens["a"] <= 4 and len(sched.kv.block_ids("a")) == 4


def test_no_drafts_above_disable_by_batch_size_or_for_structured_outputs() -> None:
    sched = make(spec={"num_speculative_tokens": 4, "disable_by_batch_size": 2})
    for i in range(3):
        add(sched, f"r{i}", [*PROMPT, i])
    step(sched)
    so, _ = step(sched)
    assert not so.scheduled_spec_decode_tokens, "3 running > 2"
    sched.finish("r2", "abort")
    so, _ = step(sched)
    assert set(so.scheduled_spec_decode_tokens) == {"r0", "r1"}
    sched = make(spec={"num_speculative_tokens": 4})
    req = add(sched, "g", PROMPT)
    req.structured_output_request = type("Ready", (), {"is_ready": True})()
    step(sched)
    so, _ = step(sched)
    assert not so.scheduled_spec_decode_tokens


def test_a_preempted_request_recomputes_without_drafts_then_speculates_again() -> None:
    sched = make(num_blocks=12, spec={"num_speculative_tokens": 4, "disable_by_batch_size": None})
    a = add(sched, "a", PROMPT, max_tokens=25)
    b = add(sched, "b", [40 + t for t in PROMPT], max_tokens=25)
    preempted, resumed_with_drafts = False, False
    while sched.has_unfinished_requests():
        so, _ = step(sched)
        preempted |= bool(so.preempted_req_ids)
        if preempted and so.scheduled_new_reqs == [] and so.scheduled_spec_decode_tokens:
            resumed_with_drafts = True
    assert preempted and resumed_with_drafts
    plain = make(num_blocks=12)
    a2, b2 = add(plain, "a", PROMPT, max_tokens=25), add(plain, "b", [40 + t for t in PROMPT], max_tokens=25)
    run(plain)
    assert (a.output_token_ids, b.output_token_ids) == (a2.output_token_ids, b2.output_token_ids)


# ----- the worker's batch -------------------------------------------------------------------------------


def test_a_verify_row_is_a_decode_row_per_token_with_logits_at_every_position() -> None:
    b = InputBatch(max_num_tokens=64, max_num_seqs=8, max_blocks_per_seq=16, block_size=BS)
    sp = SamplingParams(temperature=0.0)
    so = SchedulerOutput(0, [NewRequestData("a", [5, 6, 7], sp, [3, 4], 0)], CachedRequestData(), {"a": 3}, 3)
    b.update_states(so)
    b.prepare(so)
    b.append_sampled(["a"], [[8]])
    c = CachedRequestData(["a"], [False], [[]], [[]], [3])
    so = SchedulerOutput(1, [], c, {"a": 4}, 4, scheduled_spec_decode_tokens={"a": [9, 10, 11]})
    b.update_states(so)
    p = b.prepare(so)
    assert p.input_ids.tolist() == [8, 9, 10, 11] and p.positions.tolist() == [3, 4, 5, 6]
    assert p.slot_mapping.tolist() == [15, 16, 17, 18]
    assert p.logits_indices.tolist() == [0, 1, 2, 3] and p.sample_rows == [0] and p.sample_counts == [4]
    # a decode row per token: the same blocks, each row's length ending at its own token
    assert p.num_decodes == 4 and not p.prefills and p.decode_seq_lens.tolist() == [4, 5, 6, 7]
    assert p.decode_block_tables.tolist() == [[3, 0], [3, 4], [3, 4], [3, 4]]
    assert b.requests["a"].token_ids == [5, 6, 7, 8], "drafts are not the request's tokens"
    bad = SchedulerOutput(2, [], c, {"a": 3}, 3, scheduled_spec_decode_tokens={"a": [9, 10, 11]})
    with pytest.raises(ProtocolError, match="3 draft tokens in a row of 3 tokens"):
        b.update_states(bad)
