"""Every exception asyncexec raises, in one place.

The hierarchy::

    AsyncExecError
    +-- ConfigError (ValueError)            a config field is invalid
    +-- ProtocolError (ValueError)          a frame or tensor handle failed validation
    +-- WorkerDiedError                     a worker process or actor is gone
    +-- WorkerFailedError                   a worker raised while serving a call
    +-- WorkerStartupError                  a worker could not start
    +-- ExecutorTimeoutError (TimeoutError) ranks did not reply in time
    +-- ExecutorClosedError                 the executor was shut down or has failed
    +-- RankDisagreementError               ranks sampled differently (debug check)
    +-- InvalidRequestError (ValueError)    a request was rejected before scheduling
    +-- EngineOverloadedError               the waiting queue is full
    +-- EngineStepError                     a step failed in the engine itself; the engine has failed
    +-- RequestFailedError                  one request's own processing failed; the others go on
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = [
    "AsyncExecError",
    "ConfigError",
    "EngineOverloadedError",
    "EngineStepError",
    "ExecutorClosedError",
    "ExecutorTimeoutError",
    "InvalidRequestError",
    "ProtocolError",
    "RankDisagreementError",
    "RequestFailedError",
    "WorkerDiedError",
    "WorkerFailedError",
    "WorkerStartupError",
]

_LEADING_FIELD = re.compile(r"^([a-z_]+)[ :]")


class AsyncExecError(Exception):
    """Raised for any asyncexec failure; the base of every other error here."""


class ConfigError(AsyncExecError, ValueError):
    """Raised when an `EngineConfig` field (or a combination of fields) is invalid."""


class ProtocolError(AsyncExecError, ValueError):
    """Raised when a received frame, message or tensor handle fails validation.

    Nothing that raises this has been acted on: the frame is dropped before dispatch.
    """


class WorkerDiedError(AsyncExecError):
    """Raised when a worker died while calls were pending, or was found dead.

    `exitcode` is the process exit status (negative: killed by that signal), or None where it is not
    known (a Ray actor, say). `detail` carries extra text such as Ray's error.
    """

    def __init__(self, rank: int, exitcode: int | None, detail: str = "") -> None:
        self.rank = rank
        self.exitcode = exitcode
        self.detail = detail
        how = f"exit code {exitcode}" if exitcode is not None else "exit code unknown"
        if exitcode is not None and exitcode < 0:
            how = f"killed by signal {-exitcode}"
        msg = f"worker rank {rank} died ({how})"
        super().__init__(f"{msg}: {detail}" if detail else msg)


class WorkerFailedError(AsyncExecError):
    """Raised when a worker raised an exception while serving a call.

    The remote exception cannot travel as an object (nothing is pickled), so its type name, message
    and formatted traceback travel as text. Where several ranks failed, this names the lowest; all of
    them are in `failures`.
    """

    def __init__(
        self,
        rank: int,
        method: str,
        remote_type: str,
        remote_message: str,
        remote_traceback: str,
        failures: Sequence[WorkerFailedError] = (),
    ) -> None:
        self.rank = rank
        self.method = method
        self.remote_type = remote_type
        self.remote_message = remote_message
        self.remote_traceback = remote_traceback
        self.failures: tuple[WorkerFailedError, ...] = tuple(failures) or (self,)
        others = [f.rank for f in self.failures if f.rank != rank]
        also = f" (ranks {others} failed too)" if others else ""
        super().__init__(
            f"{method!r} failed on rank {rank}: {remote_type}: {remote_message}{also}\n"
            f"--- remote traceback (rank {rank}) ---\n{remote_traceback}"
        )


class WorkerStartupError(AsyncExecError):
    """Raised when a worker could not start; carries the failing rank and its traceback."""

    def __init__(self, rank: int, message: str, remote_traceback: str = "") -> None:
        self.rank = rank
        self.remote_message = message
        self.remote_traceback = remote_traceback
        tail = f"\n--- remote traceback (rank {rank}) ---\n{remote_traceback}" if remote_traceback else ""
        super().__init__(f"worker rank {rank} failed to start: {message}{tail}")


class ExecutorTimeoutError(AsyncExecError, TimeoutError):
    """Raised when some ranks did not reply to a call within its timeout.

    `missing_ranks` (also `ranks`) lists the ranks that did not reply. The executor stays usable: late
    replies are discarded when they arrive.
    """

    def __init__(self, method: str, timeout: float, missing_ranks: Sequence[int]) -> None:
        self.method = method
        self.timeout = timeout
        self.missing_ranks = list(missing_ranks)
        self.ranks = self.missing_ranks
        super().__init__(
            f"{method!r} timed out after {timeout:g} s; no reply from ranks {self.missing_ranks}"
        )


class ExecutorClosedError(AsyncExecError):
    """Raised when an executor is used before start, after shutdown, or after it failed.

    After a failure, the original error is chained as `__cause__`.
    """


class RankDisagreementError(AsyncExecError):
    """Raised when `check_rank_agreement` is on and two ranks sampled different tokens in a step."""


class InvalidRequestError(AsyncExecError, ValueError):
    """Raised when a request is rejected at submission; the message names the offending field.

    `param` is that field (`"max_tokens"`, `"prompt"`, ...): given, or else the message's first word,
    since every message starts with the field it is about.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        match = _LEADING_FIELD.match(message)
        self.param = param if param is not None else (match.group(1) if match else None)


class EngineOverloadedError(AsyncExecError):
    """Raised when a request arrives while the waiting queue already holds its maximum."""


class EngineStepError(AsyncExecError):
    """Raised when a step fails in the engine itself (scheduling, applying a step's output), outside any
    worker; the engine has failed, as after a worker death. The original error is the `__cause__`."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"engine step failed: {type(cause).__name__}: {cause}")
        self.__cause__ = cause


class RequestFailedError(AsyncExecError):
    """Raised to one request's stream when processing that request alone failed (its stop check, its
    detokenization): it is finished with finish_reason "error" and the engine serves the others.
    `request_id` names it; the original error is the `__cause__`."""

    def __init__(self, request_id: str, cause: BaseException) -> None:
        super().__init__(f"request {request_id!r} failed: {type(cause).__name__}: {cause}")
        self.request_id = request_id
        self.__cause__ = cause
