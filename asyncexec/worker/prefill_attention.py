"""Attention for one prefill chunk over the paged KV cache, without an `[H, n, ctx]` score matrix.

Same contract as `attention._prefill`: `q [n, H, D]` holds the last n of `ctx` positions of a
sequence whose keys and values for all ctx positions are already in the cache (token t in block
`block_ids[t // block_size]` at offset `t % block_size`); the result is `[n, H, D]`.

Why not one SDPA call: on CPU, `F.scaled_dot_product_attention` takes its flash kernel only for 4-D
inputs, and with `enable_gqa` only without `attn_mask`; `is_causal` aligns the triangle top-left,
which is wrong for a chunk that does not start at position 0. Every other case falls to the math
path, which materializes the scores. So the keys are split in two parts, each exact without a mask:

* the past (positions `0 .. ctx - n - 1`): every query sees every key -> no mask;
* the chunk itself (positions `ctx - n .. ctx - 1`): a square, so top-left `is_causal` is right.

Both go through `aten._scaled_dot_product_flash_attention_for_cpu`, which tiles the scores, maps
query head h to KV head `h // (H // Hkv)` itself (no copy of K/V), and also returns each row's
log-sum-exp `l` (natural log, fp32 for bf16/fp16 inputs). Two softmaxes over disjoint key sets merge
exactly: `out = w * o_past + (1 - w) * o_chunk` with `w = exp(l_past) / (exp(l_past) + exp(l_chunk))
= sigmoid(l_past - l_chunk)`, which never overflows. The total work is that of causal attention.
For the past, the g query heads of a KV head are also folded into its rows (faster for short chunks).

A sliding window (keys with `qpos - kpos < window`) does not split into maskless parts as cheaply,
so when it cuts into the context the chunk is attended in query tiles, each over just the keys its
rows can reach, with an additive mask of `[tile, tile + window - 1]` (still the flash kernel).

K/V are read once per call: a view of the cache when the needed blocks are consecutive, otherwise one
`index_select` of just those blocks. Off CPU (no such kernel), one masked 4-D SDPA is used instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["prefill_attention"]

# query rows per masked call on the window path: the key span is tile + window - 1 for tile * window
# useful scores, so a tile well under the window wastes little, but not so small that calls dominate
_MIN_TILE, _MAX_TILE = 64, 512


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    ctx: int,
    scaling: float | None,
    window: int | None,
) -> torch.Tensor:
    """q [n, H, D]: the last n of `ctx` positions, whose K/V are in the cache; returns [n, H, D]."""
    n = q.shape[0]
    past = ctx - n
    if window is not None and window >= ctx:
        window = None  # every query already reaches position 0
    first = 0 if window is None else max(0, past - window + 1)  # oldest key any query can see
    k, v = _read_kv(k_cache, v_cache, block_ids, first, ctx)  # [1, Hkv, ctx - first, D]
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D], a view
    if q.device.type != "cpu":
        out = _masked_sdpa(qh, k, v, past, first, scaling, window)
    elif window is not None:
        out = _window_tiles(qh, k, v, past, first, scaling, window)
    else:
        out = _split_causal(qh, k, v, past, scaling)
    return out[0].transpose(0, 1)


def _read_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor, first: int, ctx: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions first .. ctx - 1 as [1, Hkv, ctx - first, D] (strided; the kernel takes any strides)."""
    bs, hkv, d = k_cache.shape[1:]
    lo, hi = first // bs, -(-ctx // bs)
    ids = block_ids[lo:hi]
    start = int(ids[0])
    # consecutive blocks (the common case for a fresh allocation) are read in place, without a copy
    if ids.numel() == 1 or bool((ids[1:] - ids[:-1] == 1).all()):
        k, v = k_cache[start : start + ids.numel()], v_cache[start : start + ids.numel()]
    else:
        k, v = k_cache.index_select(0, ids), v_cache.index_select(0, ids)
    off = first - lo * bs
    k = k.view(-1, hkv, d)[off : off + ctx - first].transpose(0, 1).unsqueeze(0)
    v = v.view(-1, hkv, d)[off : off + ctx - first].transpose(0, 1).unsqueeze(0)
    return k, v


def _flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scaling: float | None,
    causal: bool = False,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, dropout_p=0.0, is_causal=causal, attn_mask=mask, scale=scaling
    )
    return out, lse


def _split_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, scaling: float | None
) -> torch.Tensor:
    # keys past .. ctx - 1 against the chunk's own queries: square, so top-left is_causal is exact
    o_chunk, l_chunk = _flash(q, k[:, :, past:], v[:, :, past:], scaling, causal=True)
    if past == 0:
        return o_chunk  # never call the kernel with zero keys: it dies with SIGFPE
    # the past needs no mask, so the g query heads sharing a KV head can be folded into its rows:
    # [1, H, n, D] -> [1, Hkv, g * n, D] (a copy of q only). Exact, and the kernel then picks larger
    # query tiles for short chunks (measured 15-30% faster than its own GQA for n = 512)
    _, h, n, d = q.shape
    hkv = k.shape[1]
    o_past, l_past = _flash(q.reshape(1, hkv, -1, d), k[:, :, :past], v[:, :, :past], scaling)
    o_past, l_past = o_past.reshape(1, h, n, d), l_past.reshape(1, h, n)
    # share of the past in each row's softmax mass; merged in at least fp32 so bf16 loses no more
    acc = torch.promote_types(q.dtype, torch.float32)
    w = torch.sigmoid(l_past.to(acc) - l_chunk.to(acc)).unsqueeze(-1)  # [1, H, n, 1]
    return torch.lerp(o_chunk.to(acc), o_past.to(acc), w).to(q.dtype)


def _window_tiles(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past: int,
    first: int,
    scaling: float | None,
    window: int,
) -> torch.Tensor:
    n = q.shape[2]
    tile = min(n, max(_MIN_TILE, min(_MAX_TILE, window // 4)))
    # relative to a tile's first row, the band is the same for every tile: build it once; a tile
    # whose reach is clipped at `first` (or a short last tile) uses a slice of it
    band = _band_mask(0, tile, 1 - window, tile, window, q)  # [tile, tile + window - 1]
    outs = []
    for a in range(0, n, tile):
        rows = min(tile, n - a)
        # absolute key span the rows past + a .. past + a + rows - 1 can reach
        k_lo, k_hi = max(first, past + a - window + 1), past + a + rows
        mask = band[:rows, k_lo - (past + a - window + 1) : rows + window - 1]
        ks, vs = k[:, :, k_lo - first : k_hi - first], v[:, :, k_lo - first : k_hi - first]
        outs.append(_flash(q[:, :, a : a + rows], ks, vs, scaling, mask=mask)[0])
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _band_mask(
    q_lo: int, q_hi: int, k_lo: int, k_hi: int, window: int | None, like: torch.Tensor
) -> torch.Tensor:
    """Additive [q_hi - q_lo, k_hi - k_lo] mask: 0 where kpos <= qpos and qpos - kpos < window."""
    qpos = torch.arange(q_lo, q_hi, device=like.device)[:, None]
    kpos = torch.arange(k_lo, k_hi, device=like.device)[None, :]
    keep = kpos <= qpos
    if window is not None:
        keep &= qpos - kpos < window
    # the CPU kernel wants the mask in the query's dtype; -inf stays -inf in bf16/fp16
    zero = torch.zeros((), dtype=like.dtype, device=like.device)
    return torch.where(keep, zero, torch.full_like(zero, float("-inf")))


def _masked_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past: int,
    first: int,
    scaling: float | None,
    window: int | None,
) -> torch.Tensor:
    # off CPU there is no LSE-returning kernel to rely on: one masked call, 4-D so that a fused
    # kernel is eligible (untested on GPU)
    mask = _band_mask(past, past + q.shape[2], first, first + k.shape[2], window, q)
    if q.shape[1] != k.shape[1]:  # on CPU, a mask with enable_gqa falls to the math path: assume alike
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
