"""`Request`: the engine's record of one sequence, as vLLM V1's `vllm/v1/request.py` keeps it.

Besides its tokens it gathers what the workers send back for it: the logprobs of each sampled token
(and their running sum, which `best_of` ranks by), and its prompt logprobs, which arrive chunk by chunk
over a chunked prefill, possibly again after a preemption recomputes them (a position already filled
is kept, not overwritten).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from asyncexec.messages import Logprobs, PromptLogprobs
from asyncexec.sampling_params import SamplingParams

__all__ = ["Request", "RequestStatus"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    known_to_workers: bool = False
    finish_reason: str | None = None
    # vLLM's: the stop string or stop token id that ended the request (None for EOS or a length stop).
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    # One entry per prompt position (None for the first, which nothing scores): {token id: logprob}
    # for the actual token and the top-k, and the actual token's rank.
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    prompt_logprob_ranks: list[int | None] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float = 0.0
    # A `StructuredOutputRequest` where the request's output is constrained (structured outputs).
    structured_output_request: Any = None

    @property
    def waiting_for_grammar(self) -> bool:
        """True while the request's grammar is still compiling: it waits in the queue, unscheduled."""
        so = self.structured_output_request
        return so is not None and not so.is_ready

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def append_output(self, toks: list[int], logprobs: Logprobs | None, row: int) -> None:
        """Add a step's sampled tokens, with their logprobs where the request asked for them."""
        self.output_token_ids.extend(toks)
        k = self.sampling_params.logprobs
        if logprobs is not None and k is not None:
            ids, vals = logprobs.token_ids[row][: k + 1], logprobs.logprobs[row][: k + 1]
            self.logprobs.append(dict(zip(ids, vals, strict=True)))
            self.cumulative_logprob += vals[0]  # entry 0 is the sampled token

    def truncate_output(self, num_tokens: int) -> None:
        """Keep the first `num_tokens` output tokens (a stop string found inside a speculative step's
        tokens ends the request there), with their logprobs."""
        for tok, lp in zip(self.output_token_ids[num_tokens:], self.logprobs[num_tokens:], strict=False):
            self.cumulative_logprob -= lp[tok]
        del self.output_token_ids[num_tokens:]
        del self.logprobs[num_tokens:]

    def add_prompt_logprobs(self, plp: PromptLogprobs) -> None:
        """Fill the positions `plp` scores; positions already filled (a recompute) are kept."""
        n = len(self.prompt_token_ids)
        if not self.prompt_logprobs:
            self.prompt_logprobs = [None] * n
            self.prompt_logprob_ranks = [None] * n
        for i, (ids, vals, rank) in enumerate(zip(plp.token_ids, plp.logprobs, plp.ranks, strict=True)):
            pos = plp.start + i
            if 0 < pos < n and self.prompt_logprobs[pos] is None:
                self.prompt_logprobs[pos] = dict(zip(ids, vals, strict=True))
                self.prompt_logprob_ranks[pos] = rank
