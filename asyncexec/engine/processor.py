"""The engine's two ends: prompts in (validated token ids) and `RequestOutput`s out (incremental text).

vLLM V1 calls these the `Processor` and the `OutputProcessor`; both run on the engine's event loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgspec

from asyncexec.config import EngineConfig
from asyncexec.core.kv_cache import tokens_held
from asyncexec.core.request import Request
from asyncexec.engine.detokenizer import RequestDetokenizer
from asyncexec.errors import InvalidRequestError
from asyncexec.outputs import RequestOutput
from asyncexec.sampling_params import SamplingParams, check_token_ids_in_vocab

__all__ = ["InputProcessor", "OutputProcessor", "load_tokenizer"]

logger = logging.getLogger(__name__)
_V = TypeVar("_V")


class InputProcessor:
    """Turns a prompt (text or token ids) into token ids that fit the model and the KV cache."""

    def __init__(self, config: EngineConfig, tokenizer: Any, model_info: dict[str, Any], num_blocks: int):
        self.config = config
        self.tokenizer = tokenizer
        self.max_model_len: int = model_info["max_model_len"]
        self.vocab_size: int = model_info["vocab_size"]
        self.eos_token_ids: list[int] = list(model_info.get("eos_token_ids", []))
        self.num_blocks = num_blocks
        # the tokens one sequence can reach: max_model_len, or fewer where the KV cache holds fewer (its
        # usable blocks hold `kv_capacity` computed tokens; the last sampled token is never computed)
        self.kv_capacity = tokens_held(num_blocks, config.block_size)
        self.max_seq_len: int = min(self.max_model_len, self.kv_capacity + 1)

    def sampling_params(self, sp: SamplingParams | None) -> SamplingParams:
        """`sp` (default: `SamplingParams()`), checked against what this engine can return, with the
        fields the workers need filled in: `all_stop_token_ids` and `bad_words_token_ids`."""
        sp = SamplingParams() if sp is None else sp
        if not isinstance(sp, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be a SamplingParams, got {type(sp).__name__}")
        cap = min(self.config.max_logprobs, self.vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(sp, name)
            if value is not None and value > cap:
                raise InvalidRequestError(
                    f"{name}: at most max_logprobs={self.config.max_logprobs} (and the vocabulary's "
                    f"{self.vocab_size}), got {value}"
                )
        check_token_ids_in_vocab(sp, self.vocab_size)
        if self.tokenizer is None and (sp.stop_strings or sp.bad_words):
            field_name = "stop" if sp.stop_strings else "bad_words"
            raise InvalidRequestError(f"{field_name}: strings need a tokenizer in the model folder")
        eos = [] if sp.ignore_eos else self.eos_token_ids
        return msgspec.structs.replace(
            sp,
            all_stop_token_ids=sorted({*sp.stop_token_ids, *eos}),
            bad_words_token_ids=self._bad_words_token_ids(sp.bad_words),
        )

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's tokenization of bad words: each word alone, and after a space where that makes a
        different token sequence of the same length (a word inside a text, not at its start)."""
        out: list[list[int]] = []
        for word in words:
            plain = list(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = list(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            out += [plain] if plain else []
            if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
                out.append(spaced)
        return out

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        max_len, vocab = self.max_model_len, self.vocab_size
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "prompt: text needs a tokenizer in the model folder; pass token ids"
                )
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=True))
        elif isinstance(prompt, (list, tuple)):
            bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(
                    f"prompt: token ids must be integers in [0, {vocab}), got {bad[:5]}"
                )
            ids = list(prompt)
        else:
            raise InvalidRequestError(
                f"prompt must be a str or a list of token ids, got {type(prompt).__name__}"
            )
        if not ids:
            raise InvalidRequestError("prompt is empty")
        if len(ids) >= max_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens, but max_model_len={max_len} leaves no room to generate"
            )
        if len(ids) > self.kv_capacity:
            raise InvalidRequestError(
                f"prompt of {len(ids)} tokens needs more KV blocks than the cache holds: it holds "
                f"{self.kv_capacity} tokens ({self.num_blocks - 1} blocks of {self.config.block_size}); "
                "raise kv_cache_memory_bytes",
                param="prompt",
            )
        return ids

    def check_fits(self, num_prompt_tokens: int, sp: SamplingParams) -> None:
        """Refuse a request the KV cache could never hold, even alone: its prompt and `max_tokens` (up to
        max_model_len) need more computed tokens than the cache's usable blocks hold. Scheduled, it
        would be preempted for want of a block and wait forever for blocks that never come."""
        total = min(num_prompt_tokens + sp.max_tokens, self.max_model_len)
        needed = max(total - 1, num_prompt_tokens)  # the last sampled token is never computed
        if needed > self.kv_capacity:
            bs = self.config.block_size
            raise InvalidRequestError(
                f"max_tokens: a prompt of {num_prompt_tokens} tokens with max_tokens={sp.max_tokens} "
                f"needs {needed} tokens of KV cache, but the cache holds {self.kv_capacity} "
                f"({self.num_blocks - 1} blocks of {bs}); lower max_tokens (at most "
                f"{max(self.kv_capacity + 1 - num_prompt_tokens, 0)}) or raise kv_cache_memory_bytes",
                param="max_tokens",
            )


class OutputProcessor:
    """Builds each step's `RequestOutput`s, detokenizing incrementally per request and finding stop
    strings: a request whose text reaches one is finished with "stop" through `finish` (the scheduler's,
    which frees its blocks) in the step that found it."""

    def __init__(self, tokenizer: Any, finish: Callable[[str, str], object] | None = None) -> None:
        self.tokenizer = tokenizer
        self._finish = finish
        self._detok: dict[str, RequestDetokenizer] = {}

    def make_output(self, req: Request, new_tokens: list[int]) -> RequestOutput:
        sp = req.sampling_params
        text = None
        if self.tokenizer is not None:
            detok = self._detok.get(req.request_id)
            if detok is None:
                detok = self._detok[req.request_id] = RequestDetokenizer(
                    self.tokenizer, [], sp.include_stop_str_in_output
                )
            self._find_stop(req, detok, new_tokens)
            text = detok.output_text(req.finish_reason is not None)
            if req.finish_reason is not None:
                del self._detok[req.request_id]
        return RequestOutput(
            req.request_id,
            req.prompt_token_ids,
            list(req.output_token_ids),
            list(new_tokens),
            text,
            req.finish_reason is not None,
            req.finish_reason,  # type: ignore[arg-type]
            list(req.logprobs) if sp.logprobs is not None else None,
            req.stop_reason,
            cumulative_logprob=req.cumulative_logprob if sp.logprobs is not None else None,
            prompt_logprobs=_prompt_list(req.prompt_logprobs, req, sp),
            prompt_logprob_ranks=_prompt_list(req.prompt_logprob_ranks, req, sp),
        )

    def _find_stop(self, req: Request, detok: RequestDetokenizer, new_tokens: list[int]) -> None:
        """Detokenize the step's tokens and look for stop strings. Several new tokens (a speculative step)
        are taken one at a time while stop strings are set: the request ends at the token that completes
        one, as it would have without speculation, and the tokens after it are dropped (from `new_tokens`
        too, in place)."""
        sp = req.sampling_params
        out = req.output_token_ids
        grammar_end = req.structured_output_request is not None and req.structured_output_request.terminated
        stopped_by_token = req.finish_reason == "stop" and not grammar_end  # its last token is text
        first = len(out) - len(new_tokens) + 1 if sp.stop_strings and len(new_tokens) > 1 else len(out)
        for end in range(first, len(out) + 1):
            last = end == len(out)
            # As in vLLM, stop strings count only once min_tokens are out.
            detok.stop = sp.stop_strings if end >= sp.min_tokens else []
            ids = out if last else out[:end]
            stop = detok.update(ids, last and req.finish_reason is not None, last and stopped_by_token)
            if stop is not None:
                if not last:
                    del new_tokens[len(new_tokens) - (len(out) - end) :]
                    req.truncate_output(end)
                self._stop(req, stop)
                return

    def _stop(self, req: Request, stop: str) -> None:
        """A stop string matched: the request ends now with "stop" (over a length stop of the same step)."""
        if req.finish_reason is None and self._finish is not None:
            self._finish(req.request_id, "stop")
        req.finish_reason, req.stop_reason = "stop", stop

    def make_outputs(
        self, progressed: list[tuple[Request, list[int]]]
    ) -> tuple[list[RequestOutput], list[tuple[Request, Exception]]]:
        """A step's outputs; a request whose own output fails (its detokenization) is returned apart."""
        outputs: list[RequestOutput] = []
        failed: list[tuple[Request, Exception]] = []
        for req, toks in progressed:
            try:
                outputs.append(self.make_output(req, toks))
            except Exception as e:
                self.forget(req.request_id)
                failed.append((req, e))
        return outputs, failed

    def error_output(self, req: Request) -> RequestOutput:
        """The last output of a request that failed on its own: finished with "error", without text."""
        self.forget(req.request_id)
        req.finish_reason = "error"
        return RequestOutput(
            req.request_id, req.prompt_token_ids, list(req.output_token_ids), [], None, True, "error"
        )

    def forget(self, request_id: str) -> None:
        self._detok.pop(request_id, None)


def _prompt_list(values: list[_V | None], req: Request, sp: SamplingParams) -> list[_V | None] | None:
    """A per-prompt-position list when prompt logprobs were asked for (all None where nothing was scored:
    a one-token prompt)."""
    if sp.prompt_logprobs is None:
        return None
    return list(values) if values else [None] * len(req.prompt_token_ids)


def load_tokenizer(path: str | None) -> Any:
    """The model folder's or GGUF file's tokenizer, or None when it has none (prompts must then be token
    ids)."""
    if path is None:
        return None
    try:
        from asyncexec.gguf.file import load_tokenizer as load

        return load(path)
    except (OSError, ValueError) as e:
        logger.info("no tokenizer in %s (%s); prompts must be token ids", path, e)
        return None
