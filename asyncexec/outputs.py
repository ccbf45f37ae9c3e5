"""What the engine hands back for a request, step by step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = ["FinishReason", "RequestOutput"]

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass
class RequestOutput:
    """A request's state after a step: every token so far, the ones this step added, and the text.

    `logprobs`, when asked for, holds one `{token_id: logprob}` per generated token (the sampled token
    and the top-n).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    text: str | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    logprobs: list[dict[int, float]] | None = field(default=None)
