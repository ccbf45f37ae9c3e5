"""An embedding read from a quantized weight: a tied one from its lm_head's (the token table is stored
once), an untied one from a GGUF file's quantized table (`gguf.loader`).

Most small models tie the lm_head to the token embedding (SmolLM2, Llama-3.2-1B and -3B, Qwen2.5 up to
3B): one [vocab, hidden] matrix, at 1B-3B a fifth to a quarter of the weights. Quantizing the lm_head made a
second copy of it, and the embedding kept the bf16 one for its lookups. Here the embedding gives up its
table and each lookup dequantizes only the rows it reads from the lm_head's int8 weight (its scales per
row or per group of 32, and int8's activation-aware input scales divided back out): the same int8
weights the logits are computed with, so the two uses stay tied. Only a plain `nn.Embedding` (no
scaling subclass, no max_norm) whose weight is the lm_head's, outside tensor parallelism. The rows come
from int8 (`int8_gemm`'s blocked layout or one scale per row) or int4 (`int4_gemm`'s nibbles, Q4_1 or
Q4_0), with bf16 or fp16 scales.
"""

from __future__ import annotations

import types

import torch

from asyncexec.ops import int4_gemm, int8_gemm
from asyncexec.ops.packed_linear import PackedWeight
from asyncexec.quantization.install import stand_in

__all__ = ["read_from", "read_rows", "share_tied_embedding"]


def _int4_rows(packed: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows of `int4_gemm`'s nibbles [N / 16, K / 8, 16, 4] (low nibbles inputs 8 k8 + j, high ones
    8 k8 + 4 + j), `q * d + mn` (Q4_0: `mn = -8 d`), float32 [*ids, K]."""
    assert packed.nibbles is not None and packed.d is not None
    k = packed.nibbles.shape[1] * 8
    stored = packed.nibbles[ids // 16, :, ids % 16, :]  # [*ids, K / 8, 4]
    codes = torch.cat([stored & 0x0F, stored >> 4], dim=-1).reshape(*ids.shape, -1, int4_gemm.GROUP)
    d = packed.d.t()[ids].float().unsqueeze(-1)
    mn = -8 * d if packed.mn is None else packed.mn.t()[ids].float().unsqueeze(-1)
    return (codes.float() * d + mn).reshape(*ids.shape, k)


def read_rows(packed: PackedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` (any shape) of the int8 or int4 weight `packed` holds, dequantized: [*ids.shape, K]."""
    if packed.nibbles is not None:
        return _int4_rows(packed, ids).to(dtype)
    assert packed.scales is not None
    if packed.blocked is not None:  # int8_gemm's layout [N / 16, K / 4, 16, 4], w + 128; scales [K / G, N]
        k = packed.blocked.shape[1] * 4
        stored = packed.blocked[ids // 16, :, ids % 16, :].reshape(*ids.shape, -1, int8_gemm.GROUP)
        per_group = packed.scales.t()[ids].float().unsqueeze(-1)  # [*ids, K / G, 1]
        rows = ((stored.to(torch.int16) - 128).float() * per_group).reshape(*ids.shape, k)
    else:  # one scale per row
        assert packed.qweight is not None
        rows = packed.qweight[ids].float() * packed.scales[ids].float().unsqueeze(-1)
    if packed.inv_s is not None:
        rows = rows * packed.inv_s.float()
    return rows.to(dtype)


def _lookup(self: torch.nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    return read_rows(self.tied_packed, ids, self.tied_dtype)  # type: ignore[arg-type]


def share_tied_embedding(embedding: object, head_weight: torch.Tensor, packed: PackedWeight) -> int:
    """Make `embedding` read its rows from the lm_head's `packed` int8 weight if it is a plain
    `nn.Embedding` tied to the lm_head (`head_weight`, the head's weight before packing); returns the
    bytes freed (0 where it does not apply)."""
    if type(embedding) is not torch.nn.Embedding or embedding.weight is not head_weight:
        return 0
    if embedding.max_norm is not None or hasattr(head_weight, "to_local"):
        return 0
    if packed.blocked is None and packed.qweight is None and packed.nibbles is None:
        return 0
    return read_from(embedding, packed)


def read_from(embedding: torch.nn.Embedding, packed: PackedWeight) -> int:
    """Make `embedding` read its rows from `packed` (int8 or int4) and give up its table; returns the
    bytes freed."""
    w = embedding.weight
    freed = w.numel() * w.element_size()
    del embedding.weight
    embedding.register_buffer("weight", stand_in(w), persistent=False)  # shape and dtype for whoever asks
    embedding.tied_packed = packed  # type: ignore[assignment]
    embedding.tied_dtype = w.dtype  # type: ignore[assignment]
    embedding.forward = types.MethodType(_lookup, embedding)  # type: ignore[method-assign]
    return freed
