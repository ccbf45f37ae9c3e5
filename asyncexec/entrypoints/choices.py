"""OpenAI response choices: text or message, logprobs in each endpoint's shape, echo, usage.

Completions' `logprobs` is `{tokens, token_logprobs, top_logprobs, text_offset}`. With `echo` the
prompt comes first in it, its first token with `null` logprob and top-logprobs (nothing scores it), as
OpenAI's legacy API did. Chat's `logprobs` is `{content: [{token, logprob, bytes, top_logprobs}]}`.
vLLM's `prompt_logprobs` (when asked for by that name) is a list with `null` first, then per position
`{token_id: {logprob, rank, decoded_token}}`: on each completion choice, and on the chat response.
`stop_reason` is vLLM's: the stop string or stop token id that ended a choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncexec.entrypoints.tool_calls import ToolCalls
from asyncexec.outputs import RequestOutput

__all__ = ["ChoiceFormat", "prompt_logprobs_body", "usage_body"]


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _token_text(tok: Any, token_id: int) -> str:
    return str(tok.decode([token_id])) if tok is not None else str(token_id)


def prompt_logprobs_body(tok: Any, out: RequestOutput) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs`: None first, then each position's actual and top-k tokens."""
    if out.prompt_logprobs is None:
        return None
    ranks = out.prompt_logprob_ranks or [None] * len(out.prompt_logprobs)
    body: list[dict[str, dict[str, Any]] | None] = []
    for pos, d in enumerate(out.prompt_logprobs):
        if d is None:
            body.append(None)
            continue
        actual_rank = ranks[pos]
        entry = {}
        # The actual token comes first, then the top-k in order, less the actual one where it is among
        # them: the j-th of those ranks j, or j + 1 once past the actual token's own place.
        for j, (t, lp) in enumerate(d.items()):
            r = actual_rank if j == 0 else j + (actual_rank is not None and j >= actual_rank)
            entry[str(t)] = {"logprob": lp, "rank": r, "decoded_token": _token_text(tok, t)}
        body.append(entry)
    return body


@dataclass
class ChoiceFormat:
    """How one request's choices are written: the endpoint, the tokenizer, and what was asked for."""

    chat: bool
    tok: Any
    return_ids: bool = False
    echo_text: str | None = None  # completions with echo: the prompt's text, before each choice's
    echo_logprobs: bool = False  # echo with logprobs: the prompt's logprobs lead each choice's
    prompt_logprobs: bool = False  # vLLM's `prompt_logprobs` field was asked for
    tools: ToolCalls | None = None  # chat with a tool choice: the output becomes `tool_calls`

    def choice(
        self, out: RequestOutput, text: str, token_ids: list[int], stream: bool, first: bool
    ) -> dict[str, Any]:
        """Choice `out.index`: `text`/`token_ids` are the whole output, or a chunk's delta (`first`
        for the first chunk of its index, which carries the echoed prompt)."""
        if self.chat:
            return self._chat(out, text, token_ids, stream)
        logprobs = None
        echo = self.echo_text if first and self.echo_text is not None else ""
        if out.logprobs is not None:
            logprobs = _empty_completion_logprobs()
            if echo and self.echo_logprobs:
                self._prompt_part(out, logprobs)
            start = len(echo) + len(out.text or "") - len(text) if stream else len(echo)
            self._output_part(out, token_ids, logprobs, start)
        choice: dict[str, Any] = {
            "index": out.index,
            "text": echo + text,
            "logprobs": logprobs,
            "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason,
        }
        if self.prompt_logprobs and first:
            choice["prompt_logprobs"] = prompt_logprobs_body(self.tok, out)
        if self.return_ids:
            choice["token_ids"] = token_ids
        return choice

    def _prompt_part(self, out: RequestOutput, lp: dict[str, list[Any]]) -> None:
        plp = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        at = 0
        for t, d in zip(out.prompt_token_ids, plp, strict=True):
            s = _token_text(self.tok, t)
            lp["tokens"].append(s)
            lp["token_logprobs"].append(None if d is None else d.get(t))
            lp["top_logprobs"].append(
                None if d is None else {_token_text(self.tok, k): v for k, v in d.items()}
            )
            lp["text_offset"].append(at)
            at += len(s)

    def _output_part(
        self, out: RequestOutput, token_ids: list[int], lp: dict[str, list[Any]], at: int
    ) -> None:
        for d, t in zip(_tail(out, len(token_ids)), token_ids, strict=True):
            s = _token_text(self.tok, t)
            lp["tokens"].append(s)
            lp["token_logprobs"].append(d.get(t))
            lp["top_logprobs"].append({_token_text(self.tok, k): v for k, v in d.items()})
            lp["text_offset"].append(at)
            at += len(s)

    def _chat(self, out: RequestOutput, text: str, token_ids: list[int], stream: bool) -> dict[str, Any]:
        logprobs = None
        if out.logprobs is not None:
            content = []
            for d, t in zip(_tail(out, len(token_ids)), token_ids, strict=True):
                s = _token_text(self.tok, t)
                top = [
                    {"token": (k_s := _token_text(self.tok, k)), "logprob": v, "bytes": list(k_s.encode())}
                    for k, v in d.items()
                ]
                content.append(
                    {"token": s, "logprob": d.get(t), "bytes": list(s.encode()), "top_logprobs": top}
                )
            logprobs = {"content": content}
        key, message = (
            ("delta", {"content": text}) if stream else ("message", {"role": "assistant", "content": text})
        )
        finish_reason: str | None = out.finish_reason
        if self.tools is not None:
            message, finish_reason = self.tools.delta(out, text) if stream else self.tools.message(out, text)
        choice: dict[str, Any] = {
            "index": out.index,
            key: message,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": out.stop_reason,
        }
        if self.return_ids:
            choice["token_ids"] = token_ids
        return choice


def _empty_completion_logprobs() -> dict[str, list[Any]]:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def _tail(out: RequestOutput, n: int) -> list[dict[int, float]]:
    return out.logprobs[len(out.logprobs) - n :] if out.logprobs is not None and n else []
