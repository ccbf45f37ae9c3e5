"""The op every packed linear runs: `asyncexec::packed_linear(x, weight, bias)` and its group form.

The module's `weight` is a stand-in whose data pointer keys `REGISTRY`, which holds what
`asyncexec.quantization.pack` packed for it (`PackedWeight`): a oneDNN-packed dense weight, int8 or int4
weights, or its group's share. The
compiled decoder layers see one opaque call per linear (a group's identical calls merged by
`DedupeGroupLinears`); eager forwards call `_linear` directly, without the dispatcher. `_matmul` picks
the kernel: int8 and int4 on AVX-512 VNNI run `int8_gemm` and `int4_gemm` at every size; otherwise, by
the step's rows, up to `INT8_MAX_ROWS` the quantized kernels, above the dense copy. In the batch-invariant
mode (`EngineConfig.batch_invariant`) a row's output must not depend on the step's other rows: bf16
weights run `bf16_gemm` (one order of sums for every M), int8 and int4 on VNNI their kernels (already so),
and anything else one row at a time (`rowwise`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from asyncexec.ops import bf16_gemm, int4_gemm, int8_gemm, int8_gemv

__all__ = [
    "INT4_GROUP",
    "INT8_MAX_ROWS",
    "REGISTRY",
    "DedupeGroupLinears",
    "LinearGroup",
    "PackedWeight",
    "group_forward",
    "linear_forward",
]

INT8_MAX_ROWS = 4
INT4_GROUP = 32  # inputs per scale and zero of PyTorch's int4 kernel (Q4_1's block)


@dataclass
class PackedWeight:
    dense: torch.Tensor | None = None  # oneDNN-packed, in dtype or float32 (None: int8 serves every size)
    plain: bool = False  # dense is the weight transposed, [K, N], for torch.mm (see quantization/pack.py)
    small: torch.Tensor | None = None  # upcast mode: the weight in dtype, for steps of few rows
    qweight: torch.Tensor | None = None  # int8 [N, K]
    scales: torch.Tensor | None = None  # [N], in dtype
    inv_s: torch.Tensor | None = None  # [K], in dtype: activation-aware int8 divides the input by `s`
    gemv: bool = False  # int8 rows run asyncexec's kernel (`int8_gemv`), else PyTorch's
    blocked: torch.Tensor | None = None  # int8 in `int8_gemm`'s layout: serves every step (no qweight;
    # then `scales` are [K / 32, N], one per channel and group of inputs)
    q4: torch.Tensor | None = None  # int4: PyTorch's kernel's packed weight (with a dense copy)
    sz: torch.Tensor | None = None  # int4: scales and zeros [K / INT4_GROUP, N, 2], in dtype
    nibbles: torch.Tensor | None = None  # int4 in `int4_gemm`'s layout: serves every step (no dense copy)
    d: torch.Tensor | None = None  # int4 (`int4_gemm`): scales [K / INT4_GROUP, N], bf16 (or a GGUF's fp16)
    mn: torch.Tensor | None = None  # int4 (`int4_gemm`): minimums, as d; None with d: Q4_0's -8 d
    bf16: torch.Tensor | None = None  # batch-invariant bf16 in `bf16_gemm`'s layout: serves every step
    rowwise: bool = False  # batch-invariant where no kernel above is: one row at a time (slower)
    bias: torch.Tensor | None = None  # a group's concatenated bias (a lone linear's comes with the call)
    group: LinearGroup | None = None  # set on a member of a group: its columns of the group's output start
    start: int = 0  # at `start` (and are as many as its stand-in weight's rows)


@dataclass
class LinearGroup:
    """Projections that read the same input (q/k/v, gate/up), packed as one weight: the first member
    called on an input runs the one GEMM, the others take their columns of it."""

    packed: PackedWeight
    members: frozenset[int]  # each member's first column
    x: torch.Tensor | None = None  # the input the pending output was computed from (held: the object
    # cannot be replaced by another at its address; inference tensors have no version counter to check)
    out: torch.Tensor | None = None
    pending: set[int] = field(default_factory=set)

    def output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if self.x is x and index in self.pending:
            self.pending.discard(index)
        else:
            self.x = x
            self.out = _matmul(x, self.packed, self.packed.bias)
            self.pending = set(self.members) - {index}
        out = self.out
        assert out is not None
        if not self.pending:
            self.x = self.out = None
        return out


REGISTRY: dict[int, PackedWeight] = {}

_lib = torch.library.Library("asyncexec", "FRAGMENT")  # type: ignore[no-untyped-call]
_lib.define("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")  # type: ignore[no-untyped-call]


def _matmul(x: torch.Tensor, p: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if p.bf16 is not None:  # batch-invariant bf16: one kernel, one order of sums, for every step
        return bf16_gemm.run(x2.contiguous(), p.bf16, bias)
    if p.rowwise and x2.shape[0] > 1:  # batch-invariant without such a kernel: each row as a step of one
        return torch.cat([_dispatch(x2[i : i + 1], p, bias) for i in range(x2.shape[0])])
    return _dispatch(x2, p, bias)


def _dispatch(x2: torch.Tensor, p: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    y: torch.Tensor
    if p.blocked is not None:  # int8 on AVX-512 VNNI: one kernel for every step
        assert p.scales is not None
        y = int8_gemm.run(x2.contiguous(), p.blocked, p.scales, p.inv_s)
        return y if bias is None else y + bias
    if p.nibbles is not None:  # int4 on AVX-512 VNNI: the same
        assert p.d is not None  # mn None: Q4_0's symmetric codes
        y = int4_gemm.run(x2.contiguous(), p.nibbles, p.d, p.mn)
        return y if bias is None else y + bias
    if p.dense is None or x2.shape[0] <= INT8_MAX_ROWS:
        if p.q4 is not None:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.contiguous(), p.q4, INT4_GROUP, p.sz)
            return y if bias is None else y + bias
        if p.qweight is not None:
            assert p.scales is not None
            xq = x2.contiguous() if p.inv_s is None else x2 * p.inv_s
            # without a dense copy int8 serves every size; asyncexec's kernel takes 1-4 rows, so a step
            # with no row to sample (a chunked prefill's first chunks) reaches the lm_head with 0
            if p.gemv and 0 < x2.shape[0] <= INT8_MAX_ROWS:
                y = int8_gemv.run(xq, p.qweight, p.scales)  # admitted by `fits` at load
            else:
                y = torch.ops.aten._weight_int8pack_mm(xq, p.qweight, p.scales)
            return y if bias is None else y + bias
        if p.small is not None:
            return torch.nn.functional.linear(x2, p.small, bias)
    assert p.dense is not None
    if p.plain:
        return torch.mm(x2, p.dense) if bias is None else torch.addmm(bias, x2, p.dense)
    if p.dense.dtype == x2.dtype:
        return torch.ops.mkldnn._linear_pointwise(x2, p.dense, bias, "none", [], "")  # type: ignore[no-any-return]
    b32 = None if bias is None else bias.float()  # added before the one rounding, as bf16's matmul does
    return torch.ops.mkldnn._linear_pointwise(x2.float(), p.dense, b32, "none", [], "").to(x2.dtype)  # type: ignore[no-any-return]


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    p = REGISTRY[weight.data_ptr()]
    # a group member (eager): its columns of the group's one GEMM, a view
    n = weight.shape[0]
    y = _matmul(x, p, bias) if p.group is None else p.group.output(x, p.start)[:, p.start : p.start + n]
    out: torch.Tensor = y if x.dim() == 2 else y.view(*x.shape[:-1], n)
    return out


def _packed_linear_group(x: torch.Tensor, key: torch.Tensor, width: int) -> torch.Tensor:
    group = REGISTRY[key.data_ptr()].group
    assert group is not None
    y = _matmul(x, group.packed, group.packed.bias)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], width)


def _packed_linear_meta(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


_lib.impl("packed_linear", _linear, "CPU")  # type: ignore[no-untyped-call]
_lib.impl("packed_linear", _packed_linear_meta, "Meta")  # type: ignore[no-untyped-call]
# a group's whole output: each member's compiled forward calls it and slices its columns; the layer
# graph's pass (`DedupeGroupLinears`) merges the identical calls into one
_lib.define("packed_linear_group(Tensor x, Tensor key, int width) -> Tensor")  # type: ignore[no-untyped-call]
_lib.impl("packed_linear_group", _packed_linear_group, "CPU")  # type: ignore[no-untyped-call]
_lib.impl(  # type: ignore[no-untyped-call]
    "packed_linear_group", lambda x, key, width: x.new_empty(*x.shape[:-1], width), "Meta"
)


_OP = torch.ops.asyncexec.packed_linear.default
# inductor caches graphs by this pass: what it merges depends on how both files build the ops
_SOURCE_HASH = get_hash_for_files((__file__, str(Path(__file__).parents[1] / "quantization" / "pack.py")))
_GROUP_OP = torch.ops.asyncexec.packed_linear_group.default


def linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():  # one opaque op in the layer graph
        return _OP(x, self.weight, self.bias)  # type: ignore[no-any-return]
    return _linear(x, self.weight, self.bias)  # eager: no dispatcher


def group_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():
        start: int = self.group_start  # type: ignore[assignment]
        y = _GROUP_OP(x, self.group_key, self.group_width)
        return y[..., start : start + self.out_features]  # type: ignore[no-any-return]
    return _linear(x, self.weight, None)


class DedupeGroupLinears(CustomGraphPass):
    """Inductor post-grad pass: the identical `packed_linear_group` calls of a group's members become
    one (inductor does not merge identical opaque calls itself)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        seen: dict[tuple[object, ...], torch.fx.Node] = {}
        for node in list(graph.nodes):
            if node.target is not _GROUP_OP:
                continue
            first = seen.setdefault((*node.args, *node.kwargs.items()), node)
            if first is not node:
                node.replace_all_uses_with(first)
                graph.erase_node(node)

    def uuid(self) -> bytes:  # inductor's cache key: this file's contents
        return _SOURCE_HASH
