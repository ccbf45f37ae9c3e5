"""`StructuredOutputRequest`: one request's grammar (compiling, then a matcher) and what it accepted.

The matcher is a function of the request's kept output tokens: `sync` brings it to exactly
`output_token_ids` before every mask, rolling back tokens it accepted that were dropped (or rebuilding
it from the compiled grammar where rollback cannot) and accepting kept tokens it has not seen. So a
preemption, a recompute or a restart of the workers can never leave it out of step with the request.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from asyncexec.errors import InvalidRequestError
from asyncexec.sampling_params import StructuredOutputsParams

__all__ = ["StructuredOutputRequest"]


class StructuredOutputRequest:
    def __init__(self, params: StructuredOutputsParams, compiled: Future[Any]) -> None:
        self.params = params
        self.compiled = compiled  # a matcher in its start state, shared through a cache: never advanced
        self.matcher: Any = None
        self.num_accepted = 0  # output tokens the matcher has accepted
        self.error: BaseException | None = None
        self.terminated = False  # the request ended because its grammar was complete

    @property
    def is_ready(self) -> bool:
        """The manager saw the grammar compiled: the request may be scheduled (only then)."""
        return self.matcher is not None

    def poll(self) -> bool:
        """Whether compiling ended (the matcher is then made, or `error` set); called by the manager
        alone, once per step, so that a compile ending mid-step changes nothing until the next."""
        if self.matcher is None and self.error is None and self.compiled.done():
            error = self.compiled.exception()
            if error is None:
                self.matcher = self.compiled.result().deep_copy()
            else:
                self.error = error
        return self.matcher is not None or self.error is not None

    def sync(self, output_token_ids: list[int]) -> None:
        """Bring the matcher to the state after exactly `output_token_ids` (see the module's notes)."""
        n = len(output_token_ids)
        if self.num_accepted > n and not self.matcher.rollback(self.num_accepted - n):
            self.matcher, self.num_accepted = self.compiled.result().deep_copy(), 0
        self.num_accepted = min(self.num_accepted, n)
        if self.num_accepted < n:
            self.accept(output_token_ids[self.num_accepted :])

    def accept(self, tokens: list[int]) -> None:
        """Advance the matcher with sampled tokens; a token the grammar forbids is an error of this
        request alone (the mask makes it impossible unless something is wrong)."""
        if not self.matcher.consume_tokens(tokens):
            raise InvalidRequestError(
                f"{self.params.kind}: the grammar rejected tokens {tokens}: {self.matcher.get_error()}",
                param=self.params.kind,
            )
        self.num_accepted += len(tokens)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing more (only EOS): the request ends here."""
        return bool(self.matcher.is_stopped())
