"""The persistent batch: what a worker keeps of every request between steps, updated from deltas.

`update_states` applies one `SchedulerOutput`: finished requests are dropped, preempted ones lose their
blocks (their tokens stay), new requests arrive in full, and cached ones get their new blocks, computed
count and any tokens this worker does not have. Each worker appends the tokens it samples itself, so a
decode step carries no token ids at all.

`prepare` turns the scheduled requests into the step's flat inputs, written into preallocated buffers:
decode rows (one token) first, then prefill chunks, in the scheduler's order within each group.

Speculative decoding: a request with draft tokens (`scheduled_spec_decode_tokens`) has 1 + k query tokens,
its last sampled token and the drafts, and keeps logits at all of them (`sample_counts`), which verify
the drafts. Each of its tokens is a decode row of its own (its position, the request's block table, a
length that ends at it): so the step stays a decode step, which graph mode replays (the rows' K/V are
written before any row attends, so each sees the drafts before it). The drafts are not added to its
tokens: the runner appends the ones its sampler accepted.

Batch-invariant mode (`decode_rows_only`, `EngineConfig.batch_invariant`): every token is a decode row,
prefill chunks' too, so each token attends through the one decode kernel, its keys summed in one order
whether it arrives in a chunk of any size, a decode step or a verify row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from asyncexec.errors import ProtocolError
from asyncexec.messages import SchedulerOutput
from asyncexec.sampling_params import SamplingParams

__all__ = ["DECODE_GROUP", "NULL_BLOCK", "CachedRequestState", "InputBatch", "PreparedBatch"]

# vLLM's convention: block 0 is never handed out by the scheduler. Padded graph rows write there.
NULL_BLOCK = 0

# Decode rows are attended in groups of this many, sorted by length: padding a group only to its own
# longest row cuts the gather and SDPA work of a batch of mixed lengths about in half (2 CPU cores).
DECODE_GROUP = 8


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    spec_token_ids: list[int] = field(default_factory=list)  # this step's draft tokens


@dataclass
class PreparedBatch:
    """One step's inputs; tensors are views of the batch's buffers (valid until the next prepare)."""

    req_ids: list[str]
    num_tokens: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    num_decodes: int
    decode_block_tables: torch.Tensor
    decode_seq_lens: torch.Tensor
    prefills: list[tuple[int, int, int]]
    prefill_block_ids: list[torch.Tensor]
    logits_indices: torch.Tensor
    sample_rows: list[int]  # rows of req_ids that produce a token this step
    sample_counts: list[int]  # logits rows of each of them, in order (1, or 1 + its draft tokens)
    decode_buckets: list[tuple[int, int, int]]  # (first row, end row, blocks needed) per decode group


class InputBatch:
    def __init__(
        self,
        max_num_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        max_decode_rows: int | None = None,
        decode_rows_only: bool = False,
    ) -> None:
        """`max_decode_rows`: decode rows a step may hold (`max_num_seqs`; more with speculative decoding,
        where a request has a row per draft). `decode_rows_only`: every token a decode row (the
        batch-invariant mode)."""
        self.block_size = block_size
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.decode_rows_only = decode_rows_only
        self.requests: dict[str, CachedRequestState] = {}
        self._drafted: list[str] = []  # the requests that hold this step's draft tokens
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.int64)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64)
        self.slot_mapping = torch.zeros(max_num_tokens, dtype=torch.int64)
        rows = max_num_tokens if decode_rows_only else min(max_decode_rows or max_num_seqs, max_num_tokens)
        self.block_tables = torch.zeros(rows, max_blocks_per_seq, dtype=torch.int64)
        self.seq_lens = torch.zeros(rows, dtype=torch.int64)
        self.logits_indices = torch.zeros(max_num_tokens, dtype=torch.int64)
        # numpy views of the buffers, written row by row in `prepare`
        self._ids, self._pos, self._slots = (
            self.input_ids.numpy(),
            self.positions.numpy(),
            self.slot_mapping.numpy(),
        )
        self._tables, self._seq_lens = self.block_tables.numpy(), self.seq_lens.numpy()
        self._logits_idx = self.logits_indices.numpy()

    def update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        for rid in so.preempted_req_ids:
            if rid in self.requests:
                self.requests[rid].block_ids = []
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState(
                new.req_id,
                list(new.prompt_token_ids),
                new.sampling_params,
                list(new.block_ids),
                new.num_computed_tokens,
            )
        c = so.scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            st = self.requests.get(rid)
            if st is None:
                raise ProtocolError(
                    f"scheduler output names cached request {rid!r}, which this worker never saw"
                )
            st.num_computed_tokens = c.num_computed_tokens[i]
            if c.resumed_from_preemption[i]:
                st.block_ids = list(c.new_block_ids[i])
            else:
                st.block_ids.extend(c.new_block_ids[i])
            st.token_ids.extend(c.new_token_ids[i])
        for rid in self._drafted:  # last step's drafts are spent
            if rid in self.requests:
                self.requests[rid].spec_token_ids = []
        self._drafted = list(so.scheduled_spec_decode_tokens)
        for rid, drafts in so.scheduled_spec_decode_tokens.items():
            st = self.requests.get(rid)
            n = so.num_scheduled_tokens.get(rid, 0)
            if st is None or n != 1 + len(drafts) or st.num_computed_tokens != len(st.token_ids) - 1:
                have = (
                    "unknown"
                    if st is None
                    else f"{st.num_computed_tokens} of its {len(st.token_ids)} tokens computed"
                )
                raise ProtocolError(
                    f"request {rid!r}: {len(drafts)} draft tokens in a row of {n} tokens, {have} (drafts "
                    "need a decoding request and one row of 1 + drafts tokens)"
                )
            st.spec_token_ids = list(drafts)

    def prepare(self, so: SchedulerOutput) -> PreparedBatch:
        sched = so.num_scheduled_tokens
        order = self._order(so)
        t, max_blocks, num_decodes = 0, 1, 0
        prefills: list[tuple[int, int, int]] = []
        prefill_blocks: list[torch.Tensor] = []
        sample_rows: list[int] = []
        sample_counts: list[int] = []
        num_logits = 0
        for row, rid in enumerate(order):
            n = sched[rid]
            st = self._scheduled_state(rid, n)
            end = st.num_computed_tokens + n
            drafts = st.spec_token_ids
            if drafts:
                self._ids[t] = st.token_ids[-1]
                self._ids[t + 1 : t + n] = drafts
            else:
                self._ids[t : t + n] = st.token_ids[st.num_computed_tokens : end]
            if n == 1 or drafts:  # a decode row per token (a verify row's tokens each attend alone)
                for j in range(n):
                    max_blocks = max(max_blocks, self._write_decode(num_decodes, t + j, st, j))
                    num_decodes += 1
            elif self.decode_rows_only:  # a chunk's tokens each a decode row too
                max_blocks = max(max_blocks, self._write_chunk_rows(num_decodes, t, n, st))
                num_decodes += n
            else:
                prefills.append((t, n, end))
                prefill_blocks.append(self._write_prefill(t, n, st))
            if end == len(st.token_ids) + len(drafts):
                m = 1 + len(drafts)  # a verify row keeps the logits of every position
                self._logits_idx[num_logits : num_logits + m] = np.arange(t + n - m, t + n)
                num_logits += m
                sample_rows.append(row)
                sample_counts.append(m)
            t += n
        return PreparedBatch(
            order,
            t,
            self.input_ids[:t],
            self.positions[:t],
            self.slot_mapping[:t],
            num_decodes,
            self.block_tables[:num_decodes, :max_blocks],
            self.seq_lens[:num_decodes],
            prefills,
            prefill_blocks,
            self.logits_indices[:num_logits],
            sample_rows,
            sample_counts,
            self._decode_groups(num_decodes, max_blocks),
        )

    def _order(self, so: SchedulerOutput) -> list[str]:
        """The step's rows: decoding requests (one token, or one and its drafts) first, shortest first,
        then prefill chunks."""
        sched = so.num_scheduled_tokens
        drafts = so.scheduled_spec_decode_tokens
        rows = sum(n for r, n in sched.items() if n == 1 or r in drafts or self.decode_rows_only)
        if (
            len(sched) > self.max_num_seqs
            or so.total_num_scheduled_tokens > self.max_num_tokens
            or rows > len(self.seq_lens)
        ):
            raise ProtocolError(
                f"step schedules {len(sched)} requests / {so.total_num_scheduled_tokens} tokens / {rows} "
                f"decode rows, over max_num_seqs={self.max_num_seqs} / max_num_batched_tokens="
                f"{self.max_num_tokens} / {len(self.seq_lens)} rows"
            )
        reqs = self.requests
        decodes = [r for r, n in sched.items() if n == 1 or r in drafts]
        decodes.sort(key=lambda r: reqs[r].num_computed_tokens if r in reqs else 0)
        return decodes + [r for r, n in sched.items() if n > 1 and r not in drafts]

    def _scheduled_state(self, rid: str, n: int) -> CachedRequestState:
        """The state of a request scheduled for `n` tokens, which must have those tokens and blocks."""
        st = self.requests.get(rid)
        if st is None:
            raise ProtocolError(f"request {rid!r} is scheduled but unknown to this worker")
        c, bs = st.num_computed_tokens, self.block_size
        need = -(-(c + n) // bs)
        if (
            c + n > len(st.token_ids) + len(st.spec_token_ids)
            or need > len(st.block_ids)
            or need > self.max_blocks_per_seq
        ):
            raise ProtocolError(
                f"request {rid!r}: {n} tokens scheduled after {c} computed, but it has "
                f"{len(st.token_ids)} tokens and {len(st.block_ids)} blocks of {bs}"
            )
        return st

    def _write_decode(self, row: int, t: int, st: CachedRequestState, j: int = 0) -> int:
        """A decode row's position, slot, block table and length (the request's token `j` of this step:
        0, or a draft's); returns the blocks it needs."""
        c, bs = st.num_computed_tokens + j, self.block_size
        need = -(-(c + 1) // bs)
        self._pos[t] = c
        self._slots[t] = st.block_ids[c // bs] * bs + c % bs
        self._tables[row, :need] = st.block_ids[:need]
        self._seq_lens[row] = c + 1
        return need

    def _write_chunk_rows(self, row: int, t: int, n: int, st: CachedRequestState) -> int:
        """A prefill chunk as `n` decode rows from `row` on: each token's position, slot, the request's
        block table and a length that ends at it; returns the blocks its last token needs."""
        c, bs = st.num_computed_tokens, self.block_size
        need = -(-(c + n) // bs)
        p = np.arange(c, c + n)
        blocks = np.asarray(st.block_ids[:need], dtype=np.int64)
        self._pos[t : t + n] = p
        self._slots[t : t + n] = blocks[p // bs] * bs + p % bs
        self._tables[row : row + n, :need] = blocks  # the columns past a row's length: `_decode_groups`
        self._seq_lens[row : row + n] = p + 1
        return need

    def _write_prefill(self, t: int, n: int, st: CachedRequestState) -> torch.Tensor:
        """A prefill chunk's positions and slots; returns the blocks it attends to."""
        c, bs = st.num_computed_tokens, self.block_size
        need = -(-(c + n) // bs)
        p = np.arange(c, c + n)
        self._pos[t : t + n] = p
        self._slots[t : t + n] = np.asarray(st.block_ids[:need], dtype=np.int64)[p // bs] * bs + p % bs
        return torch.tensor(st.block_ids[:need], dtype=torch.int64)

    def _decode_groups(self, num_decodes: int, max_blocks: int) -> list[tuple[int, int, int]]:
        """Pad the decode rows' tables to `max_blocks` with block 0 (masked), and group the rows by
        DECODE_GROUP: (first row, end row, blocks the group's longest row needs)."""
        bs, seq_lens = self.block_size, self._seq_lens
        need = -(-seq_lens[:num_decodes] // bs)
        tables = self._tables[:num_decodes, :max_blocks]
        tables[np.arange(max_blocks)[None, :] >= need[:, None]] = NULL_BLOCK
        groups = []
        for s in range(0, num_decodes, DECODE_GROUP):
            e = min(s + DECODE_GROUP, num_decodes)
            # requests are sorted by length, but a verify row's drafts reach a little further than the
            # next request's row may: the group's widest row, not its last
            groups.append((s, e, -(-int(seq_lens[s:e].max()) // bs)))
        return groups

    def append_sampled(self, req_ids: list[str], tokens: list[list[int]]) -> None:
        """Each request's tokens of this step (one, or the accepted drafts and the token after them)."""
        for rid, toks in zip(req_ids, tokens, strict=True):
            self.requests[rid].token_ids.extend(toks)
