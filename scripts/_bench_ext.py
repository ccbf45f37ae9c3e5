"""A worker extension for the benchmarks: the wire path alone, no model work."""

from __future__ import annotations

import torch

from asyncexec.messages import ModelRunnerOutput, SchedulerOutput


class BenchExtension:
    rank: int

    def noop(self) -> None:
        return None

    def nbytes(self, t: torch.Tensor) -> int:
        """Receives a tensor without touching its bytes (the zero-copy view alone)."""
        return t.numel() * t.element_size()

    def echo(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        req_ids = [r.req_id for r in scheduler_output.scheduled_new_reqs]
        req_ids += scheduler_output.scheduled_cached_reqs.req_ids
        return ModelRunnerOutput(req_ids, [[1] for _ in req_ids])
