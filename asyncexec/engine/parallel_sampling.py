"""Parallel sampling (`n > 1`, `best_of`): one request fanned out to copies, their outputs merged back.

As vLLM V1's `ParentRequest`: copy `i` is the request `f"{i}_{request_id}"`, with `n=1` and, when
seeded, `seed + i`, so copies differ from each other and each is reproducible. Copy 0 leads: it alone
prefills the prompt (and computes its prompt logprobs); the scheduler then forks its prompt blocks to
the others. Outputs go back out under the parent's id, each with its copy's `index`.

`best_of > n`: copies keep their sampled tokens' logprobs (`logprobs >= 0`) to rank by; nothing is
streamed; once every copy has finished, the `n` with the highest `cumulative_logprob` are returned,
re-indexed 0..n-1 (without logprobs unless they were asked for).
"""

from __future__ import annotations

import dataclasses

import msgspec

from asyncexec.core.request import Request
from asyncexec.outputs import RequestOutput
from asyncexec.sampling_params import SamplingParams

__all__ = ["ParentRequest", "ParentRequests", "make_requests"]


def make_requests(
    request_id: str, prompt_token_ids: list[int], sp: SamplingParams
) -> tuple[list[Request], ParentRequest | None]:
    """The requests to schedule for one `generate` call: itself, or its copies (copy 0 leads) and their
    parent."""
    if sp.num_copies == 1:
        return [Request(request_id, prompt_token_ids, sp)], None
    parent = ParentRequest(request_id, sp)
    reqs = [
        Request(c, list(prompt_token_ids), parent.child_params(i)) for i, c in enumerate(parent.child_ids)
    ]
    return reqs, parent


class ParentRequest:
    def __init__(self, request_id: str, sp: SamplingParams) -> None:
        self.request_id = request_id
        self.sampling_params = sp
        self.n = sp.n
        self.ranked = sp.best_of is not None and sp.best_of > sp.n
        self.child_ids = [f"{i}_{request_id}" for i in range(sp.num_copies)]
        self.num_finished = 0  # outputs with `finished` handed out so far
        self._finals: dict[int, RequestOutput] = {}
        self._prompt_logprobs: tuple[list[dict[int, float] | None], list[int | None]] | None = None

    @property
    def finished(self) -> bool:
        return self.num_finished >= self.n

    def child_params(self, index: int) -> SamplingParams:
        sp = self.sampling_params
        seed = None if sp.seed is None else (sp.seed + index + 2**63) % 2**64 - 2**63  # stays in 64 bits
        logprobs = (sp.logprobs or 0) if self.ranked else sp.logprobs
        return msgspec.structs.replace(
            sp,
            n=1,
            best_of=None,
            seed=seed,
            logprobs=logprobs,
            prompt_logprobs=sp.prompt_logprobs if index == 0 else None,
        )

    def process(self, out: RequestOutput, index: int) -> list[RequestOutput]:
        """Copy `index`'s output as the parent's outputs: itself re-labelled, or, ranking, nothing until
        every copy has finished and then the n best."""
        out.request_id, out.index = self.request_id, index
        self._share_prompt_logprobs(out)
        if not self.ranked:
            self.num_finished += out.finished
            return [out]
        if not out.finished:
            return []
        self._finals[index] = out
        if len(self._finals) < len(self.child_ids):
            return []
        best = sorted(self._finals.values(), key=lambda o: -(o.cumulative_logprob or 0.0))[: self.n]
        keep = self.sampling_params.logprobs is not None
        self.num_finished = self.n
        return [
            dataclasses.replace(
                o,
                index=i,
                logprobs=o.logprobs if keep else None,
                cumulative_logprob=o.cumulative_logprob if keep else None,
            )
            for i, o in enumerate(best)
        ]

    def _share_prompt_logprobs(self, out: RequestOutput) -> None:
        """Only copy 0 computes prompt logprobs; every copy's outputs carry them."""
        if self.sampling_params.prompt_logprobs is None:
            return
        if out.prompt_logprobs is not None:
            self._prompt_logprobs = (out.prompt_logprobs, out.prompt_logprob_ranks or [])
        elif self._prompt_logprobs is not None:
            out.prompt_logprobs, out.prompt_logprob_ranks = self._prompt_logprobs


class ParentRequests:
    """The engine's parents: which request id each copy belongs to."""

    def __init__(self) -> None:
        self.parents: dict[str, ParentRequest] = {}
        self._children: dict[str, tuple[ParentRequest, int]] = {}

    def add(self, parent: ParentRequest) -> None:
        self.parents[parent.request_id] = parent
        for i, cid in enumerate(parent.child_ids):
            self._children[cid] = (parent, i)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.parents or request_id in self._children

    def stream_id(self, request_id: str) -> str:
        """The id a stream waits on: the parent's for a copy, else the request's own."""
        child = self._children.get(request_id)
        return child[0].request_id if child is not None else request_id

    def route(self, out: RequestOutput) -> list[RequestOutput]:
        """A copy's output as its parent's (see `ParentRequest.process`); any other passes through."""
        child = self._children.get(out.request_id)
        if child is None:
            return [out]
        parent, index = child
        if out.finished:
            del self._children[out.request_id]
        routed = parent.process(out, index)
        if parent.finished:
            self.parents.pop(parent.request_id, None)
        return routed

    def forget(self, request_id: str) -> None:
        """Drop a parent (its stream is gone) and its copies' entries."""
        parent = self.parents.pop(request_id, None)
        if parent is not None:
            for cid in parent.child_ids:
                self._children.pop(cid, None)
