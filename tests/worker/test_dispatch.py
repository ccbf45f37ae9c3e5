"""The worker serves a step straight from its `ModelRunner` (no hop that only passes the call on), unless
a worker_extension overrides `execute_model`; either way the argument decodes as a `SchedulerOutput`."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncexec import CachedRequestData, EngineConfig, SchedulerOutput
from asyncexec.worker.worker import build_worker, lookup_method


def test_execute_model_is_served_by_the_model_runner(tiny_models: dict[str, Path]) -> None:
    worker = build_worker(EngineConfig(model=str(tiny_models["llama"]), device="cpu"), 0, 0, 1)
    worker.init_device()
    spec = lookup_method(worker, "execute_model")
    assert spec.fn.__self__ is worker.model_runner  # type: ignore[attr-defined]
    assert spec.positional == (SchedulerOutput,)


def test_an_extension_that_overrides_execute_model_is_served_instead(tiny_models: dict[str, Path]) -> None:
    cfg = EngineConfig(
        model=str(tiny_models["llama"]),
        device="cpu",
        worker_extension="tests.extensions:FailingStepExtension",
    )
    worker = build_worker(cfg, 0, 0, 1)
    worker.init_device()
    spec = lookup_method(worker, "execute_model")
    assert spec.fn.__self__ is worker and spec.positional == (SchedulerOutput,)  # type: ignore[attr-defined]


def test_without_a_model_execute_model_says_so() -> None:
    worker = build_worker(EngineConfig(model=None), 0, 0, 1)
    worker.init_device()
    spec = lookup_method(worker, "execute_model")
    so = SchedulerOutput(0, [], CachedRequestData(), {}, 0)
    with pytest.raises(RuntimeError, match="needs a model"):
        spec.fn(so)


@pytest.mark.parametrize("eager", [False, True])
def test_the_model_runner_patches_the_transformers_model_at_load(
    tiny_models: dict[str, Path], eager: bool
) -> None:
    import torch

    from asyncexec.worker.attention import ATTN_IMPLEMENTATION
    from asyncexec.worker.graphs.cpu import decoder_layers
    from asyncexec.worker.model_runner import ModelRunner

    cfg = EngineConfig(model=str(tiny_models["llama"]), device="cpu", enforce_eager=eager)
    runner = ModelRunner(cfg, torch.device("cpu"), 1)
    runner.load_model()
    assert runner.model.config._attn_implementation == ATTN_IMPLEMENTATION
    layers = decoder_layers(runner.model, runner.hf_config.num_hidden_layers)
    dispatched = ["CompiledLayers.dispatch" in layer.forward.__qualname__ for layer in layers]
    packed = [hasattr(m, "group_key") for m in runner.model.modules() if isinstance(m, torch.nn.Linear)]
    assert dispatched == [not eager] * len(layers)
    assert any(packed) is (not eager)  # graph mode packs the linears, eager leaves them be
