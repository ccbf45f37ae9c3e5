"""Executors for the tests: one per (kind, ranks), shared by a module, always shut down, leak-checked."""

from __future__ import annotations

import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from asyncexec import EngineConfig, Executor
from asyncexec.config import ExecutorKind
from tests.conftest import LeakCheck
from tests.extensions import EchoExtension

EXT = "tests.extensions:EchoExtension"
KINDS: list[tuple[ExecutorKind, int]] = [("uni", 1), ("uni", 2), ("mp", 1), ("mp", 2)]


def make_config(kind: ExecutorKind, ranks: int, **overrides: Any) -> EngineConfig:
    overrides.setdefault("worker_extension", EXT)
    return EngineConfig(executor=kind, tensor_parallel_size=ranks, **overrides)


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=KINDS, ids=[f"{k}{n}" for k, n in KINDS])
async def executor(request: pytest.FixtureRequest) -> AsyncIterator[Executor]:
    # Started before the first test's `no_leaks` and shut down after the last one's: check it here.
    kind, ranks = request.param
    leaks = LeakCheck()
    async with Executor.create(make_config(kind, ranks, shm_arena_bytes=96 << 20)) as ex:
        yield ex
    leaks.assert_clean(f"the module's {kind}{ranks} executor")


class RankMemoryExtension(EchoExtension):
    """Every rank offers a different KV-cache budget, the last rank the smallest: (world_size - rank) MiB."""

    world_size: int

    def determine_available_memory(self) -> int:
        return (self.world_size - self.rank) << 20


class SigtermRecorderExtension(EchoExtension):
    """`record_sigterm(dir)`: from then on SIGTERM only appends its arrival time to `dir/sigterm-<rank>`."""

    def record_sigterm(self, directory: str) -> None:
        path = f"{directory}/sigterm-{self.rank}"

        def record(signum: int, frame: object) -> None:
            with open(path, "a") as f:
                f.write(f"{time.time()!r}\n")

        signal.signal(signal.SIGTERM, record)
