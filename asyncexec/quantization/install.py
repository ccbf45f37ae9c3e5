"""How packed weights take the place of transformers' linears: the weight becomes a stand-in that keys
`REGISTRY`, the forward goes through `asyncexec::packed_linear`; and which sibling projections share one
packed weight.

The stand-in is a stride-0 tensor of the weight's shape on a storage of one element (its data pointer keys
the registry), so the layer graph keeps one shape per projection and the dense weight's memory is freed.
"""

from __future__ import annotations

import types
import weakref

import torch

from asyncexec.errors import ConfigError
from asyncexec.ops.packed_linear import REGISTRY, PackedWeight, linear_forward

__all__ = ["GROUPS", "find_groups", "replace_linear", "stand_in"]


def stand_in(weight: torch.Tensor) -> torch.Tensor:
    return torch.zeros(1, dtype=weight.dtype, device=weight.device).expand(*weight.shape)


GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # siblings that read one input


def find_groups(model: torch.nn.Module) -> list[list[torch.nn.Linear]]:
    """Sibling projections of one input (Llama, Qwen2, Mistral naming), packed as one weight. Not under
    tensor parallelism (each call has its own wrapper), and only where all or none have a bias."""
    found = []
    for mod in model.modules():
        for names in GROUPS:
            lins = [getattr(mod, n, None) for n in names]
            if not all(type(m) is torch.nn.Linear for m in lins):
                continue
            members: list[torch.nn.Linear] = lins  # type: ignore[assignment]
            if (
                len({m.in_features for m in members}) == 1
                and len({m.bias is None for m in members}) == 1
                and all("forward" not in m.__dict__ and not hasattr(m.weight, "to_local") for m in members)
            ):
                found.append(members)
    return found


def replace_linear(mod: torch.nn.Linear, packed: PackedWeight) -> None:
    """The weight becomes the stand-in keying `packed`; the module's forward goes through the op."""
    w = mod.weight.detach()
    held = stand_in(w.to_local() if hasattr(w, "to_local") else w)
    key = held.data_ptr()
    REGISTRY[key] = packed
    weakref.finalize(held, REGISTRY.pop, key, None)
    del mod.weight  # a tied lm_head only drops its reference: the embedding keeps the tensor
    mod.register_buffer("weight", held, persistent=False)
    _install(mod)


def _install(mod: torch.nn.Linear) -> None:
    """Make the op's `linear_forward` the linear's forward. Under transformers' tensor parallelism the
    module's forward is a wrapper that makes inputs local, hides a rowwise bias and all-reduces the output
    around the forward it captured at load: that captured forward is replaced, so the wrapper stays."""
    ours = types.MethodType(linear_forward, mod)
    tp_forward = mod.__dict__.get("forward")
    if tp_forward is None:
        mod.forward = ours  # type: ignore[method-assign]
        return
    cells = dict(zip(tp_forward.__code__.co_freevars, tp_forward.__closure__ or (), strict=True))
    if "original_forward" not in cells:
        raise ConfigError(
            f"cannot pack {type(mod).__name__}: its forward is wrapped by {tp_forward.__qualname__}, which "
            "asyncexec does not know; use enforce_eager=True and no quantization"
        )
    cells["original_forward"].cell_contents = ours
