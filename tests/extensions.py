"""Worker extensions that the executor tests drive through `worker_extension`."""

from __future__ import annotations

import ctypes
import os
import signal
import time
from typing import Any

import torch

from asyncexec.messages import ModelRunnerOutput, SchedulerOutput


class EchoExtension:
    """Mixed into the worker: `self.rank` and friends come from `Worker`."""

    rank: int

    def echo(self, value: Any) -> Any:
        return value

    def whoami(self) -> int:
        return self.rank

    def pid(self) -> int:
        return os.getpid()

    def greet(self, name: str, *, punctuation: str = "!") -> str:
        return f"hello {name} from rank {self.rank}{punctuation}"

    def add(self, t: torch.Tensor, k: float) -> torch.Tensor:
        return t + k

    def checksum(self, t: torch.Tensor) -> float:
        return float(t.double().sum())

    def fail_on(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"boom on rank {rank}")
        return self.rank

    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    def sleep_on(self, rank: int, seconds: float) -> int:
        if self.rank == rank:
            time.sleep(seconds)
        return self.rank

    def exit_now(self, code: int) -> None:
        os._exit(code)

    def segfault(self) -> None:
        ctypes.string_at(0)

    def ignore_sigterm(self) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def num_fds(self) -> int:
        return len(os.listdir("/proc/self/fd"))

    def unsendable(self) -> object:
        return object()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """No model: one fake token per scheduled request, so the wire path can be measured alone."""
        req_ids = [r.req_id for r in scheduler_output.scheduled_new_reqs]
        req_ids += scheduler_output.scheduled_cached_reqs.req_ids
        return ModelRunnerOutput(req_ids, [[len(r) + self.rank] for r in req_ids])


class FailingInitExtension:
    """Rank 1 raises while the worker is being built."""

    def __init__(self, config: Any, rank: int, *args: Any) -> None:
        if rank == 1:
            raise RuntimeError("rank 1 refuses to start")
        super().__init__(config, rank, *args)  # type: ignore[call-arg]


class DieOnLoadExtension:
    """`load_model` exits the process while the file named by $ASYNCEXEC_TEST_DIE_ON_LOAD exists."""

    def load_model(self) -> None:
        marker = os.environ.get("ASYNCEXEC_TEST_DIE_ON_LOAD")
        if marker and os.path.exists(marker):
            os._exit(3)
        super().load_model()  # type: ignore[misc]


class Rank0FailsAtInitExtension:
    """Rank 0 never joins the process group, so rank 1 waits in the rendezvous, in C++.

    $ASYNCEXEC_TEST_INIT_FAILURE says how: "exit" (after writing the time to $ASYNCEXEC_TEST_STAMP) or
    "raise".
    """

    rank: int

    def init_device(self) -> None:
        if self.rank == 0:
            time.sleep(0.5)
            if os.environ["ASYNCEXEC_TEST_INIT_FAILURE"] == "raise":
                raise RuntimeError("rank 0 has no device")
            with open(os.environ["ASYNCEXEC_TEST_STAMP"], "w") as f:
                f.write(repr(time.time()))
            os._exit(1)
        super().init_device()  # type: ignore[misc]


class FailingStepExtension:
    """`execute_model` raises on every rank, as a failing kernel would, in a step that schedules a request
    whose id starts with "boom"; the process serves on. (Every rank: one rank failing alone would leave
    the others waiting in the forward's collectives.)"""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        ids = [r.req_id for r in scheduler_output.scheduled_new_reqs]
        ids += scheduler_output.scheduled_cached_reqs.req_ids
        bad = [rid for rid in ids if rid.startswith("boom")]
        if bad:
            raise RuntimeError(f"kernel failed on {bad[0]}")
        return super().execute_model(scheduler_output)  # type: ignore[misc,no-any-return]
