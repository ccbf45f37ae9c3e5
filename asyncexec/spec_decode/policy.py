"""Which requests speculate in a step, how many draft tokens each proposes, and the `spec_decode` counters.

Adaptive, so that speculation does not cost the streams it does not help:
- **per request**: a request starts at `num_speculative_tokens`. A verify step that accepted `a` drafts
  sets its next length to `a + 1` (one more than what was accepted, up to the limit). It also keeps a
  running mean of accepted drafts per verify step (each step weighs half); while that mean is below
  `MIN_ACCEPTED` (0.5), the request skips proposing for the next 1, 2, 4, ... 32 steps (doubling with
  each further step below it, reset once it is above). A verify step costs 1.2-1.5 plain decode steps
  on 2 cores (it runs the mixed-step graph, with dynamo's guards, and attends like a prefill chunk), so it
  pays for itself from about 0.3-0.5 accepted drafts; a stream whose text does not repeat itself soon
  stops paying for lookups that miss, while one that copies keeps its drafts long;
- **per batch**: while more than `disable_by_batch_size` requests are running, no request proposes: a
  batch that large is bound by compute rather than by reading the weights, where extra query rows cost
  about what they would cost as other streams' tokens (`docs/design.md`, "Speculative decoding").

Counters (vLLM's `spec_decode` names): drafts (verify steps of a request), draft tokens, accepted tokens,
accepted tokens per draft position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from asyncexec.spec_decode.config import SpeculativeConfig
from asyncexec.spec_decode.ngram import NgramProposer

__all__ = ["SpecDecodePolicy", "SpecDecodeStats"]

MAX_BACKOFF_STEPS = 32
MIN_ACCEPTED = 0.5  # accepted drafts per verify step (running mean) below which a request backs off


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens per draft token proposed (0-1)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verify step produced per request on average: 1 + accepted drafts (vLLM's)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict[str, float]:
        """The counters as `engine.stats()` keys (accepted tokens per draft position: one key each)."""
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_acceptance_rate": self.acceptance_rate,
            "spec_decode_mean_acceptance_length": self.mean_acceptance_length,
            **{f"spec_decode_num_accepted_tokens_pos_{i}": n for i, n in enumerate(self.accepted_per_pos)},
        }


@dataclass
class _RequestState:
    length: int  # the most drafts it proposes next
    skip: int = 0  # steps left before it proposes again
    misses: int = 0  # verify steps in a row that left the running mean below MIN_ACCEPTED
    accepted: float = 1.0  # running mean of accepted drafts per verify step (optimistic start)


class SpecDecodePolicy:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._reqs: dict[str, _RequestState] = {}

    def enabled_for_batch(self, num_running: int) -> bool:
        limit = self.config.disable_by_batch_size
        return limit is None or num_running <= limit

    def propose(self, req_id: str, token_ids: Sequence[int], limit: int) -> list[int]:
        """Draft tokens for a decoding request (at most `limit`: what its budget, `max_tokens` and the
        model length leave); [] while it backs off or nothing matches."""
        st = self._reqs.get(req_id)
        if st is None:
            st = self._reqs[req_id] = _RequestState(self.config.num_speculative_tokens)
        if st.skip:
            st.skip -= 1
            return []
        return self.proposer.propose(token_ids, min(st.length, limit))

    def record(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verify step's outcome for one request: adapt its draft length, count it."""
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            s.accepted_per_pos[i] += 1
        st = self._reqs.get(req_id)
        if st is None:
            return
        st.length = min(self.config.num_speculative_tokens, num_accepted + 1)
        st.accepted = 0.5 * st.accepted + 0.5 * num_accepted
        if st.accepted < MIN_ACCEPTED:
            st.skip = min(1 << st.misses, MAX_BACKOFF_STEPS)
            st.misses += 1
        else:
            st.misses = 0

    def forget(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)
