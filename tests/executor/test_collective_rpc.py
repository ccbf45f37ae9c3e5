"""collective_rpc, execute_model and errors, on uni and mp with 1 and 2 ranks."""

from __future__ import annotations

import time

import pytest
import torch

from asyncexec import (
    CachedRequestData,
    EngineConfig,
    Executor,
    ExecutorClosedError,
    ExecutorTimeoutError,
    ModelRunnerOutput,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
    WorkerFailedError,
)
from asyncexec.config import ExecutorKind
from tests.executor.conftest import make_config

RANK_MEMORY_EXT = "tests.executor.conftest:RankMemoryExtension"

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_every_rank_replies_in_rank_order(executor: Executor) -> None:
    assert await executor.collective_rpc("whoami") == list(range(executor.world_size))


async def test_args_and_kwargs_reach_the_method(executor: Executor) -> None:
    got = await executor.collective_rpc("greet", ("ada",), {"punctuation": "?"})
    assert got == [f"hello ada from rank {r}?" for r in range(executor.world_size)]


async def test_tensors_go_both_ways(executor: Executor) -> None:
    t = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4).t()
    out = await executor.collective_rpc("add", (t, 1.0))
    for o in out:
        assert torch.equal(o, t + 1.0) and o.dtype == torch.bfloat16


async def test_64_mib_tensor_goes_to_every_rank_and_back(executor: Executor) -> None:
    t = torch.randn(16 << 20)  # 64 MiB of float32
    out = await executor.collective_rpc("echo", (t,))
    assert len(out) == executor.world_size
    for o in out:
        assert torch.equal(o, t)
    del out


async def test_error_on_one_rank_names_that_rank(executor: Executor) -> None:
    if executor.world_size < 2:
        pytest.skip("needs two ranks")
    with pytest.raises(WorkerFailedError, match="boom on rank 1") as info:
        await executor.collective_rpc("fail_on", (1,))
    err = info.value
    assert err.rank == 1 and err.remote_type == "ValueError"
    assert err.remote_message == "boom on rank 1"
    assert "fail_on" in err.remote_traceback and "raise ValueError" in err.remote_traceback
    assert [f.rank for f in err.failures] == [1]
    assert await executor.collective_rpc("whoami") == [0, 1], "the worker keeps serving after an error"


async def test_unknown_and_private_methods_are_refused(executor: Executor) -> None:
    for name in ("no_such_method", "__init__", "_runner"):
        with pytest.raises(WorkerFailedError, match="no public method") as info:
            await executor.collective_rpc(name)
        assert info.value.rank == 0 and info.value.remote_type == "AttributeError"


async def test_timeout_raises_and_leaves_the_executor_usable(executor: Executor) -> None:
    last = executor.world_size - 1
    start = time.monotonic()
    with pytest.raises(ExecutorTimeoutError) as info:
        await executor.collective_rpc("sleep_on", (last, 0.5), timeout=0.1)
    assert time.monotonic() - start < 0.4
    assert info.value.missing_ranks == [last] and info.value.method == "sleep_on"
    assert isinstance(info.value, TimeoutError)
    assert await executor.collective_rpc("whoami", timeout=5) == list(range(executor.world_size))


async def test_execute_model_returns_a_typed_output(executor: Executor) -> None:
    so = SchedulerOutput(
        step_id=0,
        scheduled_new_reqs=[NewRequestData("abc", [1, 2], SamplingParams(), [0], 0)],
        scheduled_cached_reqs=CachedRequestData(["de"], [False], [[]], [[]], [5]),
        num_scheduled_tokens={"abc": 2, "de": 1},
        total_num_scheduled_tokens=3,
    )
    out = await executor.execute_model(so)
    assert isinstance(out, ModelRunnerOutput)
    assert out.req_ids == ["abc", "de"] and out.sampled_token_ids == [[3], [2]]


@pytest.mark.parametrize("kind", ["uni", "mp"])
async def test_memory_is_the_minimum_over_ranks(kind: ExecutorKind) -> None:
    cfg = make_config(kind, 2, worker_extension=RANK_MEMORY_EXT, shm_arena_bytes=1 << 20)
    async with Executor.create(cfg) as ex:
        per_rank = await ex.collective_rpc("determine_available_memory")
        assert per_rank == [2 << 20, 1 << 20], "each rank offers its own budget"
        assert await ex.determine_available_memory() == 1 << 20  # rank 1's: neither rank 0's nor the max


async def test_model_methods_without_a_model_say_so(executor: Executor) -> None:
    with pytest.raises(WorkerFailedError, match="model=None"):
        await executor.initialize_kv_cache(8)
    await executor.check_health()


async def test_unsendable_result_is_an_error_reply(executor: Executor) -> None:
    if executor.config.executor_kind == "uni":
        pytest.skip("in-process results are passed by reference")
    with pytest.raises(WorkerFailedError, match="cannot be sent"):
        await executor.collective_rpc("unsendable")


async def test_lifecycle_errors() -> None:
    ex = Executor.create(make_config("uni", 1))
    with pytest.raises(ExecutorClosedError, match="not started"):
        await ex.collective_rpc("whoami")
    async with ex:
        assert await ex.collective_rpc("whoami") == [0]
    with pytest.raises(ExecutorClosedError, match="shut down"):
        await ex.collective_rpc("whoami")
    await ex.shutdown()  # idempotent


async def test_factory_picks_the_class() -> None:
    from asyncexec import MultiProcExecutor, UniProcExecutor

    assert type(Executor.create(EngineConfig())) is UniProcExecutor
    assert type(Executor.create(EngineConfig(tensor_parallel_size=2))) is MultiProcExecutor
    assert type(Executor.create(EngineConfig(executor="uni", tensor_parallel_size=2))) is UniProcExecutor
    from asyncexec.executor.ray_executor import RayExecutor

    assert type(Executor.create(EngineConfig(executor="ray"))) is RayExecutor
