"""What a model folder must satisfy before its weights load: a known context length, and a tensor-parallel
split that divides every dimension it cuts."""

from __future__ import annotations

from typing import Any

from asyncexec.errors import ConfigError

__all__ = ["SPLIT_DIMS", "check_tensor_parallel", "model_max_len"]


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
