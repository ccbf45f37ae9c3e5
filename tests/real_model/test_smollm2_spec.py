"""Speculative decoding (n-gram) on the real model: greedy output identical with and without it (float32,
uni and mp, chunked prefill and preemption in the mix), the sampling features unchanged, its metrics, and a
statistical test that sampling with it keeps the target distribution (and fails on a broken rule)."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest

from asyncexec import AsyncEngine, EngineConfig, SamplingParams
from asyncexec.config import ExecutorKind
from asyncexec.spec_decode import SpeculativeConfig
from asyncexec.spec_decode.ngram import NgramProposer
from asyncexec.spec_decode.policy import SpecDecodePolicy

PASSAGE = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named "
    "after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889. "
    "Locally nicknamed La dame de fer, it was constructed as the centrepiece of the 1889 World's Fair."
)
CODE = (
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
    "    return a * b\n\n\ndef div(a, b):\n"
)
GROUNDED = [
    f"Repeat the following passage exactly.\n\n{PASSAGE}\n\nThe passage, repeated:\n",
    f"{PASSAGE}\n\nQuestion: who designed and built the tower, and when? Quote the passage.\nAnswer:",
    CODE,
]
OPEN = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are three good reasons to learn a second language?",
    "The capital of France is",
]
SPEC: dict[str, Any] = {"num_speculative_tokens": 4, "disable_by_batch_size": None}
SPEC_CONFIG = SpeculativeConfig.from_value(SPEC)


def config(kind: ExecutorKind = "uni", **kw: Any) -> EngineConfig:
    fields: dict[str, Any] = {
        "dtype": "float32",
        "max_model_len": 512,
        "max_num_batched_tokens": 64,  # prompts are chunked, and mixed with decodes and verify rows
        "kv_cache_memory_bytes": 12 << 20,  # ~270 tokens of float32 KV: six requests at once preempt
    }
    fields.update(kw)
    return EngineConfig(model="smollm2", executor=kind, **fields)


async def final(engine: AsyncEngine, prompt: str, sp: SamplingParams) -> Any:
    last = {o.index: o async for o in engine.generate(prompt, sp)}  # each copy's last output
    assert len(last) == sp.n and all(o.finished for o in last.values())
    return [last[i] for i in range(sp.n)] if sp.n > 1 else last[0]


async def run_all(
    cfg: EngineConfig, requests: list[tuple[str, SamplingParams]]
) -> tuple[list[Any], dict[str, Any]]:
    async with AsyncEngine(cfg) as engine:
        outs = await asyncio.gather(*(final(engine, p, sp) for p, sp in requests))
        before = (await engine.collective_rpc("get_runner_stats"))[0]
        lone = await final(engine, GROUNDED[0], SamplingParams(temperature=0.0, max_tokens=48))
        after = (await engine.collective_rpc("get_runner_stats"))[0]
        stats: dict[str, Any] = dict(engine.stats())
        stats["lone"] = lone.token_ids
        # a lone stream's steps after its prefill, verify steps included, all replay the decode graphs
        stats["lone_steps"] = (after["steps"] - before["steps"], after["graph_steps"] - before["graph_steps"])
        stats["metrics"] = engine.metrics.render().decode()
        stats["runner"] = (await engine.collective_rpc("get_runner_stats"))[0]
    return outs, stats


@pytest.mark.parametrize("kind", ["uni", "mp"])
async def test_greedy_output_is_identical_with_and_without_speculation(kind: ExecutorKind) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    requests = [(p, greedy) for p in GROUNDED + OPEN]
    plain, plain_stats = await run_all(config(kind), requests)
    spec, stats = await run_all(config(kind, speculative_config=SPEC), requests)
    for (prompt, _), a, b in zip(requests, plain, spec, strict=True):
        assert b.token_ids == a.token_ids, f"{prompt[:40]!r}: {b.text!r} != {a.text!r}"
    assert stats["num_preemptions"] > 0 and plain_stats["num_preemptions"] > 0
    assert stats["lone"] == plain_stats["lone"]
    steps, graph_steps = stats["lone_steps"]
    assert graph_steps >= steps - 2 and steps < 40, stats["lone_steps"]  # 1-2 prefill chunks, then graphs
    assert stats["spec_decode_num_accepted_tokens"] >= 60, stats
    assert stats["spec_decode_mean_acceptance_length"] > 1.5, stats
    m = stats["metrics"]
    for name in ("num_drafts_total", "num_draft_tokens_total", "num_accepted_tokens_total"):
        assert f"asyncexec_spec_decode_{name} {float(stats['spec_decode_' + name[: -len('_total')]])}" in m
    assert 'asyncexec_spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in m
    assert "asyncexec_spec_decode_acceptance_rate" in m and "spec_decode" not in plain_stats["metrics"]


async def test_sampling_features_behave_as_without_speculation(smollm2_tokenizer: Any) -> None:
    """Seeded sampling, stop strings, stop tokens, min_tokens, penalties, logprobs and n > 1: the same
    tokens, text, finish and logprobs with speculation as without (a seeded draw is the same draw)."""
    grounded = GROUNDED[0]
    (period,) = smollm2_tokenizer.encode(".")
    requests = [
        (grounded, SamplingParams(temperature=0.8, seed=1, max_tokens=40)),
        (grounded, SamplingParams(temperature=0.0, max_tokens=100, stop=["World's Fair"])),
        (
            grounded,
            SamplingParams(temperature=0.0, max_tokens=60, stop=["Paris"], include_stop_str_in_output=True),
        ),
        (grounded, SamplingParams(temperature=0.0, max_tokens=60, stop_token_ids=[period])),
        (grounded, SamplingParams(temperature=0.0, max_tokens=30, min_tokens=25, stop=["."])),
        (grounded, SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.3, logprobs=3)),
        (
            grounded,
            SamplingParams(temperature=0.0, max_tokens=40, frequency_penalty=0.5, presence_penalty=0.3),
        ),
        (grounded, SamplingParams(temperature=0.7, seed=5, max_tokens=30, n=2, logprobs=1)),
        (CODE, SamplingParams(temperature=0.0, max_tokens=40, logprobs=2)),
    ]
    plain, _ = await run_all(config(), requests)
    spec, stats = await run_all(config(speculative_config=SPEC), requests)
    assert stats["spec_decode_num_accepted_tokens"] >= 30, stats
    for (_, sp), a, b in zip(requests, plain, spec, strict=True):
        for x, y in zip(a if sp.n > 1 else [a], b if sp.n > 1 else [b], strict=True):
            assert (y.token_ids, y.text, y.finish_reason, y.stop_reason) == (
                x.token_ids,
                x.text,
                x.finish_reason,
                x.stop_reason,
            ), sp
            if sp.logprobs is not None:
                assert [list(d) for d in y.logprobs] == [list(d) for d in x.logprobs]
                for dx, dy in zip(x.logprobs, y.logprobs, strict=True):
                    assert max(abs(dx[t] - dy[t]) for t in dx) < 1e-3
                assert y.cumulative_logprob == pytest.approx(x.cumulative_logprob, abs=1e-2)
    assert plain[1].finish_reason == "stop" and plain[1].stop_reason == "World's Fair"
    assert plain[3].finish_reason == "stop" and plain[3].stop_reason == period, plain[3].text
    assert len(plain[4].token_ids) >= 25


def _marginal(outs: list[tuple[int, ...]], pos: int, top: list[int]) -> Counter[int]:
    """Frequencies of the token at `pos`: each of `top`, and -1 for any other."""
    return Counter(o[pos] if o[pos] in top else -1 for o in outs)


def _tv(a: Counter[int], b: Counter[int]) -> float:
    na, nb = sum(a.values()), sum(b.values())
    return 0.5 * sum(abs(a[k] / na - b[k] / nb) for k in set(a) | set(b))


def _distance(plain: list[tuple[int, ...]], other: list[tuple[int, ...]]) -> float:
    """The largest total-variation distance between the two samples' distributions of token 1, 2 or 3
    (each over plain sampling's 8 most frequent tokens there, and "any other")."""
    dists = []
    for pos in range(3):
        top = [t for t, _ in Counter(o[pos] for o in plain).most_common(8)]
        dists.append(_tv(_marginal(plain, pos, top), _marginal(other, pos, top)))
    return max(dists)


def _draft_rate(prompt: list[int], outs: list[tuple[int, ...]]) -> tuple[float, int]:
    """How often token 2 equals the draft the n-gram lookup proposes after the prompt and token 1, over
    the samples that get one; and how many do."""
    proposer = NgramProposer(SPEC_CONFIG.prompt_lookup_min, SPEC_CONFIG.prompt_lookup_max)
    drafts = [(o, proposer.propose([*prompt, o[0]], 1)) for o in outs]
    hits = [o[1] == d[0] for o, d in drafts if d]
    return sum(hits) / len(hits), len(hits)


async def test_sampling_with_speculation_keeps_the_target_distribution(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """1,500 unseeded samples of a prompt whose drafts are proposed from the second token on (accepted
    about a quarter of the time). With speculation: the distributions of tokens 1, 2 and 3 are each within
    a total-variation distance of 0.08 of plain sampling's, and the rate at which token 2 equals its draft
    is within 0.07 of plain sampling's (about 3.5 standard deviations of its ~500 drafted samples). With a
    broken rule (every draft accepted) the rate is far off."""
    prompt = "one two three four five one two three four five one two three four five one two"
    sp = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    n = 1500
    cfg = EngineConfig(
        model="smollm2", max_num_seqs=64, max_waiting_requests=n, speculative_config=SPEC_CONFIG
    )
    async with AsyncEngine(cfg) as engine:
        sched = engine.scheduler
        assert sched is not None and sched.spec is not None

        async def sample(speculate: bool) -> list[tuple[int, ...]]:
            sched.spec = SpecDecodePolicy(SPEC_CONFIG) if speculate else None
            outs = await asyncio.gather(*(final(engine, prompt, sp) for _ in range(n)))
            ids.extend(outs[0].prompt_token_ids)
            return [tuple(o.token_ids[:3]) for o in outs]

        ids: list[int] = []

        plain = await sample(False)
        spec = await sample(True)
        drafted = sched.spec.stats
        broken_rule = lambda drafts, sampled: [*drafts, sampled[len(drafts)]]  # noqa: E731  (no check)
        monkeypatch.setattr("asyncexec.worker.model_runner.accepted_tokens", broken_rule)
        broken = await sample(True)
    assert drafted.num_drafts >= n * 0.3 and drafted.num_draft_tokens >= n * 0.6, drafted
    assert 0.1 < drafted.acceptance_rate < 0.9, "the test needs drafts that are rejected some of the time"
    prompt_ids = ids[: len(ids) // 3]
    assert _distance(plain, spec) < 0.08, _distance(plain, spec)
    (rate, drafted_samples), (spec_rate, _), (broken_rate, _) = (
        _draft_rate(prompt_ids, o) for o in (plain, spec, broken)
    )
    assert drafted_samples >= n * 0.2
    assert abs(spec_rate - rate) < 0.07, (spec_rate, rate)
    assert broken_rate > rate + 0.3, (broken_rate, rate)
