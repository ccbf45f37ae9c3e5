"""Verifying draft tokens (speculative decoding): which of a row's drafts the target model accepts.

A verify row has logits at 1 + k positions: after the request's last token, and after each draft. Row
`j` is sampled as the request's next token would be if drafts 0..j-1 had been accepted: its history
(penalties, `min_tokens`, bad words) includes them, and its position (which seeds a seeded request's
draw) is theirs. Draft `j` is accepted while it equals row `j`'s sample; the tokens out are the accepted
drafts and the sample of the first row that disagreed (or of the last row: one more token).

Why this is rejection sampling, exactly: the n-gram proposal is deterministic (all of its probability on
the draft d), so vLLM's rule accepts d with probability min(1, p(d) / 1) = p(d) and otherwise draws
from the residual max(p - q, 0), which is p with d removed, renormalized. Drawing x ~ p and accepting
when x == d does the same: acceptance has probability p(d), and given a rejection x is distributed as
p conditioned on x != d, the residual. Each emitted token is therefore distributed as the target's,
and greedy rows (argmax) accept exactly the drafts plain decoding would have produced. Because the
sample of row `j` is the very draw plain decoding would make at that position (the same sampler, the
same history, a seeded request's same `(seed, position)` generator), a seeded request's tokens are the
same with speculation as without.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["accepted_prefix", "accepted_tokens", "draft_histories"]


def draft_histories(token_ids: list[int], drafts: Sequence[int]) -> list[list[int]]:
    """The token history of each row of a verify row: the request's tokens, then drafts 0..j-1."""
    return [token_ids] + [token_ids + list(drafts[:j]) for j in range(1, len(drafts) + 1)]


def accepted_prefix(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """How many drafts are accepted: the length of the prefix where each equals its row's sample
    (`sampled` has one more entry than `drafts`)."""
    a = 0
    while a < len(drafts) and drafts[a] == sampled[a]:
        a += 1
    return a


def accepted_tokens(drafts: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The tokens a verify row emits: its accepted drafts, then the sample of the first row that
    disagreed (or of the last row)."""
    return list(sampled[: accepted_prefix(drafts, sampled) + 1])
