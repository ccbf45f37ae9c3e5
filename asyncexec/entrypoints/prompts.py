"""Prompt texts and chat messages to token ids for the server, without holding up its event loop.

The ids are exactly the engine's (`tokenizer.encode(text, add_special_tokens=True)`) or
`apply_chat_template(..., tokenize=True)`'s. Texts over `INLINE_TOKENIZE_CHARS` are tokenized in a thread.
A thread alone is not enough: `tokenizers` holds the GIL while it turns a multi-million-token result
into Python lists, for 0.1-0.3 s at a time. So a text over `PIECE_CHARS` is first counted in pieces of
at most `PIECE_CHARS` characters, one thread hop each, and refused as soon as the count reaches twice
`max_model_len`; only a text under that bound, whose ids are then few, is tokenized whole.

Pieces end just before a whitespace character where one lies in the piece's second half, which is where
pre-tokenizers split anyway, so the pieces' count is the text's within a few tokens per piece; the
factor of two is the margin that keeps a prompt that fits from ever being refused by the estimate.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from asyncexec.entrypoints.protocol import HTTPError
from asyncexec.errors import InvalidRequestError

__all__ = [
    "INLINE_TOKENIZE_CHARS",
    "PIECE_CHARS",
    "check_length",
    "count_tokens",
    "encode_chat",
    "encode_text",
    "off_loop_if",
    "text_pieces",
]

_T = TypeVar("_T")
# Texts longer than this are tokenized in a thread: about 1.5 ms of tokenizing here, against the
# thread hop's ~0.15 ms; a 4 MiB text takes seconds, which the event loop must not wait through.
INLINE_TOKENIZE_CHARS = 1024
# Texts longer than this are counted in pieces of this many characters at most (half as many at least)
# before they are tokenized whole: a piece holds the GIL for a few milliseconds.
PIECE_CHARS = 16384
_SPACE = re.compile(r"\s")


def text_pieces(text: str, size: int = PIECE_CHARS) -> Iterator[str]:
    """`text` in consecutive pieces of at most `size` characters, each cut just before a whitespace
    character in the second half of its window where there is one (else at `size` characters)."""
    start = 0
    while len(text) - start > size:
        space = _SPACE.search(text, start + size // 2, start + size)
        end = space.start() if space is not None else start + size
        yield text[start:end]
        start = end
    yield text[start:]


async def count_tokens(tokenizer: Any, text: str, stop_at: int) -> int:
    """The tokens of `text`'s pieces (no special tokens), each piece in a thread; the count stops as soon
    as it reaches `stop_at`, so it is exact only below that."""
    n = 0
    for piece in text_pieces(text, PIECE_CHARS):
        n += len(await asyncio.to_thread(tokenizer.encode, piece, add_special_tokens=False))
        if n >= stop_at:
            break
    return n


def check_length(ids: list[int], max_len: int) -> None:
    """The engine's own length check, before it validates every id on the loop (slow for millions)."""
    if len(ids) >= max_len:
        raise InvalidRequestError(
            f"prompt has {len(ids)} tokens, but max_model_len={max_len} leaves no room to generate"
        )


async def encode_text(
    tokenizer: Any, text: str, max_len: int, encode: Callable[[str], list[int]] | None = None
) -> list[int]:
    """`encode(text)` (default: the engine's `encode(text, add_special_tokens=True)`), checked against
    `max_len`; a long text is counted in pieces first and refused once it clearly cannot fit."""
    if encode is None:
        encode = lambda t: list(tokenizer.encode(t, add_special_tokens=True))  # noqa: E731
    if len(text) > PIECE_CHARS:
        bound = 2 * max_len
        n = await count_tokens(tokenizer, text, bound)
        if n >= bound:
            raise InvalidRequestError(
                f"prompt has {n}+ tokens, but max_model_len={max_len} leaves no room to generate"
            )
    ids = await off_loop_if(len(text) > INLINE_TOKENIZE_CHARS, lambda: encode(text))
    check_length(ids, max_len)
    return ids


async def encode_chat(
    tokenizer: Any, messages: list[dict[str, Any]], max_len: int, tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """`apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`'s ids: the template is
    rendered to text, which is then tokenized as `encode_text` does and as the template's own
    `tokenize=True` would (`tokenizer(text, add_special_tokens=False)`). `tools` go to the template."""
    try:
        text = await off_loop_if(
            sum(len(m["content"]) for m in messages) > INLINE_TOKENIZE_CHARS,
            lambda: tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False
            ),
        )
    except Exception as e:  # a template that rejects these messages
        raise HTTPError(400, f"the chat template rejected the messages: {e}", param="messages") from None
    if not isinstance(text, str):
        raise HTTPError(400, "the chat template did not render to text", param="messages")
    return await encode_text(
        tokenizer, text, max_len, lambda t: list(tokenizer(t, add_special_tokens=False)["input_ids"])
    )


async def off_loop_if(cond: bool, fn: Callable[[], _T]) -> _T:
    """`fn()`, in a thread when `cond` (long work the event loop must not wait through)."""
    return await asyncio.to_thread(fn) if cond else fn()
