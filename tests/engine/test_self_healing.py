"""Self-healing: a dead worker costs latency, never a request, until the restart budget is spent."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from asyncexec import AsyncEngine, ExecutorClosedError, SamplingParams, WorkerDiedError
from asyncexec.executor.multiproc import MultiProcExecutor
from asyncexec.ipc.shm import SHM_DIR
from tests.engine.test_engine import engine_config, run_all

WORK = [([(7 * i + j) % 256 for j in range(3 + 2 * i)], 24 + i) for i in range(16)]


def worker_pids(engine: AsyncEngine) -> list[int]:
    assert isinstance(engine.executor, MultiProcExecutor)
    return engine.executor.worker_pids


async def stream(engine: AsyncEngine, prompt: list[int], max_tokens: int, seen: list[int]) -> list[int]:
    """The streamed new tokens, checked against each output's running total."""
    streamed: list[int] = []
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    async for out in engine.generate(prompt, sp):
        streamed += out.new_token_ids
        assert streamed == out.token_ids  # nothing repeated or skipped across the restart
        seen[0] += len(out.new_token_ids)
    return streamed


async def wait_for(cond: object, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


SPEC = {"prompt_lookup_min": 1, "disable_by_batch_size": None}


@pytest.mark.parametrize("spec", [None, SPEC], ids=["plain", "speculative"])
async def test_killing_rank_1_mid_stream_heals_with_equal_outputs(
    tiny_models: dict[str, Path], spec: dict[str, object] | None
) -> None:
    """With speculative decoding too: the restart recomputes each request's tokens, accepted drafts
    included, and it speculates again from there."""
    cfg = engine_config(
        tiny_models["llama"], "mp", 2, restart_on_worker_failure=True, speculative_config=spec
    )
    async with AsyncEngine(cfg) as engine:
        refs = await run_all(engine, WORK)  # the uninterrupted run
        seen = [0]
        tasks = [asyncio.ensure_future(stream(engine, p, m, seen)) for p, m in WORK]
        await wait_for(lambda: seen[0] >= 40)
        old = worker_pids(engine)
        spares = [p.pid for p in engine._supervisor._spares._procs]  # type: ignore[union-attr]
        assert len(spares) == 2  # one per rank, waiting with the model's code imported
        os.kill(old[1], signal.SIGKILL)
        outs = await asyncio.gather(*tasks)  # no stream sees an error, only a gap
        assert outs == refs
        assert engine.num_restarts == 1
        assert engine.metrics.registry.get_sample_value("asyncexec_worker_restarts_total") == 1
        assert engine.is_healthy and worker_pids(engine) == spares  # the restart took the spares
        stats = engine.stats()
        assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_restarts"] == 1
        assert await run_all(engine, WORK[:4]) == refs[:4]  # and it keeps serving
        if spec is not None:
            assert stats["spec_decode_num_accepted_tokens"] > 0, stats


async def test_an_exhausted_restart_budget_fails_every_caller(tiny_models: dict[str, Path]) -> None:
    cfg = engine_config(tiny_models["llama"], "mp", 2, restart_on_worker_failure=True, max_worker_restarts=1)
    async with AsyncEngine(cfg) as engine:
        seen = [0]
        long = [(p, 400) for p, _ in WORK[:6]]
        tasks = [asyncio.ensure_future(stream(engine, p, m, seen)) for p, m in long]
        await wait_for(lambda: seen[0] >= 12)
        os.kill(worker_pids(engine)[1], signal.SIGKILL)
        await wait_for(lambda: engine.num_restarts == 1)
        before = seen[0]
        await wait_for(lambda: seen[0] >= before + 12)  # healed once
        os.kill(worker_pids(engine)[0], signal.SIGKILL)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, WorkerDiedError) and r.rank == 0 for r in results), results
        assert engine.num_restarts == 1 and not engine.is_healthy
        with pytest.raises(ExecutorClosedError):
            engine.add_request([1, 2])


async def test_a_worker_dying_during_restart_counts_and_never_loops(
    tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "die"
    monkeypatch.setenv("ASYNCEXEC_TEST_DIE_ON_LOAD", str(marker))
    cfg = engine_config(
        tiny_models["llama"],
        "mp",
        2,
        restart_on_worker_failure=True,
        max_worker_restarts=2,
        worker_extension="tests.extensions:DieOnLoadExtension",
    )
    async with AsyncEngine(cfg) as engine:
        seen = [0]
        tasks = [asyncio.ensure_future(stream(engine, p, 400, seen)) for p, _ in WORK[:4]]
        await wait_for(lambda: seen[0] >= 8)
        marker.touch()  # every replacement worker now dies while loading the model
        os.kill(worker_pids(engine)[1], signal.SIGKILL)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, WorkerDiedError) and r.exitcode == 3 for r in results), results
        assert engine.num_restarts == 2
        assert engine.metrics.registry.get_sample_value("asyncexec_worker_restarts_total") == 2


async def test_the_engine_stays_healthy_through_its_last_allowed_restart(
    tiny_models: dict[str, Path],
) -> None:
    cfg = engine_config(tiny_models["llama"], "mp", 2, restart_on_worker_failure=True, max_worker_restarts=1)
    async with AsyncEngine(cfg) as engine:
        seen = [0]
        tasks = [asyncio.ensure_future(stream(engine, p, 60, seen)) for p, _ in WORK[:4]]
        await wait_for(lambda: seen[0] >= 8)
        samples: list[tuple[bool, bool]] = []  # (mid-restart, healthy), as /health would see them

        async def poll() -> None:
            while not engine.restart_seconds:
                samples.append((engine.num_restarts == 1, engine.is_healthy))
                await asyncio.sleep(0.001)

        poller = asyncio.ensure_future(poll())
        os.kill(worker_pids(engine)[1], signal.SIGKILL)
        await asyncio.wait_for(poller, 60)
        await asyncio.gather(*tasks)
        during = [healthy for mid, healthy in samples if mid]
        assert during, "polled while the restart (1 of 1) was in progress"
        assert all(during), f"/health would have flapped: {during.count(False)} of {len(during)} unhealthy"
        assert all(healthy for _, healthy in samples) and engine.is_healthy


def _our_segments(pids: set[int]) -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith("asyncexec-") and int(n.split("-")[1]) in pids}


@pytest.mark.parametrize("restarts", [None, 1], ids=["restarts-off", "budget-spent"])
async def test_a_fatal_death_releases_workers_segments_and_spares_at_once(
    tiny_models: dict[str, Path], restarts: int | None
) -> None:
    kw: dict[str, object] = {"restart_on_worker_failure": restarts is not None}
    if restarts is not None:
        kw["max_worker_restarts"] = restarts
    me = psutil.Process()
    async with AsyncEngine(engine_config(tiny_models["llama"], "mp", 2, **kw)) as engine:
        seen = [0]
        pids = {os.getpid()} | {p.pid for p in me.children(recursive=True)}
        tasks = [asyncio.ensure_future(stream(engine, p, 400, seen)) for p, _ in WORK[:4]]
        await wait_for(lambda: seen[0] >= 8)
        if restarts:
            os.kill(worker_pids(engine)[1], signal.SIGKILL)
            await wait_for(lambda: len(engine.restart_seconds) == 1)
            pids |= {p.pid for p in me.children(recursive=True)}
        os.kill(worker_pids(engine)[0], signal.SIGKILL)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, WorkerDiedError) for r in results), results
        for _ in range(40):  # 2 s
            if not me.children(recursive=True) and not _our_segments(pids):
                break
            await asyncio.sleep(0.05)
        left = [(p.pid, p.cmdline()) for p in me.children(recursive=True)]
        assert not left, f"workers or spares outlive the fatal death: {left}"
        assert not _our_segments(pids), "the dead executor's segments outlive it"
        assert not engine.is_closed and not engine.is_healthy
