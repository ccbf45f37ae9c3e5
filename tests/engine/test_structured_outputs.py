"""Structured outputs on a tiny model (a byte-level tokenizer: one token per byte): the mask, the matcher's
advance, the grammar's end, batch sharing, preemption and restart consistency, and bad input."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from pathlib import Path
from typing import Any

import llguidance
import pytest
import torch

from asyncexec import AsyncEngine, InvalidRequestError, RequestOutput, SamplingParams
from asyncexec.sampling_params import GuidedDecodingParams, StructuredOutputsParams
from asyncexec.worker.logits_processors import apply_grammar_bitmask
from tests.engine.test_engine import collect, engine_config
from tests.engine.test_self_healing import wait_for, worker_pids

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "s": {"type": "string", "pattern": "^[a-z]{0,3}$"},
        "b": {"type": "boolean"},
    },
    "required": ["n", "s", "b"],
    "additionalProperties": False,  # else the random model may go on adding keys until max_tokens
}
REGEX = r"[a-c]{2}-[0-9]{2}"
CHOICES = ["red", "green", "blue"]


def sp(temperature: float = 1.0, seed: int | None = None, max_tokens: int = 60, **so: Any) -> SamplingParams:
    return SamplingParams(
        temperature=temperature,
        seed=seed,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(**so),
    )


def test_the_bitmask_forbids_exactly_the_unset_bits_of_each_row() -> None:
    logits = torch.randn(3, 70)
    before = logits.clone()
    mask = torch.zeros(2, 3, dtype=torch.int32)  # 96 bits: wider than the 70 logits
    mask[0, 0] = 0b1010  # row 0: tokens 1 and 3
    mask[1, 1] = -(2**31)  # row 1: token 63 (the sign bit of word 1)
    apply_grammar_bitmask(logits, mask, [(2, 0), (0, 1)])
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [1, 3]
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [63]
    assert torch.equal(logits[1], before[1])  # an unconstrained row is untouched
    assert torch.equal(logits[2, [1, 3]], before[2, [1, 3]])


def test_params_take_exactly_one_constraint_and_name_what_is_wrong() -> None:
    with pytest.raises(InvalidRequestError, match="exactly one of") as e:
        StructuredOutputsParams(json=SCHEMA, regex="a")
    assert e.value.param == "structured_outputs"
    with pytest.raises(InvalidRequestError, match="choice must be a non-empty list") as e:
        StructuredOutputsParams(choice=[])
    assert e.value.param == "choice"
    with pytest.raises(InvalidRequestError, match="json: the schema is not valid JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(InvalidRequestError, match="structural_tag is not supported"):
        StructuredOutputsParams(structural_tag="{}")
    with pytest.raises(InvalidRequestError, match="whitespace_pattern applies to json"):
        StructuredOutputsParams(regex="a", whitespace_pattern=" ")
    p = GuidedDecodingParams(regex="a+")
    assert SamplingParams(guided_decoding=p).structured_outputs == p  # the older name is an alias
    assert SamplingParams(structured_outputs=p).guided_decoding == p


async def test_json_regex_and_choice_answers_always_conform(tiny_models: dict[str, Path]) -> None:
    async with AsyncEngine(engine_config(tiny_models["llama"])) as engine:
        outs = await asyncio.gather(
            *(collect(engine, [5, 6, 7, i], sp(seed=i, json=SCHEMA)) for i in range(6)),
            *(collect(engine, [8, 9, i], sp(seed=i, regex=REGEX)) for i in range(6)),
            *(collect(engine, [10, i], sp(seed=i, choice=CHOICES)) for i in range(6)),
            collect(engine, [11], sp(json_object=True, seed=1, max_tokens=200)),
            collect(engine, [12], sp(grammar='start: "x" DIGIT+ "y"\n%import common.DIGIT', seed=1)),
        )
    for o in outs[:6]:
        assert o.finish_reason == "stop", o
        value = json.loads(o.text or "")
        assert set(value) == {"n", "s", "b"} and 0 <= value["n"] <= 999 and len(value["s"]) <= 3
    assert all(re.fullmatch(REGEX, o.text or "") and o.finish_reason == "stop" for o in outs[6:12])
    assert all(o.text in CHOICES for o in outs[12:18])
    assert isinstance(json.loads(outs[18].text or ""), dict) or outs[18].finish_reason == "length"
    assert re.fullmatch(r"x[0-9]+y", outs[19].text or ""), outs[19].text


async def test_the_request_ends_when_its_grammar_is_complete_not_at_max_tokens(
    tiny_models: dict[str, Path],
) -> None:
    async with AsyncEngine(engine_config(tiny_models["llama"])) as engine:
        out = await collect(engine, [1, 2, 3], sp(temperature=0.0, max_tokens=50, regex="abc"))
        free = await collect(
            engine, [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
        )
    assert out.text == "abc" and out.finish_reason == "stop" and len(out.token_ids) == 3
    assert len(free.token_ids) == 50  # unconstrained, the same prompt runs to max_tokens


async def test_each_step_masks_with_the_matcher_advanced_by_the_tokens_sampled(
    tiny_models: dict[str, Path],
) -> None:
    """Every step's mask row equals a fresh matcher's after the request's tokens so far."""
    async with AsyncEngine(engine_config(tiny_models["llama"])) as engine:
        assert engine.scheduler is not None and engine.executor is not None
        masks: list[tuple[list[int], torch.Tensor]] = []
        execute = engine.executor.execute_model

        async def recording(so: Any) -> Any:
            if so.grammar_bitmask is not None:
                req = engine.scheduler.requests[so.structured_output_request_ids[0]]  # type: ignore[union-attr]
                masks.append((list(req.output_token_ids), so.grammar_bitmask.clone()))
            return await execute(so)

        engine.executor.execute_model = recording  # type: ignore[method-assign,assignment]
        out = await collect(engine, [4, 5], sp(seed=3, regex=REGEX))
        tok = llguidance.hf.from_tokenizer(engine.tokenizer, n_vocab=engine.model_info["vocab_size"])
    assert [m[0] for m in masks] == [out.token_ids[:i] for i in range(len(out.token_ids))]
    for toks, mask in masks:
        fresh = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_regex(REGEX))
        assert fresh.consume_tokens(toks)
        want = torch.frombuffer(bytearray(fresh.compute_bitmask()), dtype=torch.int32)
        assert torch.equal(mask[0], want[: mask.shape[1]]), toks


async def test_an_unconstrained_request_sharing_the_batch_is_unchanged(tiny_models: dict[str, Path]) -> None:
    plain = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    async with AsyncEngine(engine_config(tiny_models["llama"])) as engine:
        alone = await collect(engine, [3, 1, 4, 1, 5], plain)
        steps: list[int] = []
        assert engine.scheduler is not None
        schedule = engine.scheduler.schedule

        def recording() -> Any:
            so = schedule()
            steps.append(len(so.num_scheduled_tokens))
            return so

        engine.scheduler.schedule = recording  # type: ignore[method-assign]
        shared, *constrained = await asyncio.gather(
            collect(engine, [3, 1, 4, 1, 5], plain),
            *(collect(engine, [9, i], sp(seed=i, json=SCHEMA)) for i in range(3)),
        )
    assert max(steps) == 4  # all four ran in one batch
    assert shared.token_ids == alone.token_ids
    assert all(json.loads(o.text or "") for o in constrained)


async def test_preemption_keeps_each_matcher_in_step_with_the_kept_tokens(
    tiny_models: dict[str, Path],
) -> None:
    """A cache too small for all of them preempts and recomputes; greedy answers equal the roomy run's."""
    prompts = [[(13 * i + j) % 200 for j in range(12)] for i in range(6)]
    params = sp(temperature=0.0, max_tokens=40, json=SCHEMA)
    async with AsyncEngine(engine_config(tiny_models["llama"])) as engine:
        refs = [await collect(engine, p, params) for p in prompts]
    tight = engine_config(tiny_models["llama"], kv_cache_memory_bytes=60 << 10, max_num_seqs=6)
    async with AsyncEngine(tight) as engine:
        outs = await asyncio.gather(*(collect(engine, p, params) for p in prompts))
        assert engine.scheduler is not None and engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    assert all(json.loads(o.text or "") for o in outs)


async def test_a_matcher_is_rebuilt_when_tokens_it_accepted_were_dropped(
    tiny_models: dict[str, Path],
) -> None:
    """`sync` rolls the matcher back to the kept tokens: the mask after a drop is the fresh one's."""
    async with AsyncEngine(engine_config(tiny_models["llama"])) as engine:
        assert engine._structured is not None
        rid = engine.add_request([1, 2], sp(temperature=0.0, regex="abcdef"))
        req = engine.scheduler.requests[rid]  # type: ignore[union-attr]
        while len(req.output_token_ids) < 4:
            await engine.step()
        sor = req.structured_output_request
        assert sor.num_accepted == 4 and engine.tokenizer.decode(req.output_token_ids) == "abcd"
        del req.output_token_ids[2:]  # as if the last two were never kept
        sor.sync(req.output_token_ids)
        assert sor.num_accepted == 2 and bytes(sor.matcher.compute_ff_bytes()) == b"cdef"
        engine.abort(rid)


async def test_a_restart_of_the_workers_keeps_constrained_outputs_equal(tiny_models: dict[str, Path]) -> None:
    cfg = engine_config(tiny_models["llama"], "mp", 2, restart_on_worker_failure=True)
    params = [sp(temperature=0.0, max_tokens=50, json=SCHEMA, disable_any_whitespace=False)] * 4
    prompts = [[20 + i, 7, 7] for i in range(4)]
    async with AsyncEngine(cfg) as engine:
        refs = [await collect(engine, p, s) for p, s in zip(prompts, params, strict=True)]
        seen = [0]

        async def run(p: list[int], s: SamplingParams) -> RequestOutput:
            last = None
            async for out in engine.generate(p, s):
                seen[0] += len(out.new_token_ids)
                last = out
            assert last is not None
            return last

        tasks = [asyncio.ensure_future(run(p, s)) for p, s in zip(prompts, params, strict=True)]
        await wait_for(lambda: seen[0] >= 12)
        os.kill(worker_pids(engine)[1], signal.SIGKILL)
        outs = await asyncio.gather(*tasks)
        assert engine.num_restarts == 1
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]


async def test_ranks_agree_on_constrained_tokens_and_equal_the_uni_run(tiny_models: dict[str, Path]) -> None:
    """mp x2 with `check_rank_agreement`: every rank masks with the same bitmask and samples the same."""
    reqs = [([30 + i, 4], sp(seed=i, json=SCHEMA)) for i in range(4)]
    reqs += [([40 + i], sp(seed=i, regex=REGEX)) for i in range(3)]
    reqs += [([50], sp(temperature=0.0, choice=CHOICES)), ([51], sp(temperature=0.0, json=SCHEMA))]
    runs = []
    for cfg in (
        engine_config(tiny_models["llama"]),
        engine_config(tiny_models["llama"], "mp", 2, check_rank_agreement=True),
    ):
        async with AsyncEngine(cfg) as engine:
            runs.append(await asyncio.gather(*(collect(engine, p, s) for p, s in reqs)))
    uni, mp = runs
    assert [o.token_ids for o in mp] == [o.token_ids for o in uni]
    assert all(json.loads(o.text or "") for o in mp[:4]) and mp[7].text in CHOICES


async def test_a_grammar_that_does_not_compile_fails_only_its_request(tiny_models: dict[str, Path]) -> None:
    async with AsyncEngine(engine_config(tiny_models["llama"])) as engine:
        good = asyncio.ensure_future(collect(engine, [1, 2], sp(seed=1, regex=REGEX)))
        plain = asyncio.ensure_future(collect(engine, [1, 2], SamplingParams(max_tokens=8)))
        cases: list[tuple[dict[str, Any], str]] = [
            (dict(regex="(ab"), "regex"),
            (dict(json={"type": "object", "properties": {"a": {"type": "nope"}}}), "json"),
            (dict(grammar="start: undefined_rule"), "grammar"),
            (dict(regex=r"[^\s\S]"), "regex"),  # compiles, and no text matches it
            (dict(json={"$ref": "#"}), "json"),  # a schema that is only itself
        ]
        for bad, field in cases:
            with pytest.raises(InvalidRequestError, match=f"^{field}: cannot be compiled") as e:
                await collect(engine, [1, 2], sp(**bad))
            assert e.value.param == field
            assert "\n" not in str(e.value) and len(str(e.value)) < 120, e.value  # no llguidance dump
        assert re.fullmatch(REGEX, (await good).text or "") and (await plain).finished
        assert engine.is_healthy
        again = await collect(engine, [3], sp(seed=2, choice=CHOICES))
    assert again.text in CHOICES


async def test_a_choice_of_5000_strings_answers_one_of_them(tiny_models: dict[str, Path]) -> None:
    """As alternatives of one rule, 5,000 choices overflowed llguidance's Earley row (2,000 items) after
    the first token; as one lexeme they work, like a JSON schema's enum."""
    choices = [f"option {i}" for i in range(5000)]  # "option 1" begins ten others
    async with AsyncEngine(engine_config(tiny_models["llama"])) as engine:
        outs = await asyncio.gather(*(collect(engine, [7, i], sp(seed=i, choice=choices)) for i in range(4)))
    assert all(o.text in choices and o.finish_reason == "stop" for o in outs), outs


async def test_a_model_folder_without_a_tokenizer_refuses_structured_outputs(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in tiny_models["llama"].iterdir():
        if not f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            os.symlink(f, bare / f.name)
    async with AsyncEngine(engine_config(bare)) as engine:
        assert engine.tokenizer is None
        with pytest.raises(InvalidRequestError, match="needs a tokenizer"):
            await collect(engine, [1, 2], sp(regex="a"))
        assert (await collect(engine, [1, 2], SamplingParams(max_tokens=2))).finished
