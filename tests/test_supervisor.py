"""`ExecutorSupervisor` against a fake executor: KV-cache sizing, restart budget accounting, and what
counts as serving while a restart runs."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from asyncexec import ConfigError, EngineConfig, WorkerDiedError
from asyncexec.engine.metrics import EngineMetrics
from asyncexec.engine.supervisor import ExecutorSupervisor

INFO = {"max_model_len": 64, "eos_token_ids": [2], "vocab_size": 100, "architecture": "Fake"}


class FakeExecutor:
    """Answers what the supervisor asks; `start()` may wait on a gate or raise a death."""

    def __init__(self, available: int, block_bytes: int, start_error: BaseException | None = None) -> None:
        self.available, self.block_bytes, self.start_error = available, block_bytes, start_error
        self.gate: asyncio.Event | None = None
        self.num_blocks: int | None = None
        self.failed = False
        self.closed = False

    @property
    def is_failed(self) -> bool:
        return self.failed

    async def start(self) -> None:
        if self.gate is not None:
            await self.gate.wait()
        if self.start_error is not None:
            self.failed = self.closed = True
            raise self.start_error

    async def collective_rpc(self, method: str) -> list[Any]:
        answers: dict[str, list[Any]] = {
            "get_model_info": [INFO],
            "get_kv_cache_block_bytes": [self.block_bytes],
        }
        return answers[method]

    async def determine_available_memory(self) -> int:
        return self.available

    async def initialize_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    async def shutdown(self) -> None:
        await asyncio.sleep(0.01)  # a real one waits for its processes
        self.closed = True


def no_stats() -> dict[str, float]:
    raise RuntimeError("no engine here")


def current(sup: ExecutorSupervisor) -> object:
    return sup.executor


def supervisor(monkeypatch: pytest.MonkeyPatch, plan: list[FakeExecutor], **kw: object) -> ExecutorSupervisor:
    """A supervisor whose `Executor.create` hands out `plan`'s executors in order."""
    made = iter(plan)
    monkeypatch.setattr("asyncexec.engine.supervisor.Executor.create", lambda config: next(made))
    fields: dict[str, object] = {"block_size": 4, "max_num_seqs": 2}
    fields.update(kw)
    return ExecutorSupervisor(EngineConfig(**fields), EngineMetrics(no_stats))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("available", "expected"),
    [
        (10_000, 65),  # capped: 2 x max_num_seqs x 16 blocks (a 64-token sequence) + the null block
        (5_000, 50),  # what fits
        (250, 2),  # the least that works: one usable block and the null block
    ],
)
async def test_the_kv_cache_is_sized_from_memory_and_capped_by_max_num_seqs(
    monkeypatch: pytest.MonkeyPatch, available: int, expected: int
) -> None:
    ex = FakeExecutor(available, block_bytes=100)
    sup = supervisor(monkeypatch, [ex])
    info, num_blocks = await sup.start()
    assert info == INFO and num_blocks == expected and ex.num_blocks == expected


async def test_a_cache_of_fewer_than_two_blocks_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    sup = supervisor(monkeypatch, [FakeExecutor(199, block_bytes=100)])
    with pytest.raises(ConfigError, match="199 bytes hold no KV block of 100 bytes"):
        await sup.start()


async def test_every_restart_attempt_counts_and_a_failed_one_is_retried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first = FakeExecutor(10_000, 100)
    dies = FakeExecutor(10_000, 100, start_error=WorkerDiedError(0, 3))
    healthy = FakeExecutor(10_000, 100)
    sup = supervisor(
        monkeypatch, [first, dies, healthy], restart_on_worker_failure=True, max_worker_restarts=2
    )
    _, num_blocks = await sup.start()
    assert sup.can_restart and sup.num_restarts == 0
    first.failed = True
    replaced: list[int] = []

    def on_replaced() -> int:
        replaced.append(1)
        return 5

    await sup.restart(WorkerDiedError(1, -9), num_blocks, on_replaced)
    assert sup.num_restarts == 2 and not sup.can_restart, "the attempt that died counts too"
    assert first.closed and dies.closed and current(sup) is healthy and healthy.num_blocks == num_blocks
    assert len(replaced) == 2 and len(sup.restart_seconds) == 1
    assert sup.metrics.registry.get_sample_value("asyncexec_worker_restarts_total") == 2
    assert sup.is_serving
    healthy.failed = True
    assert not sup.is_serving, "failed with no restart left"


async def test_a_spent_budget_raises_the_last_death_and_never_loops(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = [FakeExecutor(10_000, 100)] + [
        FakeExecutor(10_000, 100, start_error=WorkerDiedError(0, 3)) for _ in range(3)
    ]
    sup = supervisor(monkeypatch, plan, restart_on_worker_failure=True, max_worker_restarts=2)
    _, num_blocks = await sup.start()
    with pytest.raises(WorkerDiedError, match=r"rank 0 died \(exit code 3\)"):
        await sup.restart(WorkerDiedError(1, -9), num_blocks, lambda: 0)
    assert sup.num_restarts == 2 and current(sup) is plan[2], "two attempts, then it stops"
    assert not sup.can_restart and not sup.is_serving


async def test_restarts_off_means_no_restart(monkeypatch: pytest.MonkeyPatch) -> None:
    first = FakeExecutor(10_000, 100)
    sup = supervisor(monkeypatch, [first])
    await sup.start()
    assert not sup.can_restart and sup.is_serving
    first.failed = True
    assert not sup.is_serving


async def test_the_last_allowed_restart_counts_as_serving_while_it_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first, second = FakeExecutor(10_000, 100), FakeExecutor(10_000, 100)
    second.gate = asyncio.Event()
    sup = supervisor(monkeypatch, [first, second], restart_on_worker_failure=True, max_worker_restarts=1)
    _, num_blocks = await sup.start()
    first.failed = True
    assert sup.is_serving, "a death the budget can heal"
    restart = asyncio.ensure_future(sup.restart(WorkerDiedError(1, -9), num_blocks, lambda: 0))
    seen = []
    while not restart.done():
        await asyncio.sleep(0.001)
        seen.append((current(sup) is first, sup.num_restarts, sup.can_restart, sup.is_serving))
        if current(sup) is second:
            second.gate.set()
    await restart
    assert (True, 1, False, True) in seen, "seen while the failed executor shut down, the attempt counted"
    assert (False, 1, False, True) in seen, "seen while the new executor started"
    assert all(serving for *_, serving in seen)
    assert sup.is_serving and current(sup) is second
