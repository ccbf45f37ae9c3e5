"""Paged attention for transformers models, registered through `AttentionInterface`.

transformers calls `paged_attention(module, query, key, value, attention_mask, scaling=..., **kwargs)`
once per layer with `query [1, H, T, D]` and `key`/`value [1, Hkv, T, D]` (RoPE applied) for the whole
flattened batch of T tokens. The step's `AttentionMetadata` arrives as the `attn_metadata` forward kwarg
(never a module global), and `module.layer_idx` picks the layer's cache.

KV cache, per layer: K and V of shape `[num_blocks, block_size, Hkv, D]`; block 0 is the null
block, which the scheduler never allocates (padded rows of a CUDA-graph batch write there). Token t of
a sequence lives in slot `block_ids[t // block_size] * block_size + t % block_size`; the flat view
`[num_blocks * block_size, Hkv, D]` is written through `slot_mapping` before attending, so a chunk sees
its own keys.

Batch layout: the first `num_decodes` rows have one query token each, sorted by length; the
remaining rows are prefill chunks, each attended by `prefill_attention` (flash kernels, no score
matrix). Decode rows take one of three paths:
- `graph` (a compiled CPU decode step, `graphs/cpu.py`): the KV write and `decode_kernel` are traced
  into the layer graph, reading K/V in place; the caches are the attention module's buffers
  (`k_cache`, `v_cache`), so all layers share one compiled graph;
- `inplace_decode` (graph mode on, but not a decode graph step: mixed or oversized batches): the same
  in-place kernel. With `mixed_graph` such a step's layers are compiled too (`graphs/cpu.py`): the KV
  write is traced and every row's attention is one opaque op, `asyncexec::paged_attention_rows`,
  which reads the step's metadata registered by `mixed_step`;
- otherwise (`enforce_eager`, CUDA): in groups of similar length, one padded, masked SDPA per group
  over its gathered blocks (a CUDA graph captures a single group of static width).
`sliding_window` (Mistral, Qwen2) limits keys to the last W.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._inductor.inductor_prims  # registers prims.inductor_force_stride_order
import torch.nn.functional as F

from asyncexec.ops import paged_decode
from asyncexec.ops.paged_attention import register_cpu_kernel
from asyncexec.ops.paged_decode import attend_decode, decode_kernel
from asyncexec.worker.prefill_attention import prefill_attention

__all__ = ["ATTN_IMPLEMENTATION", "MIXED_MIN_TOKENS", "AttentionMetadata", "mixed_step", "register_attention"]

ATTN_IMPLEMENTATION = "asyncexec_paged"
MIXED_MIN_TOKENS = 2  # CPU graph mode: mixed steps of fewer tokens run eager (dynamo would specialize 1)


@dataclass
class AttentionMetadata:
    """One step's attention inputs. `kv_caches[layer] = (k_cache, v_cache)`.

    With `profiling`, no cache is used: the batch is one causal sequence and the shapes each layer sees
    are recorded in `seen` (this is how the KV cache is sized under tensor parallelism).
    """

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    slot_mapping: torch.Tensor  # [T] int64
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int64
    decode_seq_lens: torch.Tensor  # [num_decodes] int64
    # prefill rows: (first token index in the batch, query length, context length after this step)
    prefills: list[tuple[int, int, int]] = field(default_factory=list)
    prefill_block_ids: list[torch.Tensor] = field(default_factory=list)
    # decode rows sorted by length, attended in groups: (first row, end row, blocks the group needs);
    # None means one group over the whole padded table (static shapes, for CUDA graphs)
    decode_buckets: list[tuple[int, int, int]] | None = None
    profiling: bool = False
    graph: bool = False  # a compiled decode step: the custom op, caches from the modules' buffers
    mixed_graph: bool = False  # a compiled mixed or prefill step: the layers compiled, attention one op
    inplace_decode: bool = False  # decode rows through the compiled in-place kernel
    layer_code: Any = None  # graph: the compiled layer's code to call without dynamo's guards (graphs/cpu.py)
    seen: dict[int, tuple[int, int, torch.dtype]] = field(default_factory=dict)
    modules: dict[int, torch.nn.Module] = field(default_factory=dict)  # each layer's attention module
    calls: int = 0


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    attn_metadata: AttentionMetadata | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    md = attn_metadata
    if md is None:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention was called without attn_metadata")
    if kwargs.get("softcap") is not None or getattr(module, "sinks", None) is not None:
        raise NotImplementedError("attention softcapping and sinks are not supported by asyncexec yet")
    if md.graph:  # traced: nothing here may read a per-layer Python value (it would recompile)
        return _graph_decode(module, query, key, value, md, scaling, sliding_window)
    if md.mixed_graph:  # traced too
        return _graph_mixed(module, query, key, value, md, scaling, sliding_window)
    md.calls += 1
    layer = int(getattr(module, "layer_idx", 0))
    if md.profiling:
        md.seen[layer] = (key.shape[1], key.shape[3], key.dtype)
        md.modules[layer] = module
        out = F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2), None
    k_cache, v_cache = md.kv_caches[layer]
    _write_kv(k_cache, v_cache, md.slot_mapping, key, value)
    out = _attend_rows(query[0].transpose(0, 1), k_cache, v_cache, md, scaling, sliding_window)
    return out.unsqueeze(0), None  # [1, T, H, D]


def _write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> None:
    """The step's keys and values into their slots of the layer's cache (traceable: in place)."""
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, hkv, d).index_copy_(0, slots, key[0].transpose(0, 1).to(k_cache.dtype))
    v_cache.view(-1, hkv, d).index_copy_(0, slots, value[0].transpose(0, 1).to(v_cache.dtype))


def _attend_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scaling: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """Attention of every row of an eager or mixed step, its keys already in the cache: `q [T, H, D]`
    (decode rows first, then each prefill chunk); returns `[T, H, D]`."""
    parts = []
    if md.num_decodes and md.inplace_decode:
        tables, lens = md.decode_block_tables, md.decode_seq_lens
        parts.append(
            attend_decode(
                q[: md.num_decodes], k_cache, v_cache, tables, lens, scale_of(scaling, q),
                sliding_window or 0,
            )
        )  # fmt: skip
    elif md.num_decodes:
        tables, lens = md.decode_block_tables, md.decode_seq_lens
        for s, e, width in md.decode_buckets or [(0, md.num_decodes, tables.shape[1])]:
            parts.append(
                _decode(q[s:e], k_cache, v_cache, tables[s:e, :width], lens[s:e], scaling, sliding_window)
            )
    for (start, n, ctx), blocks in zip(md.prefills, md.prefill_block_ids, strict=True):
        parts.append(
            prefill_attention(q[start : start + n], k_cache, v_cache, blocks, ctx, scaling, sliding_window)
        )
    return parts[0] if len(parts) == 1 else torch.cat(parts)


# A compiled mixed step's metadata, by its slot mapping's data pointer: the op `paged_attention_rows` finds
# the step's prefill chunks and decode tables here (Python values the layer graph must not see, or every
# new batch would recompile it). Registered for the step's forward only (`mixed_step`).
_STEPS: dict[int, AttentionMetadata] = {}


@contextmanager
def mixed_step(md: AttentionMetadata) -> Iterator[None]:
    """Register `md` for the op while a compiled mixed step runs."""
    key = md.slot_mapping.data_ptr()
    _STEPS[key] = md
    try:
        yield
    finally:
        del _STEPS[key]


def _attention_rows_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scaling: float | None,
    window: int,
) -> torch.Tensor:
    md = _STEPS[slot_mapping.data_ptr()]
    return _attend_rows(q, k_cache, v_cache, md, scaling, window or None)


register_cpu_kernel(_attention_rows_op)


def _graph_mixed(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    md: AttentionMetadata,
    scaling: float | None,
    window: int | None,
) -> tuple[torch.Tensor, None]:
    """A compiled mixed step's attention: the KV write traced (in place, as in `_graph_decode`), the rows'
    attention one opaque op over the written caches."""
    k_cache: torch.Tensor = module.k_cache  # type: ignore[assignment]
    v_cache: torch.Tensor = module.v_cache  # type: ignore[assignment]
    _write_kv(k_cache, v_cache, md.slot_mapping, key, value)
    q = query[0].transpose(0, 1)
    out = torch.ops.asyncexec.paged_attention_rows(q, k_cache, v_cache, md.slot_mapping, scaling, window or 0)
    return out.unsqueeze(0), None


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scaling: float | None,
    window: int | None,
) -> torch.Tensor:
    """q [B, H, D], one token per row at position seq_len - 1; returns [B, H, D]."""
    b, hkv, d = q.shape[0], k_cache.shape[2], k_cache.shape[3]
    idx = block_tables.reshape(-1)  # index_select copies whole blocks: about 2x faster than k_cache[idx]
    k = k_cache.index_select(0, idx).view(b, -1, hkv, d).transpose(1, 2)  # [B, Hkv, L, D]
    v = v_cache.index_select(0, idx).view(b, -1, hkv, d).transpose(1, 2)
    pos = torch.arange(k.shape[2], device=q.device)
    mask = pos[None, :] < seq_lens[:, None]
    if window is not None:
        mask &= pos[None, :] > seq_lens[:, None] - 1 - window
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=scaling, enable_gqa=True
    )
    return out.squeeze(2)


def _prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    ctx: int,
    scaling: float | None,
    window: int | None,
) -> torch.Tensor:
    """q [n, H, D]: the last n of `ctx` positions; returns [n, H, D]. The earlier masked-SDPA prefill,
    no longer on the step path: kept as the reference `prefill_attention` is tested and measured
    against (it materializes `[H, n, ctx]` scores on CPU)."""
    n, hkv, d = q.shape[0], k_cache.shape[2], k_cache.shape[3]
    k = k_cache.index_select(0, block_ids).view(-1, hkv, d)[:ctx].transpose(0, 1)  # [Hkv, ctx, D]
    v = v_cache.index_select(0, block_ids).view(-1, hkv, d)[:ctx].transpose(0, 1)
    qh = q.transpose(0, 1)  # [H, n, D]
    if n == ctx and window is None:
        out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scaling, enable_gqa=True)
    else:
        qpos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        kpos = torch.arange(ctx, device=q.device)[None, :]
        mask = kpos <= qpos
        if window is not None:
            mask &= qpos - kpos < window
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
    return out.transpose(0, 1)


def _graph_decode(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    md: AttentionMetadata,
    scaling: float | None,
    window: int | None,
) -> tuple[torch.Tensor, None]:
    q = query[0].transpose(0, 1)  # [B, H, D]
    # q computed once (inductor would otherwise inline its rotary into the loop over every key)
    q = torch.ops.prims.inductor_force_stride_order(q, q.stride())
    k_cache: torch.Tensor = module.k_cache  # type: ignore[assignment]
    v_cache: torch.Tensor = module.v_cache  # type: ignore[assignment]
    # Traced into the layer graph: inductor fuses the write into the attention loops and keeps it in
    # place (the caches are module buffers, mutated in place, never copied)
    _write_kv(k_cache, v_cache, md.slot_mapping, key, value)
    args = (md.decode_block_tables, md.decode_seq_lens, float(scale_of(scaling, q)), window or 0)
    if paged_decode.serves(q, k_cache):  # the C++ kernel, one opaque op (`paged_decode.py`)
        out = torch.ops.asyncexec.paged_decode(q, k_cache, v_cache, *args)
    else:
        out = decode_kernel(q, k_cache, v_cache, *args)
    return out.unsqueeze(0), None


def scale_of(scaling: float | None, q: torch.Tensor) -> float:
    """SDPA's default scale where the model passes none."""
    return scaling if scaling is not None else q.shape[-1] ** -0.5


def register_attention() -> str:
    """Register `paged_attention` with transformers (idempotent); returns its implementation name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    return ATTN_IMPLEMENTATION
