"""After the load, no weight is left in the checkpoint's memory map (`worker.memory.own_weights`): every page
of the file that packing or quantization read would otherwise stay resident beside the packed weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncexec import AsyncEngine, EngineConfig, SamplingParams
from asyncexec.worker.memory import own_weights


def _mapped(folder: Path) -> list[str]:
    """This process's mappings of files in `folder`."""
    with open("/proc/self/maps") as f:
        return [line.split()[-1] for line in f if str(folder) in line]


@pytest.mark.parametrize(
    ("dtype", "eager", "quantization"),
    [("float32", True, None), ("float32", False, None), ("bfloat16", False, "int8")],
)
async def test_the_engine_keeps_no_weight_in_the_checkpoints_memory_map(
    tiny_models: dict[str, Path], dtype: str, eager: bool, quantization: str | None
) -> None:
    folder = tiny_models["llama"]  # float32 safetensors: a float32 load keeps its tensors mapped
    cfg = EngineConfig(model=str(folder), executor="uni", dtype=dtype, enforce_eager=eager,  # type: ignore[arg-type]
                       quantization=quantization, kv_cache_memory_bytes=1 << 20)  # type: ignore[arg-type]  # fmt: skip
    async with AsyncEngine(cfg) as engine:
        assert _mapped(folder) == []
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        outs = [o async for o in engine.generate([1, 2, 3], params)]  # and it still runs
        assert len(outs[-1].token_ids) == 4


def test_own_weights_moves_a_mapped_model_into_the_process_and_keeps_ties(
    tiny_models: dict[str, Path],
) -> None:
    from transformers import AutoModelForCausalLM

    folder = tiny_models["llama"]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied: one Parameter in two modules
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert _mapped(folder), "transformers no longer maps the checkpoint: this test checks nothing"
    copied = own_weights(model)
    assert _mapped(folder) == []
    assert copied == sum(p.numel() * 4 for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])
