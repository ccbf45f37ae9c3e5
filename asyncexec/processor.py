"""The engine's two ends: prompts in (validated token ids) and `RequestOutput`s out (incremental text).

vLLM V1 calls these the `Processor` and the `OutputProcessor`; both run on the engine's event loop.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from asyncexec.config import EngineConfig
from asyncexec.detokenizer import IncrementalDetokenizer
from asyncexec.errors import InvalidRequestError
from asyncexec.outputs import RequestOutput
from asyncexec.sampling_params import SamplingParams
from asyncexec.scheduler import Request

__all__ = ["InputProcessor", "OutputProcessor", "load_tokenizer"]

logger = logging.getLogger(__name__)


class InputProcessor:
    """Turns a prompt (text or token ids) into token ids that fit the model and the KV cache."""

    def __init__(self, config: EngineConfig, tokenizer: Any, model_info: dict[str, Any], num_blocks: int):
        self.config = config
        self.tokenizer = tokenizer
        self.max_model_len: int = model_info["max_model_len"]
        self.vocab_size: int = model_info["vocab_size"]
        self.num_blocks = num_blocks

    def sampling_params(self, sp: SamplingParams | None) -> SamplingParams:
        """`sp` (default: `SamplingParams()`), checked against what this engine can return."""
        sp = SamplingParams() if sp is None else sp
        if not isinstance(sp, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be a SamplingParams, got {type(sp).__name__}")
        if sp.logprobs is not None and sp.logprobs > min(self.config.max_logprobs, self.vocab_size):
            raise InvalidRequestError(
                f"logprobs: at most max_logprobs={self.config.max_logprobs} (and the vocabulary's "
                f"{self.vocab_size}), got {sp.logprobs}"
            )
        return sp

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
        if -(-(len(ids) + 1) // self.config.block_size) > self.num_blocks - 1:
            raise InvalidRequestError(
                f"prompt of {len(ids)} tokens needs more KV blocks than the cache holds"
            )
        return ids


class OutputProcessor:
    """Builds each step's `RequestOutput`s, detokenizing incrementally per request."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._detok: dict[str, IncrementalDetokenizer] = {}

    def make_output(self, req: Request, new_tokens: list[int]) -> RequestOutput:
        text = None
        if self.tokenizer is not None:
            detok = self._detok.get(req.request_id)
            if detok is None:
                detok = self._detok[req.request_id] = IncrementalDetokenizer(self.tokenizer)
            detok.update(req.output_token_ids)
            if req.finish_reason is not None:
                detok.flush(req.output_token_ids)
                del self._detok[req.request_id]
            text = detok.text
        return RequestOutput(
            req.request_id,
            req.prompt_token_ids,
            list(req.output_token_ids),
            list(new_tokens),
            text,
            req.finish_reason is not None,
            req.finish_reason,  # type: ignore[arg-type]
            list(req.logprobs) if req.sampling_params.logprobs is not None else None,
        )

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


def load_tokenizer(path: str | None) -> Any:
    """The model folder's tokenizer, or None when it has none (prompts must then be token ids)."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        logger.info("no tokenizer in %s (%s); prompts must be token ids", path, e)
        return None
