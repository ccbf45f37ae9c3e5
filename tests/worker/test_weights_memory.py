"""After the load, the checkpoint's memory map holds no resident weight but the embedding rows lookups read
(`worker.memory`): every page of the file that packing or quantization read would otherwise stay resident
beside the packed weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncexec import AsyncEngine, EngineConfig, SamplingParams
from asyncexec.testing import make_tiny_model
from asyncexec.worker.memory import drop_file_pages, own_weights


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A float32 llama of 19 MB (a float32 load keeps its tensors mapped): big enough that the pages at
    the tensors' ends, which are not dropped, and its whole embedding table (0.5 MB, which the engine's
    warm-up forwards read) are a small part of it."""
    folder = tmp_path_factory.mktemp("m") / "llama"
    return make_tiny_model(folder, "llama", hidden_size=512, intermediate_size=1024)


def _mappings(folder: Path) -> dict[str, int]:
    """This process's mappings of files in `folder`: their resident KiB by address range."""
    found: dict[str, int] = {}
    where = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:  # a mapping's first line
                where = head[0] if len(head) == 6 and str(folder) in head[5] else None
            elif where is not None and head[0] == "Rss:":
                found[where] = int(head[1])
    return found


def _resident_kib(folder: Path, before: dict[str, int]) -> int:
    """The resident KiB of the mappings of files in `folder` made since `before`."""
    return sum(v for k, v in _mappings(folder).items() if k not in before)


def _size_kib(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")) // 1024


@pytest.mark.parametrize(
    ("dtype", "eager", "quantization"),
    [("float32", True, None), ("float32", False, None), ("bfloat16", False, "int8")],
)
async def test_the_engine_keeps_no_weight_resident_in_the_checkpoints_memory_map(
    checkpoint: Path, dtype: str, eager: bool, quantization: str | None
) -> None:
    size = _size_kib(checkpoint)
    before = _mappings(checkpoint)
    cfg = EngineConfig(model=str(checkpoint), executor="uni", dtype=dtype, enforce_eager=eager,  # type: ignore[arg-type]
                       quantization=quantization, kv_cache_memory_bytes=1 << 22)  # type: ignore[arg-type]  # fmt: skip
    async with AsyncEngine(cfg) as engine:
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        outs = [o async for o in engine.generate([1, 2, 3], params)]  # and it still runs
        assert len(outs[-1].token_ids) == 4
        # at most the pages of the embedding rows read and of the tensors' ends, not the checkpoint
        resident = _resident_kib(checkpoint, before)
        assert resident <= size // 10, f"{resident} KiB of a {size} KiB checkpoint stay resident"


def test_own_weights_moves_a_mapped_model_into_the_process_and_keeps_ties(checkpoint: Path) -> None:
    from transformers import AutoModelForCausalLM

    before = _mappings(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied: one Parameter in two modules
    values = {n: p.detach().clone() for n, p in model.named_parameters()}  # reads every page
    size = _size_kib(checkpoint)
    assert _resident_kib(checkpoint, before) > size // 2, "transformers no longer maps the checkpoint"
    table = model.model.embed_tokens.weight
    copied = own_weights(model)
    assert copied == sum(p.numel() * 4 for p in model.parameters() if p is not table)
    assert _resident_kib(checkpoint, before) <= size // 10  # the table's pages dropped, the rest copied
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for n, p in model.named_parameters():
        assert torch.equal(p, values[n])  # the dropped pages read back from the file


def test_drop_file_pages_leaves_anonymous_memory_alone() -> None:
    """Dropped anonymous pages would read back as zeros: only a safetensors mapping's are dropped."""
    t = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB of the process's own memory
    assert drop_file_pages(t) == 0
    assert torch.equal(t, torch.arange(1 << 20, dtype=torch.float32))
