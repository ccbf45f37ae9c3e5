"""CUDA graphs for uniform decode batches.

Capture: for every size in `capture_sizes`, largest first and sharing one memory pool, one graph of the
whole forward over static buffers (input ids, positions, slot mapping, block tables padded to
`max_blocks_per_seq`, sequence lengths). Replay: pad the batch to the smallest captured size that fits
(an O(1) table), with padded rows writing to the reserved null block and attending one masked token,
copy the inputs into the static buffers, replay, and keep the rows that sample. Mixed batches, larger
batches and `enforce_eager` run eager.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from asyncexec.worker.attention import AttentionMetadata
from asyncexec.worker.input_batch import NULL_BLOCK

if TYPE_CHECKING:
    from asyncexec.worker.input_batch import InputBatch, PreparedBatch

__all__ = ["CUDAGraphRunner"]

logger = logging.getLogger(__name__)


class CUDAGraphRunner:
    """CUDA graphs of the model's forward, one per decode batch size; built by the `ModelRunner` that
    owns it (`capture_model`), from what it needs of it."""

    guard_free = False  # (a CPU graph runner's stat)

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        input_batch: InputBatch,
        sizes: list[int],
    ) -> None:
        dev = kv_caches[0][0].device
        max_b = max(sizes)
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes, reverse=True)  # captured largest first, into one pool
        self.block_size = input_batch.block_size
        self.null_block = NULL_BLOCK
        self.input_ids = torch.zeros(max_b, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_b, dtype=torch.int64, device=dev)
        self.slots = torch.full((max_b,), self.null_block * self.block_size, dtype=torch.int64, device=dev)
        self.block_tables = torch.full(
            (max_b, input_batch.max_blocks_per_seq), self.null_block, dtype=torch.int64, device=dev
        )
        self.seq_lens = torch.ones(max_b, dtype=torch.int64, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        self.padded = [0] * (max_b + 1)
        for n in range(1, max_b + 1):
            self.padded[n] = min(s for s in sizes if s >= n)

    @torch.inference_mode()
    def capture(self) -> CUDAGraphRunner:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for b in self.sizes:
            self._forward(b)  # warm-up: lazy initialisation must not happen inside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(b)
            self.graphs[b] = (graph, out)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        logger.info(
            "captured %d CUDA graphs (sizes %s) in %.2f s", len(self.sizes), self.sizes, self.capture_seconds
        )
        return self

    def _forward(self, b: int) -> torch.Tensor:
        md = AttentionMetadata(self.kv_caches, self.slots[:b], b, self.block_tables[:b], self.seq_lens[:b])
        out: Any = self.model(
            input_ids=self.input_ids[:b][None],
            position_ids=self.positions[:b][None],
            use_cache=False,
            logits_to_keep=0,
            attn_metadata=md,
        )
        return out.logits[0]  # type: ignore[no-any-return]

    def replay(self, batch: PreparedBatch) -> torch.Tensor | None:
        """Logits of the rows that sample, or None where no captured graph fits this batch."""
        n = batch.num_decodes
        if n >= len(self.padded):
            return None
        b = self.padded[n]
        width = batch.decode_block_tables.shape[1]
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.slots[:n].copy_(batch.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(batch.decode_seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(batch.decode_block_tables, non_blocking=True)
        self.block_tables[:n, width:].fill_(self.null_block)
        self.slots[n:b].fill_(self.null_block * self.block_size)
        self.seq_lens[n:b].fill_(1)
        self.block_tables[n:b].fill_(self.null_block)
        graph, out = self.graphs[b]
        graph.replay()
        return out[batch.logits_indices.to(out.device, non_blocking=True)]
