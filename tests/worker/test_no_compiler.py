"""Without a working C++ compiler, graph mode falls back to eager with one warning, instead of failing."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncexec import AsyncEngine, EngineConfig, SamplingParams
from tests.engine.test_engine import collect


async def test_no_cxx_compiler_runs_eager_with_one_warning(
    tiny_models: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    # the workers are fresh processes: they see this CXX and an empty compile cache (nothing prebuilt)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "compile-cache"))
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    cfg = EngineConfig(model=str(tiny_models["llama"]), executor="mp", block_size=4, max_num_seqs=4,
                       kv_cache_memory_bytes=1 << 20)  # fmt: skip
    async with AsyncEngine(cfg) as engine:
        out = await collect(engine, [5, 6, 7], greedy)
        stats = (await engine.collective_rpc("get_runner_stats"))[0]
    async with AsyncEngine(cfg.replace(enforce_eager=True)) as engine:
        eager = await collect(engine, [5, 6, 7], greedy)
    assert out.token_ids == eager.token_ids and stats["graph_steps"] == 0
    err = capfd.readouterr().err
    assert err.count("graph mode needs a C++ compiler and none works here") == 1, err[-3000:]
    assert "could not build" not in err, "one warning says why, not one per kernel"
