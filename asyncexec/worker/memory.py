"""The worker process's own memory: what it gives back to the OS after its start-up."""

from __future__ import annotations

import contextlib
import ctypes

import torch

__all__ = ["own_weights", "trim_heap"]


def trim_heap() -> None:
    """Give the C heap's free pages back to the OS. glibc keeps freed memory for reuse, so a load whose
    peak (bf16 weights, a calibration forward, packing) was freed still counted as resident; `malloc_trim`
    returns it. A no-op where the C library has no `malloc_trim`."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


@torch.no_grad()
def own_weights(model: torch.nn.Module) -> int:
    """Copy the model's remaining CPU parameters (what packing did not replace: norms, embeddings) out of
    the checkpoint's memory map into the process's own memory; returns the bytes copied.

    transformers maps safetensors files and, where the dtype matches, keeps the mapped tensors as the
    parameters. Every page packing or quantization read then stays resident, file-backed, for as long as
    one tensor of the file lives: measured on a 1B llama, 2.4 GB of the file after packing (the whole
    checkpoint) beside the packed weights. Copied, the last references go and the mapping with them. A
    Parameter tied to two modules stays one object (its `.data` is replaced)."""
    copied = 0
    for p in model.parameters():
        if p.device.type == "cpu" and not hasattr(p, "to_local") and p.untyped_storage().nbytes() > 0:
            p.data = p.data.clone()
            copied += p.numel() * p.element_size()
    return copied
