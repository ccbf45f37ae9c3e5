"""The Prometheus metrics: the engine's state is read at render time."""

from __future__ import annotations

import pytest

from asyncexec.engine.metrics import EngineMetrics
from asyncexec.errors import ExecutorClosedError


def test_an_engine_not_started_renders_no_state_and_a_broken_one_raises() -> None:
    def not_started() -> dict[str, float]:
        raise ExecutorClosedError("engine is not started")

    text = EngineMetrics(not_started).render().decode()
    assert "asyncexec_kv_cache_blocks" not in text and "asyncexec_requests_finished_total" in text

    def broken() -> dict[str, float]:
        raise KeyError("num_blocks")

    with pytest.raises(KeyError, match="num_blocks"):  # a bug in the stats shows, not an empty page
        EngineMetrics(broken).render()
