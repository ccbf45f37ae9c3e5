"""`asyncexec::paged_attention_rows`: the attention of every row of a compiled mixed step, one opaque op.

The layer graph of a mixed or prefill step (`worker/graphs/cpu.py`) traces the KV write and then
calls this op, so that no batch composition reaches the graph (it would recompile for every new one). The
op finds the step's prefill chunks and decode tables by its slot mapping's data pointer, in metadata the
worker registers for the step's forward: its CPU kernel is the worker's (`worker/attention.py` calls
`register_cpu_kernel`). Here: the schema and the fake kernel that tracing needs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["register_cpu_kernel"]

_lib = torch.library.Library("asyncexec", "FRAGMENT")  # type: ignore[no-untyped-call]
_lib.define(  # type: ignore[no-untyped-call]
    "paged_attention_rows(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slot_mapping, float? scaling, "
    "int window) -> Tensor"
)
_lib.impl(  # type: ignore[no-untyped-call]
    "paged_attention_rows", lambda q, k, v, slots, scaling, window: q.new_empty(q.shape), "Meta"
)


def register_cpu_kernel(fn: Callable[..., torch.Tensor]) -> None:
    """Make `fn(q, k_cache, v_cache, slot_mapping, scaling, window)` the op's CPU kernel (once)."""
    _lib.impl("paged_attention_rows", fn, "CPU")  # type: ignore[no-untyped-call]
