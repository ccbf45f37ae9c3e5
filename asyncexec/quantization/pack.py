"""Prepacked linear layers on CPU: oneDNN-packed bf16 weights, and opt-in int8 weight-only quantization.

Both replace an `nn.Linear`'s forward by the op `asyncexec::packed_linear(x, weight, bias)`, which the
compiled decoder layers see as one opaque call and eager forwards call directly:
- **Prepacked bf16** (graph mode on CPU): the weight is reordered once into oneDNN's blocked layout
  (`mkldnn._reorder_linear_weight`) instead of on every matmul, as inductor's `freezing` does for
  constants. Our layer graph is shared by every layer, so weights are graph inputs, not constants, and
  freezing cannot apply; the op reads the packed weight from a registry instead.
- **int8** (`EngineConfig(quantization="int8")`): every linear, lm_head included, is quantized at load,
  in each worker after tensor-parallel sharding, symmetric. On AVX-512 VNNI: llama.cpp's Q8_0 (a scale
  per output channel and group of 32 inputs), quantized straight into asyncexec's int8 GEMM's layout
  (`quantization.blocked`), one copy that serves every step (`int8_gemm`, activations quantized per row
  and group of 32 in the kernel). Elsewhere: one scale per output channel with activation-aware
  input-channel scales (`quantization.int8`: the input is divided by them); steps of at most
  `INT8_MAX_ROWS` rows (a lone stream, a few streams) run asyncexec's int8 GEMV (`int8_gemv`; PyTorch's
  `aten._weight_int8pack_mm` where it cannot be built), bigger steps a packed bf16 copy of the
  dequantized weights (those kernels are slower than the packed bf16 GEMM from 8 rows up): there int8
  trades memory for speed. The KV cache and the logits stay in bf16; int8 needs dtype bfloat16.
- **int4** (`quantization="int4"`, `quantization.int4`): Q4_1 blocks of 32 inputs. On AVX-512 VNNI every
  step runs asyncexec's int4 GEMM (`int4_gemm`, W4A8) on the one 4-bit copy; elsewhere PyTorch's int4
  kernel serves up to `INT8_MAX_ROWS` rows and a dense copy more. The lm_head stays int8.
- **A tied embedding** (int8, int4) reads its rows from the lm_head's int8 weight
  (`quantization.embedding`): the table is stored once.

- **float32: packed or plain, whichever is faster here.** Which float32 layout multiplies faster depends
  on the CPU: on a 2-core AVX-512 EPYC the packed weights took 0.3-0.77x the time of `nn.Linear`, on a
  2-core AMX Xeon `torch.mm` on the transposed weight took 0.58x the packed time at one row, 0.87x at
  32 and 0.97-1.02x at 64-1,024 (all of SmolLM2's linears), which made the mixed workload 3-7% faster.
  So `pack_linears` times both on the model's widest linear at 1 and 32 rows (`plain_float32_is_faster`,
  tens of ms, logged) and keeps the plain layout only where it wins at both.
- **float32 GEMMs for bf16 on CPUs without oneDNN bf16** (AVX2 only, no AVX-512 or AMX): PyTorch's bf16
  matmul there is a slow fallback whose cost grows with the rows (measured on a 2-core AVX2 EPYC, all of
  SmolLM2's linears: 22 ms at 1 row, 147 ms at 8, 571 ms at 32; float32 149 ms at 32). Steps of at most
  `INT8_MAX_ROWS` rows keep the bf16 weights (a lone stream reads half the bytes), bigger ones run a
  oneDNN-packed float32 copy on upcast activations, with the output in bf16 again. This costs memory: the
  bf16 weights plus a float32 copy (with int8: int8 plus the float32 copy of the dequantized weights).

The module's `weight` parameter becomes a stand-in: a stride-0 tensor of the weight's shape on a storage of
one element (its data pointer keys the registry), so the layer graph keeps one shape per projection and
the dense weight's memory is freed (a tied lm_head's embedding keeps its own).
"""

from __future__ import annotations

import logging
import statistics
import time
import types
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from asyncexec import envs
from asyncexec.config import QUANTIZATIONS
from asyncexec.errors import ConfigError
from asyncexec.ops import bf16_gemm, int8_gemv
from asyncexec.ops.packed_linear import (
    INT8_MAX_ROWS,
    REGISTRY,
    LinearGroup,
    PackedWeight,
    group_forward,
)
from asyncexec.quantization import int4, int8
from asyncexec.quantization.blocked import (
    Release,
    RowSource,
    blocked_int4,
    blocked_int8,
    int4_from,
    int8_from,
)
from asyncexec.quantization.embedding import read_from, share_tied_embedding
from asyncexec.quantization.install import find_groups, replace_linear
from asyncexec.quantization.int4 import int4_fits, quantize_int4
from asyncexec.quantization.int8 import dequantize, quantize_weight

__all__ = [
    "INT8_MAX_ROWS",
    "SUPPORTED_QUANTIZATION",
    "can_pack",
    "check_quantization",
    "pack_linears",
    "plain_float32_is_faster",
    "quantize_weight",
]

logger = logging.getLogger(__name__)

SUPPORTED_QUANTIZATION = QUANTIZATIONS  # checked once, by EngineConfig


def check_quantization(method: str | None, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse, before any weight is touched, what the int8 and int4 kernels do not run on."""
    if method is None:
        return
    if device.type != "cpu":
        raise ConfigError(
            f"quantization={method!r} runs on CPU only (PyTorch's {method} weight-pack kernel); this rank's "
            f"device is {device.type}. Use quantization=None there."
        )
    if dtype != torch.bfloat16:
        raise ConfigError(
            f"quantization={method!r} needs dtype='bfloat16' (its kernel takes bf16 activations; with "
            f"float32 ones it is slower than the float32 weights), got {str(dtype).removeprefix('torch.')}"
        )


def can_pack(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs and multiplies `dtype` weights on this CPU (bf16 needs AVX-512 or AMX)."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return dtype == torch.float32


class SourceLike(RowSource, Protocol):
    """A quantized source with its form: "int4" or "int8" (`gguf.weights.GGUFWeight`)."""

    @property
    def form(self) -> str: ...


def _keep(w: torch.Tensor) -> None:
    """The default `release`: nothing to give back."""


def _pack(
    w: torch.Tensor,
    quantization: str | None,
    pack_dense: bool,
    upcast: bool,
    s: torch.Tensor | None = None,
    lm_head: bool = False,
    plain: bool = False,
    release: Release = _keep,
    invariant: bool = False,
) -> PackedWeight:
    if invariant and quantization is None and bf16_gemm.fits(w):  # one bf16 copy, one order of sums
        return PackedWeight(bf16=bf16_gemm.pack(w))
    packed = PackedWeight()
    if quantization == "int4" and not lm_head and int4.gemm_serves(w):
        return blocked_int4(w, release)  # one 4-bit copy serves every step
    if quantization == "int4" and not lm_head and int4_fits(w):
        packed.q4, packed.sz, dequantized = quantize_int4(w)
        w = dequantized.to(w.dtype)  # what int4 rows compute with
    elif quantization is not None:  # int8, and int4's lm_head and linears of odd widths
        if int8.gemm_serves(w):  # one int8 copy serves every step, a scale per group (Q8_0)
            return blocked_int8(w, s, release)
        packed.inv_s = None if s is None else (1.0 / s).to(w.dtype)
        packed.qweight, packed.scales = quantize_weight(w, s)
        packed.gemv = envs.int8_gemv_enabled() and int8_gemv.fits(packed.qweight, packed.scales)
        w = dequantize(packed.qweight, packed.scales, s).to(w.dtype)  # what int8 rows compute with
    elif upcast or (invariant and not pack_dense):  # (no oneDNN here: the invariant mode's rows, one by one)
        packed.small = w.contiguous()
    if pack_dense and plain:
        packed.dense, packed.plain = w.t().contiguous(), True
    elif pack_dense:
        packed.dense = torch.ops.mkldnn._reorder_linear_weight(w.float() if upcast else w, 1)
    return packed


def _batch_invariant(packed: PackedWeight, invariant: bool) -> PackedWeight:
    """`packed` for the batch-invariant mode: its kernel where that kernel's sums do not depend on the
    step's rows (bf16's `bf16_gemm`, int8's and int4's VNNI GEMMs), else one row at a time."""
    packed.rowwise = invariant and packed.bf16 is None and packed.blocked is None and packed.nibbles is None
    return packed


PROBE_ROWS = (1, 32)  # a lone stream and a full decode batch


def plain_float32_is_faster(weight: torch.Tensor, reps: int = 9) -> tuple[bool, str]:
    """Whether `torch.mm` on the transposed float32 weight (MKL's or oneDNN's plain GEMM) beats oneDNN's
    packed layout on this CPU at every `PROBE_ROWS`, timed on `weight`'s shape; and the timings, said."""
    w = torch.randn(weight.shape, dtype=torch.float32)
    packed, plain = torch.ops.mkldnn._reorder_linear_weight(w, 1), w.t().contiguous()
    said, faster = [], True
    for m in PROBE_ROWS:
        x = torch.randn(m, w.shape[1])
        times = []
        for packed_layout in (True, False):
            t = []
            for _ in range(3 + reps):  # 3 to warm up
                start = time.perf_counter()
                if packed_layout:
                    torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
                else:
                    torch.mm(x, plain)
                t.append(time.perf_counter() - start)
            times.append(statistics.median(t[3:]) * 1e3)
        faster = faster and times[1] < times[0]
        said.append(f"{m} rows {times[1]:.3f} ms plain vs {times[0]:.3f} ms packed")
    return faster, ", ".join(said)


@dataclass(frozen=True)
class _Layout:
    """How this CPU multiplies the model's dense weights: packed by oneDNN (`pack_dense`), through a
    float32 copy (`upcast`, no GEMM of the dtype), or float32 in the plain layout (`plain`, faster)."""

    pack_dense: bool
    upcast: bool
    plain: bool


def _choose_layout(
    model: torch.nn.Module, head: Any, quantization: str | None, pack_dense: bool, invariant: bool = False
) -> _Layout | None:
    """The layout for `model`'s weights on this CPU; None where there is nothing to do."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    upcast = pack_dense and not can_pack(dtype) and dtype != torch.float32 and can_pack(torch.float32)
    if upcast:
        logger.info("oneDNN has no %s GEMM on this CPU: steps of more than %d rows multiply in float32 "
                    "(a float32 copy of the weights)", dtype, INT8_MAX_ROWS)  # fmt: skip
    elif pack_dense and not can_pack(dtype):
        pack_dense = False  # int8 then serves every size; without int8 there is nothing to do
        logger.info("oneDNN cannot pack %s weights on this CPU: linears stay as they are", dtype)
        if quantization is None and not invariant:
            return None
    plain = False
    if pack_dense and dtype == torch.float32 and quantization is None:
        widest = max((m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head),
                     key=lambda w: w.numel(), default=None)  # fmt: skip
        if widest is not None:
            plain, said = plain_float32_is_faster(widest)
            logger.info("float32 linears keep the %s layout on this CPU (%s, a %dx%d weight)",
                        "plain" if plain else "oneDNN-packed", said, *widest.shape)  # fmt: skip
    return _Layout(pack_dense, upcast, plain)


class _PackStats(dict[str, int]):
    """What `pack_linears` did: linears, groups, int4 weights, bytes before and after, plain layout."""

    def __init__(self) -> None:
        super().__init__(linears=0, groups=0, int4=0, bytes_before=0, bytes_after=0)

    def count(self, w: torch.Tensor, p: PackedWeight, share: float = 1.0) -> None:
        """`share`: a group member's part of the group's weights."""
        self["bytes_before"] += w.numel() * w.element_size()
        tensors = (p.dense, p.small, p.qweight, p.blocked, p.scales, p.inv_s, p.q4, p.sz, p.nibbles,
                   p.d, p.mn, p.bf16)  # fmt: skip
        self["bytes_after"] += int(
            share * sum(t.numel() * t.element_size() for t in tensors if t is not None)
        )
        self["int4"] += p.q4 is not None or p.nibbles is not None


@torch.no_grad()
def pack_linears(
    model: torch.nn.Module,
    quantization: str | None,
    pack_dense: bool = True,
    input_scales: Mapping[torch.nn.Linear, torch.Tensor] | None = None,
    release: Release | None = None,
    sources: Mapping[torch.nn.Module, SourceLike] | None = None,
    batch_invariant: bool = False,
) -> dict[str, int]:
    """Route every `nn.Linear` of `model` through `asyncexec::packed_linear`; returns what it did.
    `input_scales`: int8's activation-aware scales per linear (`quantization.int8.activation_scales`).
    `release`: called with each original weight once it is packed (the worker drops its pages from the
    checkpoint's memory map: the load's peak then holds one weight of it at a time).
    `sources`: weights already quantized (a GGUF file's, `gguf.loader`), by module: those linears (and
    embeddings) take them as they are, whatever `quantization` says of the others.
    `batch_invariant`: every linear's output row independent of the step's other rows
    (`EngineConfig.batch_invariant`): bf16 weights in `bf16_gemm`'s layout, and one row at a time where
    no such kernel serves (counted in the result's `rowwise`)."""
    done = release or _keep
    act = input_scales or {}
    kept = dict(sources or {})
    if quantization is not None and not envs.int8_gemv_enabled():
        logger.info("ASYNCEXEC_INT8_GEMV=0: int8 steps use PyTorch's _weight_int8pack_mm")
    stats = _PackStats()
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    layout = _choose_layout(model, head, quantization, pack_dense, batch_invariant)
    if layout is None:
        return dict(stats)
    stats["plain"] = int(layout.plain)
    head_weight = head.weight if isinstance(head, torch.nn.Linear) else None
    for members in find_groups(model):
        inside = [m in kept for m in members]
        if all(inside) and len({kept[m].form for m in members}) == 1:
            _pack_group(members, quantization, layout, act, stats, kept, batch_invariant)
        elif not any(inside):
            for w in _pack_group(members, quantization, layout, act, stats, None, batch_invariant):
                done(w)
        # else: some kept, some not, or of two forms: each member is packed on its own below
    packed_sources: dict[int, PackedWeight] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, torch.nn.Linear) or not isinstance(weight, torch.nn.Parameter):
            continue
        w = weight.detach()
        if hasattr(w, "to_local"):  # a DTensor of transformers' tensor parallelism: this rank's shard
            w = w.to_local()
        if module in kept:
            packed = packed_sources[id(kept[module])] = _pack_source(kept[module])
        else:
            bias_ok = module.bias is None or module.bias.dtype == w.dtype
            packed = _pack(w, quantization, layout.pack_dense, layout.upcast, act.get(module),
                           lm_head=module is head, plain=layout.plain, release=done,
                           invariant=batch_invariant and bias_ok)  # fmt: skip
        _batch_invariant(packed, batch_invariant)
        stats["rowwise"] = stats.get("rowwise", 0) + packed.rowwise
        replace_linear(module, packed)
        stats.count(w, packed)
        stats["linears"] += 1
        done(w)
    get_embedding = getattr(model, "get_input_embeddings", None)
    embedding = get_embedding() if callable(get_embedding) else None
    if isinstance(embedding, torch.nn.Embedding) and embedding in kept:  # a GGUF file's quantized table
        src = kept[embedding]
        tied = packed_sources.get(id(src))
        stats["embedding_freed"] = read_from(embedding, tied if tied is not None else _pack_source(src))
    elif quantization is not None and head_weight is not None and embedding is not None:
        assert head is not None
        freed = share_tied_embedding(embedding, head_weight, REGISTRY[head.weight.data_ptr()])
        if freed:
            stats["embedding_freed"] = freed
            logger.info("the tied embedding reads its rows from the lm_head's int8 weight: %.1f MiB freed",
                        freed / 2**20)  # fmt: skip
    if stats["linears"] == 0 and quantization is not None and not kept:
        raise ConfigError(
            f"quantization={quantization!r}: {type(model).__name__} has no nn.Linear to quantize"
        )
    logger.info("packed %d linears, %d groups of them as one weight (quantization %s): %.1f MiB of weights "
                "-> %.1f MiB", stats["linears"], stats["groups"], quantization, stats["bytes_before"] / 2**20,
                stats["bytes_after"] / 2**20)  # fmt: skip
    return dict(stats)


def _pack_source(src: SourceLike) -> PackedWeight:
    """A weight already quantized, in its GEMM's layout (`gguf.weights` says which serve here)."""
    packed = int4_from(src) if src.form == "int4" else int8_from(src)
    src.done()
    return packed


def _pack_group(
    members: list[torch.nn.Linear],
    quantization: str | None,
    layout: _Layout,
    act: Mapping[torch.nn.Linear, torch.Tensor],
    stats: _PackStats,
    kept: Mapping[torch.nn.Module, SourceLike] | None = None,
    invariant: bool = False,
) -> list[torch.Tensor]:
    """Sibling linears of one input (q/k/v, gate/up) as one packed weight, each member a slice of it;
    returns the members' original weights. `kept`: the members' quantized sources, stacked.
    `invariant`: the batch-invariant mode's form (`pack_linears`)."""
    ws = [m.weight.detach() for m in members]
    s = act.get(members[0])
    shared = all(act.get(m) is s for m in members)  # siblings' scales come from their one input
    if kept is not None:
        from asyncexec.gguf.weights import StackedWeight

        parts: list[Any] = [kept[m] for m in members]  # gguf.weights.GGUFWeight
        group_packed = _pack_source(StackedWeight(parts))
    else:
        group_packed = _pack(torch.cat(ws), quantization, layout.pack_dense, layout.upcast,
                             s if shared else None, plain=layout.plain, invariant=invariant)  # fmt: skip
    _batch_invariant(group_packed, invariant)
    stats["rowwise"] = stats.get("rowwise", 0) + group_packed.rowwise
    if members[0].bias is not None:
        group_packed.bias = torch.cat([m.bias.detach() for m in members if m.bias is not None])
    starts = [sum(w.shape[0] for w in ws[:i]) for i in range(len(ws))]
    group = LinearGroup(group_packed, frozenset(starts))
    key = torch.zeros(1, dtype=ws[0].dtype)  # the group's one input to the compiled layer graph
    REGISTRY[key.data_ptr()] = PackedWeight(group=group)
    weakref.finalize(key, REGISTRY.pop, key.data_ptr(), None)
    width = sum(w.shape[0] for w in ws)
    for mod, w, start in zip(members, ws, starts, strict=True):
        replace_linear(mod, PackedWeight(group=group, start=start))
        mod.register_buffer("group_key", key, persistent=False)
        setattr(mod, "group_width", width)  # noqa: B010
        setattr(mod, "group_start", start)  # noqa: B010
        mod.forward = types.MethodType(group_forward, mod)  # type: ignore[method-assign]
        stats.count(w, group_packed, w.shape[0] / width)
    stats["linears"] += len(members)
    stats["groups"] += 1
    return ws
