"""Logit processing before sampling, over the whole batch at once: logit bias, `min_tokens`, bad words,
then the presence, frequency and repetition penalties, in vLLM V1's order.

Every step builds, for the rows that need them only, index lists of (row, token) and one flat tensor of
their past tokens; each processor then gathers, changes and scatters just those logits (distinct pairs
from `torch.unique`), never a whole `[rows, V]` temporary. Python never loops over the vocabulary; it
loops over a request's bad words (a handful) to compare a word's prefix with the output's tail, as
vLLM does.

Definitions (vLLM's, and HF's for the repetition penalty):
- repetition: for every token in prompt or output, a positive logit is divided by the penalty and a
  negative one multiplied by it;
- frequency: `logit -= penalty * count(token in output)`; presence: `logit -= penalty * (count > 0)`;
- bad words: a one-token word is always banned; a longer word's last token is banned while the output
  ends with the rest of it;
- min_tokens: stop tokens (`all_stop_token_ids`) are banned while the output is shorter.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import torch

from asyncexec.sampling_params import LOGIT_BIAS_LIMIT, SamplingParams

__all__ = ["apply_grammar_bitmask", "apply_logits_processors"]

_NEG_INF = float("-inf")
_BITS = torch.arange(32, dtype=torch.int32)


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[tuple[int, int]]) -> None:
    """Set to -inf, in place, every logit that a structured output forbids: `rows` pairs a row of
    `logits [N, V]` with its row of the packed int32 `bitmask [R, ceil(V / 32)]` (bit `t % 32` of word
    `t // 32` set where token `t` is allowed). Tokens past the mask's width are forbidden."""
    vocab = logits.shape[1]
    logit_rows = torch.tensor([r for r, _ in rows])
    words = bitmask[torch.tensor([m for _, m in rows])]
    allowed = ((words[:, :, None] >> _BITS) & 1).view(len(rows), -1).bool()
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    logits[logit_rows] = logits[logit_rows].masked_fill_(~allowed[:, :vocab], _NEG_INF)


def apply_logits_processors(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    token_ids: Sequence[Sequence[int]] | None,
    num_prompt_tokens: Sequence[int] | None,
) -> torch.Tensor:
    """`logits [N, V]` (float32, modified in place) after every processor the rows ask for.

    `token_ids[i]` is row i's prompt and output so far, of which the first `num_prompt_tokens[i]` are
    the prompt; both may be None when no row needs its history.
    """
    _apply_logit_bias(logits, params)
    hist = [i for i, p in enumerate(params) if p.needs_history]
    if not hist:
        return logits
    if token_ids is None or num_prompt_tokens is None:
        raise ValueError("penalties, min_tokens and bad_words need the rows' token ids")
    outputs = {i: token_ids[i][num_prompt_tokens[i] :] for i in hist}
    _ban(logits, _min_tokens_bans(params, outputs) + _bad_word_bans(params, outputs))
    penal = [i for i in hist if _penalized(params[i])]
    if penal:
        _apply_penalties(logits, params, penal, token_ids, num_prompt_tokens)
    return logits


def _penalized(p: SamplingParams) -> bool:
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)


def _apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    vocab = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for i, p in enumerate(params):
        if p.logit_bias:
            for tok, bias in p.logit_bias.items():
                if tok < vocab:  # a token past the model's logits cannot be sampled anyway
                    rows.append(i)
                    cols.append(tok)
                    vals.append(bias)
    if rows:
        bias_t = torch.tensor(vals, dtype=logits.dtype).clamp_(-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT)
        logits.index_put_((torch.tensor(rows), torch.tensor(cols)), bias_t, accumulate=True)


def _min_tokens_bans(
    params: Sequence[SamplingParams], outputs: dict[int, Sequence[int]]
) -> list[tuple[int, int]]:
    return [
        (i, tok)
        for i, out in outputs.items()
        if len(out) < params[i].min_tokens
        for tok in params[i].all_stop_token_ids
    ]


def _bad_word_bans(
    params: Sequence[SamplingParams], outputs: dict[int, Sequence[int]]
) -> list[tuple[int, int]]:
    bans = []
    for i, out in outputs.items():
        for word in params[i].bad_words_token_ids:
            k = len(word) - 1
            if k == 0 or (len(out) >= k and list(out[len(out) - k :]) == word[:k]):
                bans.append((i, word[-1]))
    return bans


def _ban(logits: torch.Tensor, bans: list[tuple[int, int]]) -> None:
    vocab = logits.shape[1]
    bans = [(r, c) for r, c in bans if c < vocab]
    if bans:
        rows, cols = zip(*bans, strict=True)
        logits[torch.tensor(rows), torch.tensor(cols)] = _NEG_INF


def _apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    rows: list[int],
    token_ids: Sequence[Sequence[int]],
    num_prompt_tokens: Sequence[int],
) -> None:
    """Penalize only the logits of tokens that occur: each (row, token) pair is gathered once, changed and
    scattered back, as HF's processors do. Full `[rows, V]` temporaries cost more than the arithmetic
    here: each is a fresh 12 MB allocation whose pages fault in (a 64 x 49k batch took 200 ms that way)."""
    vocab = logits.shape[1]
    seen_rows, seen_toks, counts = _pairs(rows, [token_ids[i][num_prompt_tokens[i] :] for i in rows], vocab)
    rep = torch.tensor([params[i].repetition_penalty for i in rows], dtype=logits.dtype)
    if bool((rep != 1.0).any()):
        r, t, _ = _pairs(rows, [token_ids[i] for i in rows], vocab)  # prompt and output alike
        vals, penalty = logits[r, t], rep[_local(r, rows)]
        logits[r, t] = torch.where(vals > 0, vals / penalty, vals * penalty)
    if len(seen_rows):
        local = _local(seen_rows, rows)
        freq = torch.tensor([params[i].frequency_penalty for i in rows], dtype=logits.dtype)[local]
        pres = torch.tensor([params[i].presence_penalty for i in rows], dtype=logits.dtype)[local]
        logits[seen_rows, seen_toks] -= freq * counts.to(logits.dtype) + pres


def _pairs(
    rows: list[int], seqs: list[Sequence[int]], vocab: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct (row, token) pairs of `seqs` (`seqs[j]` belongs to `rows[j]`), with their counts;
    tokens past the vocabulary are dropped."""
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    flat = torch.tensor(list(chain.from_iterable(seqs)), dtype=torch.int64)
    row_of = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), lengths)
    keep = flat < vocab
    keys, counts = torch.unique(row_of[keep] * vocab + flat[keep], return_counts=True)
    return keys // vocab, keys % vocab, counts


def _local(batch_rows: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Each of `batch_rows`' position in `rows` (which is sorted)."""
    return torch.searchsorted(torch.tensor(rows, dtype=torch.int64), batch_rows)
