"""AsyncEngine end to end: greedy equality, prefix caching, preemption, aborts, bad input, dead workers."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from pathlib import Path

import psutil
import pytest

from asyncexec import (
    AsyncEngine,
    EngineConfig,
    EngineOverloadedError,
    ExecutorClosedError,
    InvalidRequestError,
    RequestOutput,
    SamplingParams,
    WorkerDiedError,
)
from asyncexec.config import ExecutorKind
from asyncexec.errors import EngineStepError, RequestFailedError
from asyncexec.executor.multiproc import MultiProcExecutor
from tests.conftest import hf_greedy

GREEDY = SamplingParams(temperature=0.0)


def engine_config(path: Path, kind: ExecutorKind = "uni", ranks: int = 1, **kw: object) -> EngineConfig:
    fields: dict[str, object] = {
        "block_size": 4,
        "max_num_batched_tokens": 48,
        "max_num_seqs": 16,
        "kv_cache_memory_bytes": 4 << 20,
    }
    fields.update(kw)
    return EngineConfig(model=str(path), executor=kind, tensor_parallel_size=ranks, **fields)  # type: ignore[arg-type]


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(256) for _ in range(rng.randrange(1, 60))], rng.randrange(1, 24)) for _ in range(n)
    ]


async def collect(engine: AsyncEngine, prompt: list[int] | str, sp: SamplingParams) -> RequestOutput:
    last = None
    async for out in engine.generate(prompt, sp):
        last = out
    assert last is not None and last.finished
    return last


async def run_all(engine: AsyncEngine, work: list[tuple[list[int], int]]) -> list[list[int]]:
    outs = await asyncio.gather(
        *(collect(engine, p, SamplingParams(temperature=0.0, max_tokens=m)) for p, m in work)
    )
    return [o.token_ids for o in outs]


async def streaming_requests(
    engine: AsyncEngine, prompts: list[list[int]], sp: SamplingParams
) -> list[asyncio.Task[RequestOutput]]:
    """One task per prompt collecting its last output, returned once every request has streamed a token
    (so a fault injected next meets them all running; a fixed sleep let a fast machine finish them first)."""
    streaming = [asyncio.Event() for _ in prompts]

    async def run(i: int) -> RequestOutput:
        last = None
        async for out in engine.generate(prompts[i], sp):
            streaming[i].set()
            last = out
        assert last is not None
        return last

    tasks = [asyncio.ensure_future(run(i)) for i in range(len(prompts))]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in streaming)), 10)
    return tasks


CASES: list[tuple[ExecutorKind, int, str | None]] = [
    ("uni", 1, None),
    ("mp", 1, None),
    ("mp", 2, None),
    ("mp", 2, "127.0.0.1"),  # the TCP path: CURVE, tensors as frames, no shared memory
]


@pytest.mark.parametrize(
    ("kind", "ranks", "host"), CASES, ids=[f"{k}{n}{'-tcp' if h else ''}" for k, n, h in CASES]
)
async def test_32_concurrent_requests_equal_hf_generate(
    tiny_models: dict[str, Path], kind: ExecutorKind, ranks: int, host: str | None
) -> None:
    work = workload(32)
    refs = hf_greedy(tiny_models["llama"], [p for p, _ in work], [m for _, m in work])
    async with AsyncEngine(engine_config(tiny_models["llama"], kind, ranks, distributed_host=host)) as engine:
        got = await run_all(engine, work)
        assert not engine.has_unfinished_requests()
    assert got == refs


async def test_prefix_is_computed_once_and_outputs_are_unchanged(tiny_models: dict[str, Path]) -> None:
    prefix = list(range(10, 42))  # 32 tokens: 8 full blocks of 4
    prompts = [[*prefix, 1, 2, 3], [*prefix, 7, 8]]
    refs = hf_greedy(tiny_models["llama"], prompts, 8)
    async with AsyncEngine(engine_config(tiny_models["llama"])) as engine:
        assert engine.scheduler is not None
        first = await collect(engine, prompts[0], SamplingParams(temperature=0.0, max_tokens=8))
        stats = engine.scheduler.kv.stats
        assert stats.hits == 0
        second = await collect(engine, prompts[1], SamplingParams(temperature=0.0, max_tokens=8))
        assert stats.hits == 32, "the shared 8 blocks must come from the cache"
        assert engine.stats()["prefix_cache_hits"] == 32
        assert stats.queries == len(prompts[0]) + len(prompts[1])
    assert [first.token_ids, second.token_ids] == refs


async def test_preemption_under_a_small_cache_keeps_outputs(tiny_models: dict[str, Path]) -> None:
    work = workload(12, seed=3)
    refs = hf_greedy(tiny_models["llama"], [p for p, _ in work], [m for _, m in work])
    # 2 layers x K,V x 4 tokens x 2 heads x 16 dims x 4 bytes = 2 KiB a block: 40 blocks in all
    cfg = engine_config(tiny_models["llama"], kv_cache_memory_bytes=40 * 2048, enable_prefix_caching=False)
    async with AsyncEngine(cfg) as engine:
        assert engine.scheduler is not None and engine.num_blocks == 40
        got = await run_all(engine, work)
        assert engine.scheduler.num_preemptions > 0
    assert got == refs


async def test_abort_and_cancellation_free_every_block(tiny_models: dict[str, Path]) -> None:
    async with AsyncEngine(engine_config(tiny_models["llama"])) as engine:
        sched = engine.scheduler
        assert sched is not None
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

        async def take(n: int) -> None:
            async for out in engine.generate(list(range(30)), long):
                if len(out.token_ids) >= n:
                    break  # leaving the loop early aborts

        cancelled = asyncio.ensure_future(collect(engine, list(range(40)), long))
        gen = engine.generate(list(range(20)), long)
        await gen.__anext__()
        await take(3)
        await asyncio.sleep(0.05)
        cancelled.cancel()
        await gen.aclose()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        rid = engine.add_request([5, 6, 7], long)
        await engine.step()
        engine.abort(rid)
        for _ in range(5):
            if not sched.has_work():
                break
            await engine.step()
        await asyncio.sleep(0)
        assert not engine.has_unfinished_requests()
        assert sched.kv.pool.num_free == sched.kv.pool.num_usable, "every block is back in the pool"
        stats = engine.stats()
        assert stats["num_free_blocks"] == stats["num_blocks"] and stats["kv_cache_usage"] == 0.0


async def test_invalid_requests_raise_and_the_engine_keeps_serving(tiny_models: dict[str, Path]) -> None:
    cfg = engine_config(tiny_models["llama"], max_model_len=64, max_waiting_requests=3)
    async with AsyncEngine(cfg) as engine:
        cases = [
            ([], "prompt is empty"),
            ("", "prompt is empty"),
            (list(range(64)), "max_model_len"),
            ([1, 2, 10_000], r"token ids must be integers in \[0, 259\)"),
            ([1, -1], "token ids"),
            (3.5, "prompt must be"),
        ]
        for prompt, match in cases:
            with pytest.raises(InvalidRequestError, match=match):
                engine.add_request(prompt)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match="sampling_params"):
            engine.add_request([1], {"temperature": 0})  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match="top_p"):
            engine.add_request([1], SamplingParams(top_p=2.0))
        engine.add_request([1, 2], GREEDY, request_id="dup")
        with pytest.raises(InvalidRequestError, match="'dup' is already in use"):
            engine.add_request([1, 2], GREEDY, request_id="dup")
        engine.add_request([3], GREEDY)
        engine.add_request([4], GREEDY)
        with pytest.raises(EngineOverloadedError, match="max_waiting_requests=3"):
            engine.add_request([5], GREEDY)
        while engine.has_unfinished_requests():
            await engine.step()
        out = await collect(engine, "hello", SamplingParams(temperature=0.0, max_tokens=4))
        assert out.finish_reason in ("stop", "length") and out.text is not None


async def test_step_returns_outputs_and_stops_on_length(tiny_models: dict[str, Path]) -> None:
    async with AsyncEngine(engine_config(tiny_models["llama"])) as engine:
        rid = engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        seen: list[RequestOutput] = []
        while engine.has_unfinished_requests():
            seen += await engine.step()
        assert [o.request_id for o in seen] == [rid] * 3
        assert [len(o.new_token_ids) for o in seen] == [1, 1, 1]
        assert seen[-1].finished and seen[-1].finish_reason == "length" and len(seen[-1].token_ids) == 3


async def test_direct_steps_and_the_background_loop_are_serialized(tiny_models: dict[str, Path]) -> None:
    work = workload(6, seed=5)
    refs = hf_greedy(tiny_models["llama"], [p for p, _ in work], [m for _, m in work])
    async with AsyncEngine(engine_config(tiny_models["llama"])) as engine:
        streams = asyncio.ensure_future(run_all(engine, work))
        for _ in range(20):
            await engine.step()
        assert await streams == refs


async def test_dead_worker_reaches_every_generate_caller(tiny_models: dict[str, Path]) -> None:
    async with AsyncEngine(engine_config(tiny_models["llama"], "mp", 2)) as engine:
        long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        infos = await engine.collective_rpc("get_model_info")
        assert infos == [engine.model_info] * 2, "both ranks serve the same model"
        assert isinstance(engine.executor, MultiProcExecutor)
        pids = engine.executor.worker_pids
        children = {p.pid for p in psutil.Process().children()}
        assert len(set(pids)) == 2 and set(pids) <= children, "two worker processes of ours, by rank"
        tasks = await streaming_requests(engine, [list(range(i + 5)) for i in range(4)], long)
        victim = pids[1]
        start = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert time.monotonic() - start < 1.0
        assert all(isinstance(r, WorkerDiedError) and r.rank == 1 for r in results), results
        with pytest.raises(ExecutorClosedError):
            engine.add_request([1, 2])


async def test_two_engines_share_a_loop(tiny_models: dict[str, Path]) -> None:
    a = AsyncEngine(engine_config(tiny_models["llama"]))
    b = AsyncEngine(engine_config(tiny_models["qwen2"]))
    async with a, b:
        ra, rb = await asyncio.gather(collect(a, [1, 2, 3], GREEDY), collect(b, [1, 2, 3], GREEDY))
    assert ra.token_ids == hf_greedy(tiny_models["llama"], [[1, 2, 3]], 16)[0]
    assert rb.token_ids == hf_greedy(tiny_models["qwen2"], [[1, 2, 3]], 16)[0]


async def test_stop_tokens_and_logprobs(tiny_models: dict[str, Path]) -> None:
    async with AsyncEngine(engine_config(tiny_models["llama"])) as engine:
        free_run = await collect(
            engine, [9, 8, 7], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        )
        stop = free_run.token_ids[3]
        first = free_run.token_ids.index(stop)
        sp = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop], logprobs=2, ignore_eos=True)
        out = await collect(engine, [9, 8, 7], sp)
    assert out.finish_reason == "stop" and out.token_ids == free_run.token_ids[: first + 1]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert tok in lp and len(lp) <= 3 and max(lp.values()) == lp[tok], (
            "greedy: the sampled token is the top one"
        )


@pytest.mark.parametrize("method", ["schedule", "update_from_output"])
async def test_a_step_failing_outside_the_workers_reaches_every_caller(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    async with AsyncEngine(engine_config(tiny_models["llama"])) as engine:
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        tasks = await streaming_requests(engine, [list(range(i + 3)) for i in range(4)], long)

        def broken(*args: object) -> None:
            raise RuntimeError(f"{method} broke")

        assert engine.scheduler is not None
        monkeypatch.setattr(engine.scheduler, method, broken)
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        assert all(isinstance(r, EngineStepError) and isinstance(r.__cause__, RuntimeError) for r in results)
        assert not engine.is_healthy
        with pytest.raises(ExecutorClosedError, match=f"engine has failed: .*RuntimeError: {method} broke"):
            engine.add_request([1, 2])
        monkeypatch.undo()
        stats = engine.scheduler.stats()
        assert stats["num_free_blocks"] == stats["num_blocks"] and not engine.has_unfinished_requests()
        assert (
            engine.metrics.registry.get_sample_value(
                "asyncexec_requests_finished_total", {"finish_reason": "error"}
            )
            == 4
        )


@pytest.mark.parametrize(("kind", "ranks"), [("uni", 1), ("mp", 1), ("mp", 2)], ids=["uni1", "mp1", "mp2"])
async def test_a_step_the_ranks_fail_fails_its_requests_and_the_engine_serves_on(
    tiny_models: dict[str, Path], kind: ExecutorKind, ranks: int
) -> None:
    bad_id = "boom"
    work = workload(4, seed=3)
    cfg = engine_config(
        tiny_models["llama"], kind, ranks, worker_extension="tests.extensions:FailingStepExtension"
    )
    async with AsyncEngine(cfg) as engine:
        refs = await run_all(engine, work)
        sp = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        streaming = asyncio.Event()

        async def innocent() -> RequestOutput | BaseException:
            try:
                async for out in engine.generate([3, 1, 4, 1, 5], sp, request_id="innocent"):
                    streaming.set()
                    if out.finished:
                        return out
            except RequestFailedError as e:
                return e
            raise AssertionError("the stream ended without a finished output")

        first = asyncio.ensure_future(innocent())
        await asyncio.wait_for(streaming.wait(), 10)
        with pytest.raises(
            RequestFailedError, match=f"request '{bad_id}' failed: .*kernel failed on {bad_id}"
        ):
            await asyncio.wait_for(engine.generate([2, 7, 1, 8], sp, request_id=bad_id).__anext__(), 10)
        # the innocent request ran in the same step: it fails with it, with the rank's own error
        failed = await asyncio.wait_for(first, 10)
        assert isinstance(failed, RequestFailedError) and "RuntimeError: kernel failed" in str(failed), failed
        assert engine.is_healthy, "a rank's error fails the step's requests, not the engine"
        assert await asyncio.wait_for(run_all(engine, work), 60) == refs, "the ranks' state stays sound"
        stats = engine.stats()
        assert stats["num_free_blocks"] == stats["num_blocks"] and not engine.has_unfinished_requests()
        errors = engine.metrics.registry.get_sample_value(
            "asyncexec_requests_finished_total", {"finish_reason": "error"}
        )
        assert errors == 2


async def test_a_request_whose_detokenizer_fails_fails_alone(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    work = workload(5, seed=7)
    async with AsyncEngine(engine_config(tiny_models["llama"])) as engine:
        refs = await run_all(engine, work)  # the same prompts, undisturbed
        sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        bad = engine.generate([5, 6, 7], sp, request_id="bad")
        await bad.__anext__()  # its detokenizer exists now

        def update(token_ids: list[int], *flags: bool) -> None:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

        monkeypatch.setattr(engine._outputs._detok["bad"], "update", update)
        others = asyncio.ensure_future(run_all(engine, work))
        with pytest.raises(RequestFailedError, match="request 'bad' failed: UnicodeDecodeError") as info:
            await asyncio.wait_for(bad.__anext__(), 10)
        assert isinstance(info.value.__cause__, UnicodeDecodeError)
        assert await asyncio.wait_for(others, 60) == refs, "the others complete as if nothing happened"
        assert engine.is_healthy and not engine.has_unfinished_requests()
        stats = engine.stats()
        assert stats["num_free_blocks"] == stats["num_blocks"], "the failed request's blocks are back"
        assert (
            engine.metrics.registry.get_sample_value(
                "asyncexec_requests_finished_total", {"finish_reason": "error"}
            )
            == 1
        )
        assert (await collect(engine, [5, 6, 7], sp)).finish_reason == "length", "and it keeps serving"
