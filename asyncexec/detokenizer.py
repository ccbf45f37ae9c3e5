"""Incremental detokenization: each step decodes only a short window, never the whole output again.

Byte-level tokenizers can split one character over several tokens, so text is emitted only once the
window decodes without a trailing replacement character. This is vLLM's prefix/read-offset scheme.
"""

from __future__ import annotations

from typing import Any

__all__ = ["IncrementalDetokenizer"]


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.text = ""
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens before this are already in `text`

    def update(self, token_ids: list[int]) -> str:
        """Extend `text` with what `token_ids` (all output tokens so far) add; returns the new text."""
        window = token_ids[self._prefix :]
        before = self._decode(window[: self._read - self._prefix])
        after = self._decode(window)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # an incomplete character: wait for the next token
        delta = after[len(before) :]
        self.text += delta
        self._prefix, self._read = self._read, len(token_ids)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def flush(self, token_ids: list[int]) -> str:
        """At the end of a request: whatever is left, even an incomplete character."""
        rest = self._decode(token_ids[self._read :])
        self.text += rest
        self._read = self._prefix = len(token_ids)
        return rest
