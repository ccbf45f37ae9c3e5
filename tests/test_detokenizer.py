"""Incremental detokenization gives exactly the full decode, including characters split over tokens; stop
strings are found across tokens and never partly shown."""

from __future__ import annotations

import itertools
import random

from asyncexec.engine.detokenizer import (
    IncrementalDetokenizer,
    RequestDetokenizer,
    check_stop_strings,
    held_back,
)
from asyncexec.testing import _tokenizer


def test_incremental_text_equals_the_full_decode() -> None:
    tok = _tokenizer()
    rng = random.Random(0)
    for trial in range(100):
        text = "".join(rng.choice(["a", "é", "日本", " ", "🙂", "\n"]) for _ in range(rng.randrange(1, 20)))
        ids = tok.encode(text) + ([rng.randrange(259)] if trial % 3 == 0 else [])
        d = IncrementalDetokenizer(tok)
        pieces = [d.update(ids[:i]) for i in range(1, len(ids) + 1)]
        assert all("\ufffd" not in p for p in pieces[:-1] if p), "no half characters mid-stream"
        d.flush(ids)
        assert d.text == tok.decode(ids, skip_special_tokens=True)


def _stream(
    tok: object, ids: list[int], stop: list[str], include: bool = False
) -> tuple[list[str], str | None]:
    """Feed `ids` one token a step as the engine does; the text visible after each step, and the match."""
    d = RequestDetokenizer(tok, stop, include)
    shown, match = [], None
    for i in range(1, len(ids) + 1):
        last = i == len(ids)
        match = d.update(ids[:i], last, False)
        shown.append(d.output_text(last or match is not None))
        if match is not None:
            break
    return shown, match


def test_a_stop_string_spanning_tokens_is_found_and_never_partly_shown() -> None:
    tok = _tokenizer()  # byte-level: every character of ASCII text is its own token
    ids = tok.encode("say hello there", add_special_tokens=False)
    shown, match = _stream(tok, ids, ["lo th"])
    assert match == "lo th" and shown[-1] == "say hel"
    assert max(map(len, shown)) == 7, "no beginning of the stop string ever showed"
    assert all(a == b[: len(a)] for a, b in itertools.pairwise(shown)), "text only grows"
    shown, match = _stream(tok, ids, ["lo th"], include=True)
    assert match == "lo th" and shown[-1] == "say hello th"


def test_held_back_text_is_released_once_it_is_no_match() -> None:
    tok = _tokenizer()
    ids = tok.encode("a<|x ok", add_special_tokens=False)
    shown, match = _stream(tok, ids, ["<|xy", "zz"])
    assert match is None and shown[-1] == "a<|x ok"
    assert shown[1:4] == ["a", "a", "a"], "'<', '<|', '<|x' could start '<|xy': held back"
    assert shown[4] == "a<|x ", "the space shows they were not: released at once"
    assert held_back("abz", ["zz", "bzq"]) == 2 and held_back("abc", ["zz"]) == 0


def test_check_stop_strings_takes_the_earliest_match_in_the_new_text() -> None:
    assert check_stop_strings("xx ab cd", 3, ["cd", "ab"], False) == ("cd", 6), (
        "'ab' ended before the new text"
    )
    assert check_stop_strings("xx ab cd", 6, ["cd", "ab"], False) == ("ab", 3)
    assert check_stop_strings("xx ab cd", 6, ["cd", "ab"], True) == ("ab", 5)
    assert check_stop_strings("abc", 0, ["abc"], False) is None
