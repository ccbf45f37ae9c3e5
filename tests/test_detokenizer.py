"""Incremental detokenization gives exactly the full decode, including characters split over tokens."""

from __future__ import annotations

import random

from asyncexec.detokenizer import IncrementalDetokenizer
from asyncexec.models import _tokenizer


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
