"""Executors for the tests: one per (kind, ranks), shared by a module, always shut down."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from asyncexec import EngineConfig, Executor
from asyncexec.config import ExecutorKind

EXT = "tests.extensions:EchoExtension"
KINDS: list[tuple[ExecutorKind, int]] = [("uni", 1), ("uni", 2), ("mp", 1), ("mp", 2)]


def make_config(kind: ExecutorKind, ranks: int, **overrides: Any) -> EngineConfig:
    overrides.setdefault("worker_extension", EXT)
    return EngineConfig(executor=kind, tensor_parallel_size=ranks, **overrides)


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=KINDS, ids=[f"{k}{n}" for k, n in KINDS])
async def executor(request: pytest.FixtureRequest) -> AsyncIterator[Executor]:
    kind, ranks = request.param
    async with Executor.create(make_config(kind, ranks, shm_arena_bytes=96 << 20)) as ex:
        yield ex
