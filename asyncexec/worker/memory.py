"""The worker process's own memory: what it gives back to the OS during and after its start-up.

transformers maps safetensors files and, where the dtype matches, keeps the mapped tensors as the model's
parameters. Every page of the file that the load then reads (packing, quantization) stays resident,
file-backed, for as long as the mapping lives: measured on a 1B llama, the whole 2.4 GB checkpoint after
packing, beside the packed weights, and the load's peak was that plus the packed copy. So:
- each weight's pages are dropped as soon as it is packed (`drop_file_pages`, `MADV_DONTNEED`): the
  page cache keeps them, this process no longer counts them, and a later read faults them in again from
  the file (the mapping is private and the weights are not written);
- after packing, the parameters packing did not replace are copied out of the mapping (`own_weights`),
  except embedding tables: those stay mapped with their pages dropped, so only the rows that lookups
  read come back (a bf16 tied embedding is otherwise held twice: in the table and in the packed lm_head);
- the C heap's free pages go back to the OS (`trim_heap`).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import functools
import mmap

import torch

__all__ = ["FileMappings", "drop_file_pages", "drop_range", "own_weights", "trim_heap"]

_MADV_DONTNEED = 4


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def trim_heap() -> None:
    """Give the C heap's free pages back to the OS. glibc keeps freed memory for reuse, so a load whose
    peak (bf16 weights, a calibration forward, packing) was freed still counted as resident; `malloc_trim`
    returns it. A no-op where the C library has no `malloc_trim`."""
    with contextlib.suppress(OSError, AttributeError):
        _libc().malloc_trim(0)


MAPPED_WEIGHTS = (".safetensors", ".gguf")  # checkpoint files whose mappings hold weights


class FileMappings:
    """This process's mappings of checkpoint files (`MAPPED_WEIGHTS`) that it cannot write: private
    (transformers' safetensors) or read-only (gguf's memory map); read once from /proc/self/maps."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int]] = []
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if (
                    len(fields) == 6
                    and (fields[1].endswith("p") or fields[1][1] == "-")
                    and fields[5].strip().endswith(MAPPED_WEIGHTS)
                ):
                    lo, hi = (int(a, 16) for a in fields[0].split("-"))
                    self.ranges.append((lo, hi))
        self.ranges.sort()

    def holds(self, start: int, end: int) -> bool:
        i = bisect.bisect_right(self.ranges, (start, 1 << 64)) - 1
        return i >= 0 and self.ranges[i][0] <= start and end <= self.ranges[i][1]


def drop_file_pages(t: torch.Tensor, mappings: FileMappings | None = None) -> int:
    """Drop from this process the whole pages of `t`'s bytes if they lie in an unwritable mapping of a
    checkpoint file (else nothing: anonymous memory would read back as zeros); returns the bytes
    dropped. `mappings`: read once for many tensors (the maps do not change while weights are packed)."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
        return 0
    start = t.data_ptr()
    return drop_range(start, start + t.numel() * t.element_size(), mappings)


def drop_range(start: int, end: int, mappings: FileMappings | None = None) -> int:
    """`drop_file_pages` for the bytes [start, end) (a numpy view of a memory map)."""
    if end <= start or not (mappings or FileMappings()).holds(start, end):
        return 0
    lo = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages only: a neighbour's may be in use
    hi = end // mmap.PAGESIZE * mmap.PAGESIZE
    if hi <= lo:
        return 0
    if _libc().madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED) != 0:
        return 0
    return hi - lo


@torch.no_grad()
def own_weights(model: torch.nn.Module) -> int:
    """Copy the model's remaining CPU parameters (what packing did not replace: norms, biases) out of the
    checkpoint's memory map into the process's own memory, and drop the pages of embedding tables, which
    stay mapped; returns the bytes copied. A Parameter tied to two modules stays one object."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    mappings = FileMappings()
    copied = 0
    for p in model.parameters():
        if p.device.type != "cpu" or hasattr(p, "to_local") or p.untyped_storage().nbytes() == 0:
            continue
        if id(p) in tables and drop_file_pages(p, mappings):
            continue
        if mappings.holds(p.data_ptr(), p.data_ptr() + 1):
            mapped = p.data
            p.data = mapped.clone()
            drop_file_pages(mapped, mappings)  # the copy read them; a kept table keeps the mapping alive
            copied += p.numel() * p.element_size()
    return copied
