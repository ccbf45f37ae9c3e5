"""`SpeculativeConfig`: vLLM's `speculative_config`, the subset asyncexec implements (draft-free methods).

Given as a dict (`EngineConfig(speculative_config={"method": "ngram", ...})`, `--speculative-config
'{...}'` on the command line) or as this dataclass; an unknown method or key, or a value out of its
range, is refused naming it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from asyncexec.errors import ConfigError

__all__ = ["METHODS", "SpeculativeConfig"]

METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16  # a verify row of 1 + 16 tokens still costs about a decode row (2 cores)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding by n-gram prompt lookup (vLLM's `method: "ngram"`, llama.cpp's lookup).

    Fields:
        method: "ngram": each step, a decoding request proposes the tokens that followed the most recent
            earlier occurrence of its last n tokens (prompt and output), for n from `prompt_lookup_max`
            down to `prompt_lookup_min`; no draft model.
        num_speculative_tokens: the most draft tokens a request proposes in one step (1-16).
        prompt_lookup_max: the longest n-gram looked up.
        prompt_lookup_min: the shortest n-gram looked up (a shorter match proposes nothing).
        disable_by_batch_size: no request speculates in a step while more than this many requests are
            running (vLLM's name): a batch that large is no longer bound by reading the weights, so
            verifying drafts costs compute that plain decoding would spend on other streams. None
            never disables it.
    """

    method: Literal["ngram"] = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int | None = 4

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(
                f"speculative_config.method={self.method!r} is not supported; supported: {METHODS} "
                "(draft-model methods are not implemented)"
            )
        _check("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        _check("prompt_lookup_max", self.prompt_lookup_max, 1, 64)
        _check("prompt_lookup_min", self.prompt_lookup_min, 1, 64)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(
                f"speculative_config.prompt_lookup_min={self.prompt_lookup_min} is above "
                f"prompt_lookup_max={self.prompt_lookup_max}"
            )
        if self.disable_by_batch_size is not None:
            _check("disable_by_batch_size", self.disable_by_batch_size, 1, None)

    @classmethod
    def from_value(cls, value: object) -> SpeculativeConfig:
        """A `SpeculativeConfig` from itself or a dict of its fields; an unknown key is refused by name."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"speculative_config must be a dict such as {{'method': 'ngram', 'num_speculative_tokens': "
                f"4}}, got {value!r}"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            raise ConfigError(
                f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; known: "
                f"{', '.join(sorted(known))}"
            )
        kwargs: dict[str, Any] = dict(value)
        return cls(**kwargs)


def _check(name: str, value: object, lo: int, hi: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"speculative_config.{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise ConfigError(f"speculative_config.{name} must be {bound}, got {value}")
