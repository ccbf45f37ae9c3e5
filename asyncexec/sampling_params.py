"""Per-request sampling parameters, validated at construction.

A msgspec Struct, so that it travels inside `NewRequestData` as a typed, array-like value and is
validated again when a worker decodes it.
"""

from __future__ import annotations

import msgspec

from asyncexec.errors import InvalidRequestError

# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-5

__all__ = ["SamplingParams"]


class SamplingParams(
    msgspec.Struct, frozen=True, kw_only=True, array_like=True, gc=False, forbid_unknown_fields=True
):
    """How to sample one request's tokens.

    `temperature == 0` is greedy. `top_k <= 0`, `top_p == 1` and `min_p == 0` disable those filters.
    `seed` makes sampling reproducible per request, on every rank and every run. `logprobs=n` returns the
    top-n log-probabilities of every sampled position (the engine allows at most `max_logprobs`).
    Integers must fit in 64 bits.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k):
            raise InvalidRequestError(f"top_k must be an integer (<= 0 disables it), got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise InvalidRequestError(f"seed must be an integer or None, got {self.seed!r}")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise InvalidRequestError(
                f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}"
            )
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise InvalidRequestError(f"logprobs must be an integer >= 0 or None, got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax: `temperature` below `GREEDY_TEMPERATURE` (as vLLM does),
        where dividing the logits by it would overflow float32 (1e-38 made every probability NaN)."""
        return self.temperature < GREEDY_TEMPERATURE


def _is_int(value: object) -> bool:
    """An int that fits the wire's 64 bits (a bigger one could not be sent to the workers)."""
    return isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
