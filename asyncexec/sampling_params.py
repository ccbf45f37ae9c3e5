"""Per-request sampling parameters, validated at construction, with vLLM's field names.

A msgspec Struct, so that it travels inside `NewRequestData` as a typed, array-like value and is
validated again when a worker decodes it. Two fields are filled by the engine, not by callers:
`all_stop_token_ids` (the stop token ids plus EOS unless `ignore_eos`, which `min_tokens` masks) and
`bad_words_token_ids` (`bad_words` tokenized), so that the workers never need the tokenizer.

`structured_outputs` (vLLM's `StructuredOutputsParams`; `guided_decoding` is its older name, kept as an
alias) constrains the output to a JSON schema, any JSON object, a regex, one of a list of strings, or a
grammar. The engine compiles it and masks the logits every step; the workers see only the mask.
"""

from __future__ import annotations

import json
import math
import reprlib
from typing import Any

import msgspec

from asyncexec.errors import InvalidRequestError

# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-5
MAX_STOP_STRINGS = 8
# The longest stop string, in characters. Every step scans each stop string's prefixes against the end of
# the text (`detokenizer.held_back`), at a cost linear in its length (about 0.25 ms per 1,000 characters
# per request per step): 100,000 characters would stall every step. Stop strings in use are markers and
# phrases far shorter than this; vLLM sets no cap.
MAX_STOP_STRING_CHARS = 1000
# A bound on the copies one request may fan out to: each is a scheduled sequence of its own.
MAX_N = 128
# OpenAI's range for a logit bias; larger values are clamped to it, not refused.
LOGIT_BIAS_LIMIT = 100.0

__all__ = [
    "GREEDY_TEMPERATURE",
    "LOGIT_BIAS_LIMIT",
    "MAX_N",
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_CHARS",
    "GuidedDecodingParams",
    "SamplingParams",
    "StructuredOutputsParams",
    "check_token_ids_in_vocab",
]

_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


class StructuredOutputsParams(
    msgspec.Struct, frozen=True, kw_only=True, gc=False, forbid_unknown_fields=True
):
    """One constraint on a request's output, vLLM V1's fields: exactly one of `json` (a JSON schema, as a
    dict or a JSON string), `json_object` (any JSON object), `regex`, `choice` (a non-empty list of
    strings) and `grammar` (a Lark grammar, or GBNF/EBNF as llama.cpp writes it).

    JSON is written compactly by default (`", "` and `": "` between items and keys, no other
    whitespace), so that a sampling model cannot spend its tokens on blank lines; `whitespace_pattern`
    (a regex) sets the whitespace allowed between JSON tokens instead, and `disable_any_whitespace=False`
    allows any JSON whitespace there. `disable_additional_properties` forbids keys a schema's objects do
    not list (where the schema does not say). `disable_fallback` is accepted: there is one grammar engine
    (llguidance) and never a fallback. `structural_tag` is vLLM's, and not supported: it is refused.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = True
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                "structured_outputs: give exactly one of json, json_object, regex, choice and grammar, "
                f"got {given or 'none'}",
                param="structured_outputs",
            )
        if self.structural_tag is not None:
            raise InvalidRequestError(
                "structured_outputs.structural_tag is not supported", param="structural_tag"
            )
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except ValueError as e:
                raise InvalidRequestError(f"json: the schema is not valid JSON: {e}", param="json") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError("json: a schema must be a JSON object", param="json")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"{name} must be a non-empty string", param=name)
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise InvalidRequestError(
                f"choice must be a non-empty list of strings, got {self.choice!r}", param="choice"
            )
        if self.whitespace_pattern is not None and self.json is None and not self.json_object:
            raise InvalidRequestError(
                "whitespace_pattern applies to json and json_object only", param="whitespace_pattern"
            )

    @property
    def kind(self) -> str:
        """Which constraint this is: "json", "json_object", "regex", "choice" or "grammar"."""
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))


GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name


class SamplingParams(
    msgspec.Struct, frozen=True, kw_only=True, array_like=True, gc=False, forbid_unknown_fields=True
):
    """How to sample one request's tokens.

    `temperature == 0` is greedy. `top_k <= 0`, `top_p == 1` and `min_p == 0` disable those filters.
    `seed` makes sampling reproducible per request, on every rank and every run (copy `i` of `n` uses
    `seed + i`). `logprobs=k` returns the top-k log-probabilities of every sampled position,
    `prompt_logprobs=k` those of every prompt position after the first (the engine allows at most
    `max_logprobs`). `n` copies are returned (the `best_of` with the highest cumulative logprob when
    `best_of` is given). `stop` strings end the output where they appear (excluded from the text unless
    `include_stop_str_in_output`). Penalties follow vLLM: `presence_penalty` and `frequency_penalty` over
    the output tokens, `repetition_penalty` (HF's) over prompt and output tokens; `logit_bias` maps token
    ids to a bias clamped to [-100, 100]; `min_tokens` masks stop tokens until that many are generated;
    `bad_words` bans token sequences. `max_tokens=0` is allowed with `prompt_logprobs` (scoring only).
    Integers must fit in 64 bits.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    bad_words: list[str] = msgspec.field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    all_stop_token_ids: list[int] = msgspec.field(default_factory=list)  # set by the engine
    bad_words_token_ids: list[list[int]] = msgspec.field(default_factory=list)  # set by the engine
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's older name for structured_outputs

    def __post_init__(self) -> None:
        if self.guided_decoding is not None or self.structured_outputs is not None:
            so, gd = self.structured_outputs, self.guided_decoding
            if so is not None and gd is not None and so != gd:
                raise InvalidRequestError(
                    "give structured_outputs or its alias guided_decoding, not both",
                    param="guided_decoding",
                )
            msgspec.structs.force_setattr(self, "structured_outputs", so or gd)
            msgspec.structs.force_setattr(self, "guided_decoding", so or gd)
        if isinstance(self.stop, str):
            msgspec.structs.force_setattr(self, "stop", [self.stop])
        elif self.stop is None:
            msgspec.structs.force_setattr(self, "stop", [])
        self._check_counts()
        self._check_filters()
        self._check_penalties()
        self._check_stops()

    def _check_counts(self) -> None:
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise InvalidRequestError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.best_of is not None and (not _is_int(self.best_of) or not self.n <= self.best_of <= MAX_N):
            raise InvalidRequestError(f"best_of must be an integer in [n, {MAX_N}], got {self.best_of!r}")
        scoring = self.prompt_logprobs is not None
        if not _is_int(self.max_tokens) or self.max_tokens < (0 if scoring else 1):
            raise InvalidRequestError(
                f"max_tokens must be an integer >= 1 (0 only to score a prompt, with prompt_logprobs), "
                f"got {self.max_tokens!r}"
            )
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise InvalidRequestError(f"{name} must be an integer >= 0 or None, got {value!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise InvalidRequestError(f"seed must be an integer or None, got {self.seed!r}")

    def _check_filters(self) -> None:
        if not _is_number(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k):
            raise InvalidRequestError(f"top_k must be an integer (<= 0 disables it), got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p!r}")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 2:
            raise InvalidRequestError(
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty!r}"
            )
        bias = self.logit_bias or {}
        bad = [(t, b) for t, b in bias.items() if not _is_int(t) or t < 0 or not _is_number(b)]
        if bad:
            raise InvalidRequestError(f"logit_bias must map token ids >= 0 to finite numbers, got {bad[:3]}")

    def _check_stops(self) -> None:
        stop = self.stop_strings
        if len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stop):
            raise InvalidRequestError(
                f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS}, "
                f"got {reprlib.repr(stop)}"
            )
        longest = max(len(s) for s in stop) if stop else 0
        if longest > MAX_STOP_STRING_CHARS:
            raise InvalidRequestError(
                f"stop: each stop string must be at most {MAX_STOP_STRING_CHARS} characters, got {longest}"
            )
        for name in ("stop_token_ids", "all_stop_token_ids"):
            if not all(_is_int(t) and t >= 0 for t in getattr(self, name)):
                raise InvalidRequestError(
                    f"{name} must be non-negative integers, got {getattr(self, name)!r}"
                )
        if not all(isinstance(w, str) and w for w in self.bad_words):
            raise InvalidRequestError(f"bad_words must be non-empty strings, got {self.bad_words!r}")
        if not all(w and all(_is_int(t) and t >= 0 for t in w) for w in self.bad_words_token_ids):
            raise InvalidRequestError("bad_words_token_ids must be non-empty lists of token ids")

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as a list (a single string was normalized to one at construction)."""
        return self.stop if isinstance(self.stop, list) else []

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax: `temperature` below `GREEDY_TEMPERATURE` (as vLLM does),
        where dividing the logits by it would overflow float32 (1e-38 made every probability NaN)."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def num_copies(self) -> int:
        """How many sequences are generated: `best_of` when given, else `n`."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def needs_history(self) -> bool:
        """Whether the sampler needs the request's tokens: a penalty, `min_tokens` or a bad word."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.min_tokens
            or self.bad_words_token_ids
        )


def check_token_ids_in_vocab(sp: SamplingParams, vocab_size: int) -> None:
    """Refuse token ids a model of `vocab_size` tokens does not have (the engine's check, at admission:
    the params alone do not know the vocabulary)."""
    for name, ids in (("stop_token_ids", sp.stop_token_ids), ("logit_bias", list(sp.logit_bias or {}))):
        out_of_vocab = [t for t in ids if t >= vocab_size]
        if out_of_vocab:
            raise InvalidRequestError(
                f"{name}: token ids must be below the vocabulary's {vocab_size}, got {out_of_vocab[:5]}"
            )


def _is_int(value: object) -> bool:
    """An int that fits the wire's 64 bits (a bigger one could not be sent to the workers)."""
    return isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
