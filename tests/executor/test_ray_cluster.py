"""RayExecutor across two simulated nodes (`ray.cluster_utils.Cluster`), forced onto the TCP path."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from asyncexec import AsyncEngine
from tests.conftest import hf_greedy, our_segments
from tests.engine.test_engine import engine_config, run_all, workload

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module", autouse=True)
def two_nodes() -> Iterator[None]:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    yield
    ray.shutdown()
    cluster.shutdown()
    deadline = time.monotonic() + 10
    left: list[psutil.Process] = []
    while time.monotonic() < deadline:
        left = [
            p
            for p in psutil.Process().children(recursive=True)
            if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE
        ]
        if not left:
            break
        time.sleep(0.2)
    assert not left, "the Ray cluster left processes behind"


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:  # overrides the suite's: the cluster owns long-lived processes here
    before = our_segments()
    yield
    assert our_segments() <= before


async def test_two_nodes_over_tcp_match_hf(tiny_models: dict[str, Path]) -> None:
    work = workload(6, seed=13)
    refs = hf_greedy(tiny_models["llama"], [p for p, _ in work], [m for _, m in work])
    cfg = engine_config(
        tiny_models["llama"], "ray", 2, ray_placement_strategy="STRICT_SPREAD", distributed_host="127.0.0.1"
    )
    before = our_segments()
    async with AsyncEngine(cfg) as engine:
        assert engine.executor is not None
        assert engine.executor._channel.reply_addr.startswith("tcp://")  # type: ignore[attr-defined]
        assert await run_all(engine, work) == refs
        assert our_segments() == before, "the TCP path uses no shared memory"
