"""`EngineCore`: the first half of a step, with no tokenizer and no streams: schedule, run on every rank,
update the scheduler (vLLM V1's `EngineCore.step`).

`AsyncEngine.step()` is `EngineCore.schedule_and_run()`, then `EngineCore.update()` and the engine's own
processing of the outputs (detokenization, stop strings, streams). Tests that drive an executor's workers
by hand run the same two calls on a scheduler of their own, so they see the `SchedulerOutput`s
production sends.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from asyncexec.core.request import Request
from asyncexec.core.scheduler import Scheduler
from asyncexec.errors import WorkerFailedError
from asyncexec.executor import Executor
from asyncexec.messages import ModelRunnerOutput, SchedulerOutput
from asyncexec.structured_output import StructuredOutputManager

__all__ = ["EngineCore", "ScheduledStep"]

logger = logging.getLogger(__name__)


@dataclass
class ScheduledStep:
    """A scheduled step and what came of it: the ranks' output, the error a rank raised running it
    (`WorkerFailedError`), or neither where nothing could run yet (every request waits on a grammar)."""

    scheduler_output: SchedulerOutput
    output: ModelRunnerOutput | None = None
    error: WorkerFailedError | None = None


class EngineCore:
    """The scheduler and (optionally) the structured-output manager, stepped on an executor."""

    def __init__(self, scheduler: Scheduler, structured: StructuredOutputManager | None = None) -> None:
        self.scheduler = scheduler
        self.structured = structured

    async def schedule_and_run(self, executor: Executor) -> ScheduledStep:
        """Schedule one step, attach the grammar masks, run it on every rank. A rank's error running it
        comes back in the step; any other failure (a dead worker, a closed executor) is raised."""
        so = self.scheduler.schedule()
        structured = self.structured
        if structured is not None:
            if not so.num_scheduled_tokens and not so.finished_req_ids and structured.has_pending:
                await structured.wait_for_grammars()  # nothing to run until one compiles
                return ScheduledStep(so)
            structured.fill_bitmask(so, self.scheduler.requests)
        try:
            return ScheduledStep(so, await executor.execute_model(so))
        except WorkerFailedError as e:
            return ScheduledStep(so, error=e)

    def update(
        self, step: ScheduledStep
    ) -> tuple[list[tuple[Request, list[int]]], list[tuple[Request, Exception]]]:
        """Apply a step's output to the scheduler and the grammars: `(request, new tokens)` for every
        request that progressed, and `(request, error)` for every one that failed alone (finished with
        "error"), a grammar rejecting its token included."""
        assert step.output is not None, "update() takes a step that ran"
        progressed, failed = self.scheduler.update_from_output(step.scheduler_output, step.output)
        if self.structured is not None:  # a grammar's end finishes its request here
            failed += self.structured.accept_tokens(progressed, self.scheduler.finish)
        return progressed, failed

    def fail_step(self, step: ScheduledStep) -> list[Request]:
        """The requests of a step that a rank failed to run, to be finished with "error". A rank may have
        failed before applying the step's deltas, so the requests it finished are sent again with the
        next step (dropping a request it no longer holds is a no-op)."""
        so = step.scheduler_output
        logger.error("step %d failed on the workers; its %d requests fail with it", so.step_id,
                     len(so.num_scheduled_tokens))  # fmt: skip
        self.scheduler.resend_finished(so.finished_req_ids)
        return [
            req for rid in so.num_scheduled_tokens if (req := self.scheduler.requests.get(rid)) is not None
        ]
