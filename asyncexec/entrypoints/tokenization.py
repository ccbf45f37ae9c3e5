"""vLLM's `/tokenize` and `/detokenize`, with its request and response shapes.

`/tokenize` takes a `prompt` (tokenized as the completions endpoint does, special tokens added unless
`add_special_tokens: false`) or chat `messages` (rendered by the chat template as the chat endpoint
does, `add_generation_prompt` by default, no special tokens added by default) and answers
`{count, max_model_len, tokens, token_strs}`. `/detokenize` takes `tokens` and answers `{prompt}`.
Both tokenize off the event loop past a few kilobytes, as `prompts` does.
"""

from __future__ import annotations

from typing import Any

from asyncexec.entrypoints.prompts import encode_text, off_loop_if
from asyncexec.entrypoints.protocol import DetokenizeRequest, HTTPError, TokenizeRequest

__all__ = ["detokenize", "tokenize"]


async def tokenize(tok: Any, req: TokenizeRequest, max_model_len: int) -> dict[str, Any]:
    if tok is None:
        raise HTTPError(400, "this model has no tokenizer", param="prompt")
    if req.messages is not None:
        ids = await _chat_ids(tok, req)
    else:
        assert req.prompt is not None  # TokenizeRequest.check
        special = True if req.add_special_tokens is None else req.add_special_tokens
        # The length bound here is only what counting in pieces needs: /tokenize refuses no length.
        ids = await encode_text(
            tok,
            req.prompt,
            max(max_model_len, len(req.prompt) + 2),
            lambda t: list(tok.encode(t, add_special_tokens=special)),
        )
    strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


async def _chat_ids(tok: Any, req: TokenizeRequest) -> list[int]:
    if not getattr(tok, "chat_template", None):
        raise HTTPError(400, "this model's tokenizer has no chat template", param="messages")
    assert req.messages is not None
    messages = [m.as_dict() for m in req.messages]
    try:
        text = await off_loop_if(
            sum(len(m["content"]) for m in messages) > 1024,
            lambda: tok.apply_chat_template(
                messages,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                tokenize=False,
            ),
        )
    except Exception as e:  # a template that rejects these messages
        raise HTTPError(400, f"the chat template rejected the messages: {e}", param="messages") from None
    special = bool(req.add_special_tokens)
    ids: list[int] = await off_loop_if(
        len(text) > 1024, lambda: list(tok(text, add_special_tokens=special)["input_ids"])
    )
    return ids


async def detokenize(tok: Any, req: DetokenizeRequest, vocab_size: int) -> dict[str, Any]:
    if tok is None:
        raise HTTPError(400, "this model has no tokenizer", param="tokens")
    bad = [t for t in req.tokens if not 0 <= t < vocab_size]
    if bad:
        raise HTTPError(400, f"tokens must be in [0, {vocab_size}), got {bad[:5]}", param="tokens")
    text = await off_loop_if(len(req.tokens) > 1024, lambda: tok.decode(req.tokens))
    return {"prompt": str(text)}
