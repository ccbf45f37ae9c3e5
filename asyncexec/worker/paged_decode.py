"""Decode attention that reads K/V where they lie in the paged cache (graph mode on CPU).

The eager decode path (`attention._decode`) copies every block of every sequence with `index_select`,
then runs a masked SDPA, which on CPU takes the math path: on SmolLM2 (9 query heads, 3 KV heads, head
size 64), 32 sequences of 16-384 tokens, about 7 ms per layer in bfloat16. `decode_kernel` instead is
a gather-by-block-table, a multiply-reduce, a masked softmax and a second multiply-reduce, which
inductor fuses into loops that index the cache in place: about 1.3 ms for the same layer. It is
compiled with dynamic batch and table width, so no batch composition recompiles it (`attend_decode`).

In a compiled decode step (`cpu_graph.py`), `attention._graph_decode` traces the KV write and
`decode_kernel` into the decoder layer's graph: the caches are module buffers mutated in place, and
inductor fuses the write, the rotary embedding and the attention into one kernel. Mixed steps' decode
rows call `attend_decode`, the kernel compiled on its own.

Shapes: `q [B, H, D]`; `key`, `value [B, Hkv, D]`; caches `[num_blocks, block_size, Hkv, D]`;
`block_tables [B, W]` (unused entries point at the null block; cut or padded to `decode_width`);
`seq_lens [B]`, the context length of each row including its new token. `window > 0` keeps only the
last `window` keys.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["attend_decode", "decode_kernel", "decode_width"]

_compiled: dict[tuple[object, ...], Callable[..., torch.Tensor]] = {}


def decode_kernel(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int,
) -> torch.Tensor:
    """Attention of one query token per row over its blocks; `[B, H, D]` in q's dtype. Traceable."""
    b, w = block_tables.shape
    bs, hkv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    g = q.shape[1] // hkv
    # Indexing by the table stays a view in the fused loops: no per-step copy of the blocks.
    k = k_cache[block_tables].view(b, w * bs, hkv, d)
    v = v_cache[block_tables].view(b, w * bs, hkv, d)
    qf = q.view(b, 1, hkv, g, d).float()
    scores = (qf * k.float().unsqueeze(3)).sum(-1) * scale  # [B, L, Hkv, g]
    pos = torch.arange(w * bs, device=q.device)[None, :]
    hidden = pos >= seq_lens[:, None]
    if window > 0:
        hidden = hidden | (pos <= seq_lens[:, None] - 1 - window)
    scores = scores.masked_fill(hidden[:, :, None, None], float("-inf"))
    probs = scores.softmax(dim=1)
    out = (probs.unsqueeze(-1) * v.float().unsqueeze(3)).sum(1)  # [B, Hkv, g, D]
    return out.reshape(b, hkv * g, d).to(q.dtype)


def fresh_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of `fn` with its own code object. Dynamo caches compiled graphs per code object, at
    most `recompile_limit` (8) of them: one copy per model shape keeps engines of different models in
    one process from sharing, and exhausting, that budget."""
    code = fn.__code__.replace(co_name=fn.__code__.co_name)
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _compiled_kernel(q: torch.Tensor, k_cache: torch.Tensor, window: int) -> Callable[..., torch.Tensor]:
    key = (q.dtype, q.device, q.shape[1], *k_cache.shape[1:], k_cache.dtype, window > 0)
    kernel = _compiled.get(key)
    if kernel is None:
        kernel = _compiled[key] = torch.compile(fresh_function(decode_kernel), fullgraph=True)
    return kernel


def attend_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int,
    exact: bool = False,
) -> torch.Tensor:
    """`decode_kernel`, compiled, over the table width the longest row needs (`exact`: the caller, graph
    mode, already cut the tables to `decode_width` and made them contiguous: nothing to do per layer).

    Only the batch and the table width are dynamic to the compiler (the cache, head and head-size dims
    stay static, for better loops), and both are kept out of dynamo's 0/1 specialization where cheap:
    the width is at least 2 (an extra null block, masked, costs little), and batches of 1 get their
    own graph at start-up. Dynamo also guards on strides and on dispatch keys (which differ between
    inference and normal tensors), so every caller's inputs are made alike here: fresh contiguous
    copies of the small ones, made under inference mode, and caches allocated under it
    (`ModelRunner.allocate_kv_cache`). (Skipping guard evaluation, `set_stance(skip_guard_eval_unsafe=
    True)`, would save about 60 us a call, but the stance is process-global: engines in other threads
    would compile under it, and a kernel variant picked for other strides reads the wrong blocks.)
    """
    with torch.inference_mode():
        q = q.clone(memory_format=torch.contiguous_format)
        if exact and block_tables.is_contiguous() and seq_lens.is_contiguous():
            tables = block_tables
        else:
            width = decode_width(int(seq_lens.max()), k_cache.shape[1])
            tables = block_tables[:, :width].clone(memory_format=torch.contiguous_format)
            if tables.shape[1] < width:  # a batch of one-block rows: pad with the null block
                tables = torch.nn.functional.pad(tables, (0, width - tables.shape[1]))
            seq_lens = seq_lens.clone()
        for t in (q, tables, seq_lens):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        torch._dynamo.mark_dynamic(tables, 1)
        kernel = _compiled_kernel(q, k_cache, window)
        return kernel(q, k_cache, v_cache, tables, seq_lens, scale, window)


def decode_width(max_seq_len: int, block_size: int) -> int:
    """Blocks of table the kernel reads: what the longest row needs, at least 2 (see `attend_decode`)."""
    return max(2, -(-max_seq_len // block_size))
