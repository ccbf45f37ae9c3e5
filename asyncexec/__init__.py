"""asyncexec: an asyncio-native execution runtime for LLM inference."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from asyncexec.config import EngineConfig
from asyncexec.errors import (
    AsyncExecError,
    ConfigError,
    EngineOverloadedError,
    EngineStepError,
    ExecutorClosedError,
    ExecutorTimeoutError,
    InvalidRequestError,
    ProtocolError,
    RequestFailedError,
    WorkerDiedError,
    WorkerFailedError,
    WorkerStartupError,
)
from asyncexec.outputs import RequestOutput
from asyncexec.sampling_params import SamplingParams

if TYPE_CHECKING:
    from asyncexec.engine import AsyncEngine
    from asyncexec.executor import Executor, MultiProcExecutor, UniProcExecutor
    from asyncexec.messages import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput

# These import torch: loaded on first use, so that `python -m asyncexec --help` and usage errors are quick.
_LAZY = {
    "AsyncEngine": "asyncexec.engine",
    **dict.fromkeys(["Executor", "MultiProcExecutor", "UniProcExecutor"], "asyncexec.executor"),
    **dict.fromkeys(
        ["CachedRequestData", "ModelRunnerOutput", "NewRequestData", "SchedulerOutput"], "asyncexec.messages"
    ),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncexec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__version__ = "0.1.0"

__all__ = [
    "AsyncEngine",
    "AsyncExecError",
    "CachedRequestData",
    "ConfigError",
    "EngineConfig",
    "EngineOverloadedError",
    "EngineStepError",
    "Executor",
    "ExecutorClosedError",
    "ExecutorTimeoutError",
    "InvalidRequestError",
    "ModelRunnerOutput",
    "MultiProcExecutor",
    "NewRequestData",
    "ProtocolError",
    "RequestFailedError",
    "RequestOutput",
    "SamplingParams",
    "SchedulerOutput",
    "UniProcExecutor",
    "WorkerDiedError",
    "WorkerFailedError",
    "WorkerStartupError",
    "__version__",
]
