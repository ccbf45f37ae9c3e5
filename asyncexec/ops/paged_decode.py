"""Decode attention that reads K/V where they lie in the paged cache (graph mode on CPU).

The eager decode path (`attention._decode`) copies every block of every sequence with `index_select`,
then runs a masked SDPA, which on CPU takes the math path: on SmolLM2 (9 query heads, 3 KV heads, head
size 64), 32 sequences of 16-384 tokens, about 7 ms per layer in bfloat16. `decode_kernel` instead is
a gather-by-block-table, a multiply-reduce, a masked softmax and a second multiply-reduce, which
inductor fuses into loops that index the cache in place: about 1.3 ms for the same layer. It is
compiled with dynamic batch and table width, so no batch composition recompiles it (`attend_decode`).

Faster still is asyncexec's own C++ kernel (`csrc/paged_decode.cpp`, built at start-up by `ops.build`; each
(row, KV head) a task, its query heads reading each key and value once, vectorized over the head size):
on a 2-core AMX Xeon, SmolLM2 in bfloat16, per layer with the cache in CPU caches: 1 row 19 us against
the inductor loop's 91-98 us; 32 rows of 16-384 tokens 224-251 us against 1,062-1,156 us (`run_kernel`,
the op `asyncexec::paged_decode`). With the cache in memory, as in a real step, keys and values are
prefetched a few positions ahead: 32 rows 381-430 us a layer, 561-640 us without. It serves float32
and bfloat16 caches with up to 8 query heads per KV head and a head size of 1, 2, 4, 8 or 16 vectors;
anything else, or a machine where it cannot build (a warning says why), or `ASYNCEXEC_PAGED_DECODE=0`
(`asyncexec.envs`: the graph runner then does not load it), runs `decode_kernel`.

In a compiled decode step (`graphs/cpu.py`), `attention._graph_decode` traces the KV write into the
decoder layer's graph (the caches are module buffers, mutated in place) and then calls the op, or traces
`decode_kernel` into the same graph, where inductor fuses the write, the rotary embedding and the
attention into one kernel. Mixed steps' decode rows call `attend_decode`: the C++ kernel, or
`decode_kernel` compiled on its own.

Shapes: `q [B, H, D]`; `key`, `value [B, Hkv, D]`; caches `[num_blocks, block_size, Hkv, D]`;
`block_tables [B, W]` (unused entries point at the null block; cut or padded to `decode_width`);
`seq_lens [B]`, the context length of each row including its new token. `window > 0` keeps only the
last `window` keys.
"""

from __future__ import annotations

import ctypes
import logging
import types
from collections.abc import Callable
from typing import Any

import torch

from asyncexec.ops.build import CSRC, CppKernel

__all__ = ["attend_decode", "decode_kernel", "decode_width", "load", "run_kernel", "serves"]

logger = logging.getLogger(__name__)

_compiled: dict[tuple[object, ...], Callable[..., torch.Tensor]] = {}
_KERNEL = CppKernel(
    CSRC / "paged_decode.cpp",
    "paged decode attention kernel",
    "decode attention runs the inductor-compiled one",
    logger,
)
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_MAX_GROUP = 8  # query heads per KV head (kMaxG)
_VECTORS = (1, 2, 4, 8, 16)  # head sizes the kernel serves, in vectors of `_width` floats
_fn: Any = None
_ready = False  # _fn is loaded (a plain bool, for dynamo to read while it traces `serves`)
_width = 0


def load() -> bool:
    """Build (or load from the disk cache) the C++ kernel, once per process; False where unavailable."""
    return _KERNEL.load(_setup) is not None


def _setup(lib: Any) -> Any:
    global _fn, _width, _ready
    fn = lib.asyncexec_paged_decode
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 7 + [ctypes.c_double] + [ctypes.c_int64] * 2
    _fn, _width, _ready = fn, int(lib.asyncexec_paged_decode_width()), True
    logger.info("paged decode attention kernel ready (%d-float vectors)", _width)
    return fn


def serves(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the loaded C++ kernel serves these shapes and dtypes (Python values only: traceable)."""
    h, (hkv, d) = q.shape[1], k_cache.shape[2:]
    return (
        _ready
        and q.device.type == "cpu"
        and q.dtype in _DTYPES
        and k_cache.dtype == q.dtype
        and h % hkv == 0
        and h // hkv <= _MAX_GROUP
        and d % _width == 0
        and d // _width in _VECTORS
    )


def run_kernel(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int,
) -> torch.Tensor:
    """`decode_kernel` by the C++ kernel (`serves` first): rows read at most `block_tables`' width."""
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.shape == k_cache.shape
    q = q.contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    b, h, d = q.shape
    out = torch.empty(b, h, d, dtype=q.dtype)
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    rc = _fn(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
        out.data_ptr(), _DTYPES[q.dtype], b, h, hkv, d, bs, tables.shape[1], scale, window,
        torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"paged decode kernel failed with code {rc} (q {tuple(q.shape)}, cache "
                           f"{tuple(k_cache.shape)}, {q.dtype})")  # fmt: skip
    return out


_lib = torch.library.Library("asyncexec", "FRAGMENT")  # type: ignore[no-untyped-call]
_lib.define(  # type: ignore[no-untyped-call]
    "paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
    "float scale, int window) -> Tensor"
)
_lib.impl("paged_decode", lambda *args: run_kernel(*args), "CPU")  # type: ignore[no-untyped-call]
_lib.impl(  # type: ignore[no-untyped-call]
    "paged_decode", lambda q, k, v, t, lens, scale, window: q.new_empty(q.shape), "Meta"
)


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
    """The C++ kernel where it `serves`; else `decode_kernel`, compiled, over the table width the
    longest row needs (`exact`: the caller, graph mode, already cut the tables to `decode_width` and
    made them contiguous: nothing to do per layer).

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
    if load() and serves(q, k_cache):
        return run_kernel(q, k_cache, v_cache, block_tables, seq_lens, scale, window)
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
