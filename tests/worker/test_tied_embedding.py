"""A tied embedding under int8 or int4 is stored once: its lookups dequantize the rows they read from the
lm_head's int8 weight (`quantization/embedding.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from asyncexec.ops import int8_gemm
from asyncexec.ops.packed_linear import REGISTRY
from asyncexec.quantization.int8 import dequantize
from asyncexec.quantization.int8 import gemm_serves as int8_gemm_serves
from asyncexec.quantization.pack import pack_linears
from asyncexec.testing import make_tiny_model


def _model(tmp_path: Path, vocab: int, tied: bool = True) -> Any:
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path / "m", "llama", tie_word_embeddings=tied, vocab_size=vocab)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)


@pytest.mark.parametrize("vocab", [272, 259])  # whole blocks of 16 (int8_gemm's layout), or not
@pytest.mark.parametrize("aware", [False, True])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_tied_embedding_reads_its_rows_from_the_lm_heads_int8_weight(
    tmp_path: Path, vocab: int, aware: bool, quantization: str
) -> None:
    model = _model(tmp_path, vocab)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert head.weight is emb.weight
    table = emb.weight.detach().clone()
    s = torch.linspace(0.5, 2.0, table.shape[1])
    stats = pack_linears(model, quantization, input_scales={head: s} if aware else None)
    assert stats["embedding_freed"] == table.numel() * table.element_size()
    assert emb.weight.stride() == (0, 0) and emb.weight.untyped_storage().nbytes() == 2  # no table kept
    packed = REGISTRY[head.weight.data_ptr()]
    assert (packed.blocked is not None) == int8_gemm_serves(table)  # whole blocks of 16, VNNI, not off
    q = int8_gemm.unpack(packed.blocked) if packed.blocked is not None else packed.qweight
    assert q is not None and packed.scales is not None
    ids = torch.tensor([[0, 5, vocab - 1, 17], [3, 3, 200, 1]])
    with torch.inference_mode():
        got = emb(ids)
    # the weight the logits are computed with: the kernels multiply the input by bf16 1 / s
    assert (packed.inv_s is not None) == aware
    want = dequantize(q, packed.scales, None)[ids] * (1.0 if packed.inv_s is None else packed.inv_s.float())
    torch.testing.assert_close(got.float(), want.bfloat16().float(), rtol=0, atol=0)
    assert not torch.equal(got, table[ids])  # the int8 rows, not the bf16 table
    torch.testing.assert_close(got.float(), table[ids].float(), rtol=0, atol=0.02 * table.abs().max().item())


def test_an_untied_embedding_keeps_its_table(tmp_path: Path) -> None:
    model = _model(tmp_path, 272, tied=False)
    table = model.get_input_embeddings().weight.detach().clone()
    stats = pack_linears(model, "int8")
    assert "embedding_freed" not in stats
    ids = torch.tensor([[0, 5, 271]])
    with torch.inference_mode():
        assert torch.equal(model.get_input_embeddings()(ids), table[ids])


def test_bf16_weights_keep_the_embedding(tmp_path: Path) -> None:
    model = _model(tmp_path, 272)
    stats = pack_linears(model, None)
    assert "embedding_freed" not in stats
    assert model.get_input_embeddings().weight.untyped_storage().nbytes() == 272 * 64 * 2
