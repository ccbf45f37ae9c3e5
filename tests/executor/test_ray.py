"""RayExecutor: the executor suite on Ray actors, actor death, and no process left behind.

One Ray instance for the module (`num_cpus=2`). Ray keeps its own processes (and idle workers) for the
module's life, so this module checks leaks of its own: segments after every test, and every process
after `ray.shutdown()`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psutil
import pytest
import pytest_asyncio
import torch

from asyncexec import (
    AsyncEngine,
    EngineConfig,
    Executor,
    ExecutorTimeoutError,
    WorkerDiedError,
    WorkerFailedError,
)
from asyncexec.executor.ray_executor import RayExecutor
from tests.conftest import our_segments
from tests.executor.conftest import EXT

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module", autouse=True)
def ray_instance() -> Iterator[None]:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
        if not [p for p in left if p.status() != psutil.STATUS_ZOMBIE]:
            break
        time.sleep(0.2)
    assert not [p for p in left if p.status() != psutil.STATUS_ZOMBIE], "Ray left processes behind"


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:  # overrides the suite's: Ray owns long-lived processes here
    before = our_segments()
    yield
    assert our_segments() <= before, "a test left shared-memory segments behind"


@pytest_asyncio.fixture(loop_scope="module")
async def ray_executor() -> AsyncIterator[Executor]:  # one at a time: 2 ranks take both of Ray's CPUs
    cfg = EngineConfig(executor="ray", tensor_parallel_size=2, worker_extension=EXT, shm_arena_bytes=16 << 20)
    async with Executor.create(cfg) as ex:
        yield ex


async def test_every_actor_replies_in_rank_order(ray_executor: Executor) -> None:
    assert isinstance(ray_executor, RayExecutor)
    assert await ray_executor.collective_rpc("whoami") == [0, 1]
    assert await ray_executor.collective_rpc("greet", ("ray",)) == [
        "hello ray from rank 0!",
        "hello ray from rank 1!",
    ]


async def test_tensors_both_ways_through_shared_memory_on_one_node(ray_executor: Executor) -> None:
    t = torch.randn(1 << 20)
    for out in await ray_executor.collective_rpc("add", (t, 2.0)):
        assert torch.equal(out, t + 2.0)


async def test_error_on_one_rank_and_timeouts(ray_executor: Executor) -> None:
    with pytest.raises(WorkerFailedError, match="boom on rank 1") as info:
        await ray_executor.collective_rpc("fail_on", (1,))
    assert info.value.rank == 1
    with pytest.raises(ExecutorTimeoutError) as timeout:
        await ray_executor.collective_rpc("sleep_on", (0, 0.5), timeout=0.1)
    assert timeout.value.missing_ranks == [0]
    assert await ray_executor.collective_rpc("whoami", timeout=5) == [0, 1]


async def test_killing_an_actor_fails_the_step_within_two_seconds() -> None:
    cfg = EngineConfig(executor="ray", tensor_parallel_size=2, worker_extension=EXT, shm_arena_bytes=1 << 20)
    ex = Executor.create(cfg)
    await ex.start()
    try:
        assert isinstance(ex, RayExecutor)
        slow = asyncio.ensure_future(ex.collective_rpc("sleep", (30.0,)))
        await asyncio.sleep(0.3)
        start = time.monotonic()
        ray.kill(ex._actors[1])
        with pytest.raises(WorkerDiedError) as info:
            await slow
        assert time.monotonic() - start < 2.0
        assert info.value.rank == 1 and info.value.detail
    finally:
        await ex.shutdown()


async def test_greedy_engine_on_ray_equals_hf(tiny_models: dict[str, Path]) -> None:
    from tests.conftest import hf_greedy
    from tests.engine.test_engine import engine_config, run_all, workload

    work = workload(8, seed=11)
    refs = hf_greedy(tiny_models["llama"], [p for p, _ in work], [m for _, m in work])
    async with AsyncEngine(engine_config(tiny_models["llama"], "ray", 2)) as engine:
        assert await run_all(engine, work) == refs


async def test_speculative_decoding_on_ray_equals_hf(tiny_models: dict[str, Path]) -> None:
    """Both actors verify the same drafts (`check_rank_agreement`): greedy output equals HF's."""
    import random

    from tests.conftest import hf_greedy
    from tests.engine.test_engine import engine_config, run_all

    rng = random.Random(5)
    phrases = [[rng.randrange(256) for _ in range(rng.randint(3, 6))] for _ in range(6)]
    work = [(p * rng.randint(2, 4), 20) for p in phrases]  # repeated phrases: drafts to find
    refs = hf_greedy(tiny_models["llama"], [p for p, _ in work], [m for _, m in work])
    spec = {"prompt_lookup_min": 1, "disable_by_batch_size": None}
    cfg = engine_config(tiny_models["llama"], "ray", 2, speculative_config=spec, check_rank_agreement=True)
    async with AsyncEngine(cfg) as engine:
        assert await run_all(engine, work) == refs
        assert engine.stats()["spec_decode_num_accepted_tokens"] > 0


async def test_the_batch_invariant_mode_gives_ray_the_bits_of_uni() -> None:
    """The real model in bf16 with `batch_invariant=True`: probes amid a crowd on a Ray actor get the
    tokens and logprobs the same probes get alone on the uni executor (same tensor-parallel size)."""
    from tests.real_model.test_smollm2_batch_invariant import alone, amid_crowd, config

    async with AsyncEngine(config()) as engine:
        ref = await alone(engine)
    async with AsyncEngine(config(executor="ray")) as engine:
        assert await amid_crowd(engine, 3) == ref
