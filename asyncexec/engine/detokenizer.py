"""Incremental detokenization: each step decodes only a short window, never the whole output again.

Byte-level tokenizers can split one character over several tokens, so text is emitted only once the
window decodes without a trailing replacement character. This is vLLM's prefix/read-offset scheme.

Stop strings are found here, in the engine process, on the detokenized text (never in the worker's
step): `RequestDetokenizer` looks for them in the text each step adds plus the few characters before
it that a match could start in, and holds back a possible partial match while streaming.
"""

from __future__ import annotations

from typing import Any

__all__ = ["IncrementalDetokenizer", "RequestDetokenizer", "check_stop_strings", "held_back"]


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


def check_stop_strings(
    text: str, new_char_count: int, stop: list[str], include_in_output: bool
) -> tuple[str, int] | None:
    """The first stop string in `text` that ends within its last `new_char_count` characters (a match
    may begin in older text: it may span tokens and steps), and the length `text` is cut to; or None.
    vLLM's function; where several match, the one that starts first wins."""
    if not new_char_count or not stop:
        return None
    best: tuple[int, str] | None = None
    for s in stop:
        at = text.find(s, max(0, len(text) - new_char_count - len(s) + 1))
        if at != -1 and (best is None or at < best[0]):
            best = (at, s)
    if best is None:
        return None
    at, s = best
    return s, at + len(s) if include_in_output else at


def held_back(text: str, stop: list[str]) -> int:
    """How many trailing characters of `text` could still begin a stop string: the longest suffix that
    is a proper prefix of one. Streaming holds exactly these back, and releases them once the text
    that follows shows they were no match."""
    hold = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return hold


class RequestDetokenizer:
    """One request's output text: incremental detokenization, stop strings, and the text safe to show.

    `output_text` is what may be emitted so far: everything once the request is finished, else the text
    minus what `held_back` keeps (nothing is held with `include_stop_str_in_output`, since a stop string
    is then emitted whole anyway). It only ever grows, and is always a prefix of the final text.
    """

    def __init__(self, tokenizer: Any, stop: list[str], include_stop_str_in_output: bool) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stop = stop
        self.include = include_stop_str_in_output
        self.text = ""
        self.stopped = False

    def update(self, token_ids: list[int], finished: bool, stop_terminated: bool) -> str | None:
        """Take the output tokens so far; returns the stop string that matched, if one did (the text is
        then cut there, and nothing more is taken). A request that ended on a stop token shows that
        token's text only with `include_stop_str_in_output`, as in vLLM."""
        if self.stopped:
            return None
        ids = token_ids[:-1] if stop_terminated and not self.include else token_ids
        before = len(self.detok.text)
        self.detok.update(ids)
        if finished:
            self.detok.flush(ids)
        self.text = self.detok.text
        match = check_stop_strings(self.text, len(self.text) - before, self.stop, self.include)
        if match is None:
            return None
        self.text = self.text[: match[1]]
        self.stopped = True
        return match[0]

    def output_text(self, finished: bool) -> str:
        if finished or self.stopped or self.include or not self.stop:
            return self.text
        return self.text[: len(self.text) - held_back(self.text, self.stop)]
