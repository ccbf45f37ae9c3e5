"""Per-layer prefill attention time: old `_prefill` vs `prefill_attention` vs one causal SDPA.

SmolLM2-135M shapes (9 query heads, 3 KV heads, head_dim 64, block_size 16), 2 threads. A prompt of
P tokens is chunked at C; each chunk's time is summed, with the K/V of the whole prompt already in the
cache (what the kernel sees is the same: the writes are not timed). "new" reads shuffled blocks (one
index_select per chunk), "new/consec" consecutive blocks (read in place). The last rows use a sliding
window of 1024 (Mistral-style), where the new path attends masked query tiles.

Run: .venv/bin/python scripts/probe_prefill.py [threads]   (about a minute at 2 threads)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from asyncexec.worker.attention import _prefill
from asyncexec.worker.prefill_attention import prefill_attention

H, HKV, D, BS = 9, 3, 64, 16
SCALE = D**-0.5

Attn = Callable[..., torch.Tensor]


def _timed(fn: Callable[[], object], budget_s: float = 0.25) -> float:
    """Best of a few runs, fewer when one run is slow (the old path takes seconds at 8k)."""
    start = time.perf_counter()
    fn()
    best = time.perf_counter() - start
    spent = best
    while spent + best < budget_s:
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
    return best


def _chunked(
    attn: Attn,
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    ids: torch.Tensor,
    chunk: int,
    window: int | None,
) -> float:
    total = 0.0
    for start in range(0, q.shape[0], chunk):
        qs = q[start : start + chunk]
        ctx = start + qs.shape[0]
        total += _timed(partial(attn, qs, kc, vc, ids, ctx, SCALE, window))
    return total


def _row(prompt: int, chunk: int, dtype: torch.dtype, window: int | None) -> str:
    g = torch.Generator().manual_seed(prompt + chunk)
    nblocks = -(-prompt // BS)
    kc = torch.randn(nblocks + 1, BS, HKV, D, generator=g).to(dtype)  # block 0: the null block
    vc = torch.randn(nblocks + 1, BS, HKV, D, generator=g).to(dtype)
    q = torch.randn(prompt, H, D, generator=g).to(dtype)
    consecutive = torch.arange(1, nblocks + 1)
    shuffled = torch.randperm(nblocks, generator=g) + 1
    # the K/V written in cache order; the shuffled table reads the same blocks in another order,
    # which is fine for timing (values differ, shapes and work do not)
    old = _chunked(_prefill, q, kc, vc, shuffled, chunk, window)
    new = _chunked(prefill_attention, q, kc, vc, shuffled, chunk, window)
    consec = _chunked(prefill_attention, q, kc, vc, consecutive, chunk, window)
    k = kc[1:].reshape(-1, HKV, D)[:prompt].transpose(0, 1)[None]
    v = vc[1:].reshape(-1, HKV, D)[:prompt].transpose(0, 1)[None]
    qh = q.transpose(0, 1)[None]
    if window is None:
        plain = _timed(
            lambda: F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=SCALE, enable_gqa=True)
        )
        plain_s = f"{plain * 1e3:10.0f}"
    else:
        plain_s = f"{'-':>10}"
    name = str(dtype).removeprefix("torch.")
    win = "-" if window is None else str(window)
    return (
        f"{prompt:>6} {chunk:>5} {name:>8} {win:>6} {old * 1e3:10.0f} {new * 1e3:10.0f} "
        f"{consec * 1e3:10.0f} {plain_s} {old / new:7.1f}x"
    )


def main() -> None:
    # 2 threads by default; on a shared machine, 1 (`probe_prefill.py 1`) is the steadier comparison
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    print("per-layer attention time, ms (sum over chunks)")
    print(
        f"{'prompt':>6} {'chunk':>5} {'dtype':>8} {'window':>6} {'old':>10} {'new':>10} "
        f"{'new/consec':>10} {'sdpa-causal':>10} {'speedup':>8}"
    )
    for dtype in (torch.float32, torch.bfloat16):
        for prompt in (2000, 8000):
            for chunk in (512, 2048):
                print(_row(prompt, chunk, dtype, None), flush=True)
    for chunk in (512, 2048):
        print(_row(8000, chunk, torch.float32, 1024), flush=True)


if __name__ == "__main__":
    main()
