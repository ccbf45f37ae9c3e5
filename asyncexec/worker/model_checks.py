"""What a model folder must satisfy before its weights load: an implementation that calls transformers'
attention interface, a known context length, and a tensor-parallel split that divides every dimension
it cuts."""

from __future__ import annotations

from typing import Any

from asyncexec.errors import ConfigError

__all__ = ["SPLIT_DIMS", "auto_dtype", "check_architecture", "check_tensor_parallel", "model_max_len"]

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def auto_dtype(path: str, hf_config: Any) -> str:
    """What `dtype="auto"` loads `path` in: a GGUF file in bfloat16 (the quantized GEMMs take bf16
    activations), or float32 where every tensor is F32; a folder in its config's dtype (float32 if it
    names none)."""
    from asyncexec.gguf.file import all_float32, is_gguf

    if is_gguf(path):
        return "float32" if all_float32(path) else "bfloat16"
    found = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    name = str(found).removeprefix("torch.") if found is not None else "float32"
    return name if name in DTYPE_NAMES else "float32"


def check_architecture(hf_config: Any, world_size: int) -> str:
    """The model's architecture name, once it is known to run here over `world_size` ranks."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    arch: str = (getattr(hf_config, "architectures", None) or [type(hf_config).__name__])[0]
    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(hf_config), None)
    if model_cls is None or not getattr(model_cls, "_supports_attention_backend", False):
        raise ConfigError(
            f"{arch} cannot run on asyncexec: its transformers implementation does not call the "
            "attention interface, so the paged KV cache cannot be plugged in"
        )
    if world_size > 1 and not getattr(hf_config, "base_model_tp_plan", None):
        raise ConfigError(
            f"{arch} cannot be split over {world_size} ranks: transformers has no tensor-parallel "
            "plan for it (base_model_tp_plan is empty); use tensor_parallel_size=1"
        )
    check_tensor_parallel(arch, hf_config, world_size)
    return arch


def model_max_len(hf_config: Any) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(hf_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ConfigError(f"cannot tell the context length of {type(hf_config).__name__}; set max_model_len")


# The dimensions transformers' tensor-parallel plans split across ranks (colwise/rowwise projections).
SPLIT_DIMS = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


def check_tensor_parallel(arch: str, hf_config: Any, world_size: int) -> None:
    """Refuse, before any weight is loaded, a split that does not divide every dimension it cuts."""
    if world_size == 1:
        return
    text = hf_config.get_text_config()
    dims = {n: getattr(text, n) for n in SPLIT_DIMS if isinstance(getattr(text, n, None), int)}
    bad = {n: v for n, v in dims.items() if v % world_size}
    if bad:
        shown = ", ".join(f"{n}={v}" for n, v in dims.items())
        raise ConfigError(
            f"{arch} cannot be split over tensor_parallel_size={world_size}: {shown}, and "
            f"{', '.join(bad)} must be divisible by {world_size}"
        )
