"""What the engine hands back for a request, step by step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = ["FinishReason", "RequestOutput"]

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass
class RequestOutput:
    """A request's state after a step: every token so far, the ones this step added, and the text.

    `text` is the text that may be shown so far: while a stop string could still be completing, its
    possible beginning is held back; it only grows, and once `finished` it is the final text (cut at a
    matched stop string). `logprobs`, when asked for, holds one `{token_id: logprob}` per generated token
    (the sampled token and the top-n), and `cumulative_logprob` their sum for the sampled tokens.
    `prompt_logprobs` (with `SamplingParams.prompt_logprobs`) holds one entry per prompt token, None for
    the first, and `prompt_logprob_ranks` the rank of each actual prompt token. `stop_reason` is the stop
    string or stop token id that ended the request (None for EOS), as in vLLM.

    With `n > 1` a request's outputs carry its `request_id` and each copy's `index` (0..n-1); a copy's
    last output has `finished` set, and the request is over once every copy's is in.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    text: str | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    logprobs: list[dict[int, float]] | None = field(default=None)
    stop_reason: int | str | None = None
    index: int = 0
    cumulative_logprob: float | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None
