"""N-gram prompt lookup (vLLM's "ngram" proposer, llama.cpp's lookup decoding).

A request's draft is the continuation of its last n tokens where they occurred before in its prompt or
output: for n from `prompt_lookup_max` down to `prompt_lookup_min`, the most recent earlier occurrence
that has a continuation wins, and the k tokens that followed it are proposed (a match that runs into
the end of the tokens repeats its period). Nothing matches: nothing is proposed (the step is a plain
decode step for that request).

Cost: one numpy compare over the tokens, then one over the positions that still match, in the engine
process: about 40 us for a request of 2,000 tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["NgramProposer"]


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the most recent earlier occurrence of the longest suffix of
        `token_ids` (of `min_n`..`max_n` tokens) that occurred before; [] if none did."""
        size = len(token_ids)
        if k <= 0 or size <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        # earlier positions that end a match of length 1, then of 2, 3, ...: each round keeps the
        # candidates whose next older token matches too (one vectorized compare over the survivors)
        ends = np.flatnonzero(tokens[: size - 1] == tokens[size - 1])
        best, n = None, 1
        while ends.size and n <= self.max_n:
            if n >= self.min_n:
                best = (int(ends[-1]) + 1, n)  # the most recent match of this length
            if n == self.max_n:
                break
            ends = ends[ends >= n]
            ends = ends[tokens[ends - n] == tokens[size - 1 - n]]
            n += 1
        if best is None:
            return []
        start = best[0]
        draft = [int(t) for t in tokens[start : start + k]]
        # a match that runs into the end repeats itself: the sequence is periodic with period
        # size - start from there on ("ab ab ab" proposes k tokens, not the 2 that are left)
        while len(draft) < k:
            draft.append(draft[len(draft) - (size - start)])
        return draft
