"""Sampling: logit processing (bias, min_tokens, bad words, penalties), then greedy, temperature, top-k,
top-p, min-p, per-request seeds, and top-n logprobs.

Logprobs are those of the raw logits (vLLM V1's default), so a penalty changes which token is chosen,
not the reported distribution. Greedy rows are processed too: a penalty changes their argmax.

Every rank runs the same code on the same logits, so every rank samples the same tokens. A seeded
request draws from a generator seeded by `(seed, position)`: its tokens are the same on every rank, on
every run, and after a preemption or a restart, whatever else shares the batch. Unseeded requests draw
from the worker's generator, seeded from `config.seed` at start-up.

Structured outputs: the step's `grammar_bitmask` (from the engine, the same on every rank) masks its
requests' rows after the other processors, greedy rows included, in one vectorized operation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncexec.errors import ProtocolError
from asyncexec.messages import Logprobs, SchedulerOutput
from asyncexec.sampling_params import SamplingParams
from asyncexec.worker.logits_processors import apply_grammar_bitmask, apply_logits_processors

__all__ = ["Sampler"]

_MIX = 0x9E3779B97F4A7C15


def _position_seed(seed: int, position: int) -> int:
    return ((seed * _MIX) ^ (position * 0xBF58476D1CE4E5B9)) & 0x7FFF_FFFF_FFFF_FFFF


class Sampler:
    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        # Where each request's prompt ends: its token list also holds the output (and, for a request
        # sent again to new workers, the output so far as part of what arrived as its prompt).
        self.num_prompt_tokens: dict[str, int] = {}
        # This step's structured-output mask: a row of `grammar_bitmask` per id.
        self.grammar_rows: dict[str, int] = {}
        self.grammar_bitmask: torch.Tensor | None = None

    def update_states(self, so: SchedulerOutput) -> None:
        """Track the prompt lengths of the requests this rank holds, from a step's deltas."""
        for rid in so.finished_req_ids:
            self.num_prompt_tokens.pop(rid, None)
        for new in so.scheduled_new_reqs:
            n = new.num_prompt_tokens
            self.num_prompt_tokens[new.req_id] = (
                n if 0 <= n <= len(new.prompt_token_ids) else len(new.prompt_token_ids)
            )
        ids, mask = so.structured_output_request_ids, so.grammar_bitmask
        if ids and (
            mask is None or mask.dtype != torch.int32 or mask.dim() != 2 or mask.shape[0] != len(ids)
        ):
            shape = None if mask is None else (tuple(mask.shape), mask.dtype)
            raise ProtocolError(f"grammar_bitmask {shape} does not have one int32 row per id of {len(ids)}")
        self.grammar_rows = {rid: i for i, rid in enumerate(ids)}
        self.grammar_bitmask = mask if ids else None

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        positions: list[int],
        token_ids: Sequence[Sequence[int]] | None = None,
        num_prompt_tokens: Sequence[int] | None = None,
        req_ids: Sequence[str] | None = None,
    ) -> tuple[list[int], Logprobs | None]:
        """Sample one token per row of `logits [N, V]`; `positions[i]` is the index of row i's new token,
        and `token_ids[i]` its tokens so far, the first `num_prompt_tokens[i]` being the prompt (needed
        only for rows with penalties, `min_tokens` or bad words); `req_ids[i]` is row i's request, which
        this step's grammar bitmask (from `update_states`) is matched with."""
        raw = logits.float().cpu()
        n = max((p.logprobs or 0 for p in params if p.logprobs is not None), default=-1)
        if any(p.logit_bias or p.needs_history for p in params):
            logits = apply_logits_processors(raw.clone(), params, token_ids, num_prompt_tokens)
        else:
            logits = raw
        if self.grammar_bitmask is not None and req_ids is not None:
            pairs = [(i, self.grammar_rows[r]) for i, r in enumerate(req_ids) if r in self.grammar_rows]
            if pairs:
                logits = logits.clone() if logits is raw and n >= 0 else logits  # raw gives the logprobs
                apply_grammar_bitmask(logits, self.grammar_bitmask, pairs)
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = torch.tensor(random_rows)
            probs = self._probs(logits[rows], [params[i] for i in random_rows])
            tokens[rows] = self._draw(
                probs, [params[i] for i in random_rows], [positions[i] for i in random_rows]
            )
        sampled = tokens.tolist()
        return sampled, (self._logprobs(raw, tokens, n) if n >= 0 else None)

    @staticmethod
    def _probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        temp = torch.tensor([p.temperature for p in params])[:, None]
        logits = logits / temp
        vocab = logits.shape[-1]
        top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
        top_p = torch.tensor([p.top_p for p in params])
        min_p = torch.tensor([p.min_p for p in params])
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab)[None, :]
        drop = ranks >= top_k[:, None]
        sorted_probs = sorted_logits.softmax(dim=-1)
        drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]  # keep the first past top_p
        drop |= sorted_probs < min_p[:, None] * sorted_probs[:, :1]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        filtered = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
        return filtered.softmax(dim=-1)

    def _draw(self, probs: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> torch.Tensor:
        """Exponential race: argmax(p / E) with E ~ Exp(1) samples from p."""
        noise = torch.empty_like(probs)
        for i, (p, pos) in enumerate(zip(params, positions, strict=True)):
            gen = (
                self.generator
                if p.seed is None
                else torch.Generator().manual_seed(_position_seed(p.seed, pos))
            )
            noise[i].exponential_(generator=gen)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, n: int) -> Logprobs:
        logp = logits.log_softmax(dim=-1)
        chosen = logp.gather(1, tokens[:, None])
        ranks = (logp > chosen).sum(dim=-1) + 1
        n = min(n, logp.shape[-1])  # the engine caps logprobs; never let one request fail a step
        top = logp.topk(n, dim=-1) if n > 0 else None
        ids = tokens[:, None] if top is None else torch.cat([tokens[:, None], top.indices], dim=1)
        vals = chosen if top is None else torch.cat([chosen, top.values], dim=1)
        return Logprobs(ids.tolist(), vals.tolist(), ranks.tolist())
