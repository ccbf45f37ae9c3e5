"""Prompt logprobs, computed on the worker from a prefill chunk's rows and gathered to top-k there.

The logits of the row at position `p` score the token at `p + 1`, so a chunk covering positions
`[c, end)` of a request with a `P`-token prompt scores prompt tokens `c + 1 .. min(end, P - 1)`; the
row at `P - 1` is the one that samples, and is not scored here. Those rows are appended to the step's
`logits_indices` (after the sampling rows, whose order the sampler relies on); `gather` then turns their
logits into `PromptLogprobs` (the actual token's logprob and rank, then the top-k), a few hundred
slices at a time, so that only `[rows, k + 1]` leaves this process, never `[rows, vocab]`.

Flat layout: `PreparedBatch.req_ids` lists the step's requests in the order their scheduled tokens
are laid out, so a request's first row is the sum of the scheduled tokens before it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from asyncexec.messages import PromptLogprobs, SchedulerOutput
from asyncexec.worker.input_batch import CachedRequestState, PreparedBatch

__all__ = ["PromptLogprobsRows"]

# Rows log-softmaxed at once: 25 MB of float32 for a 49k vocabulary, under glibc's 32 MB mmap threshold,
# so each slice reuses heap pages instead of faulting in fresh ones.
_SLICE_ROWS = 128


@dataclass
class _Span:
    req_id: str
    start: int  # the position of the first prompt token scored
    num_rows: int
    top_k: int


@dataclass
class PromptLogprobsRows:
    """The extra logits rows one step keeps for prompt logprobs, and who they belong to."""

    spans: list[_Span]
    rows: torch.Tensor  # flat row indices, spans in order
    targets: torch.Tensor  # the token each row scores

    @classmethod
    def build(
        cls,
        so: SchedulerOutput,
        batch: PreparedBatch,
        requests: Mapping[str, CachedRequestState],
        num_prompt_tokens: Mapping[str, int],
    ) -> PromptLogprobsRows | None:
        """The rows of this step's prefill chunks that score prompt tokens, or None if no one asks."""
        spans: list[_Span] = []
        rows: list[int] = []
        targets: list[int] = []
        offset = 0
        for rid in batch.req_ids:
            n = so.num_scheduled_tokens[rid]
            st = requests[rid]
            k = st.sampling_params.prompt_logprobs
            if k is not None:
                c = st.num_computed_tokens
                last = min(c + n, num_prompt_tokens.get(rid, len(st.token_ids)) - 1)
                if last > c:
                    spans.append(_Span(rid, c + 1, last - c, k))
                    rows.extend(range(offset, offset + last - c))
                    targets.extend(st.token_ids[c + 1 : last + 1])
            offset += n
        if not spans:
            return None
        return cls(spans, torch.tensor(rows, dtype=torch.int64), torch.tensor(targets, dtype=torch.int64))

    def extend(self, batch: PreparedBatch) -> PreparedBatch:
        """`batch` keeping these rows' logits too, after the sampling rows."""
        indices = torch.cat([batch.logits_indices, self.rows])
        return dataclasses.replace(batch, logits_indices=indices)

    def gather(self, logits: torch.Tensor) -> dict[str, PromptLogprobs]:
        """`logits` holds these rows' logits, in order: each span's logprobs, ranks and top-k."""
        k = max(s.top_k for s in self.spans)
        ids, vals, ranks = [], [], []
        targets = self.targets.to(logits.device)
        for a in range(0, logits.shape[0], _SLICE_ROWS):
            lp = logits[a : a + _SLICE_ROWS].float().log_softmax(dim=-1)
            tgt = targets[a : a + _SLICE_ROWS, None]
            chosen = lp.gather(1, tgt)
            ranks.append((lp > chosen).sum(dim=-1) + 1)
            if k > 0:
                top = lp.topk(min(k, lp.shape[-1]), dim=-1)
                ids.append(torch.cat([tgt, top.indices], dim=1))
                vals.append(torch.cat([chosen, top.values], dim=1))
            else:
                ids.append(tgt)
                vals.append(chosen)
        all_ids, all_vals = torch.cat(ids).cpu().tolist(), torch.cat(vals).cpu().tolist()
        all_ranks = torch.cat(ranks).cpu().tolist()
        out: dict[str, PromptLogprobs] = {}
        at = 0
        for s in self.spans:
            end, w = at + s.num_rows, s.top_k + 1
            out[s.req_id] = PromptLogprobs(
                s.start,
                [r[:w] for r in all_ids[at:end]],
                [r[:w] for r in all_vals[at:end]],
                all_ranks[at:end],
            )
            at = end
        return out
