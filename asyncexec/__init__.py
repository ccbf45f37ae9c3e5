"""asyncexec: an asyncio-native execution runtime for LLM inference."""

from asyncexec.config import EngineConfig
from asyncexec.errors import (
    AsyncExecError,
    ConfigError,
    EngineOverloadedError,
    ExecutorClosedError,
    ExecutorTimeoutError,
    InvalidRequestError,
    ProtocolError,
    WorkerDiedError,
    WorkerFailedError,
    WorkerStartupError,
)
from asyncexec.executor import Executor, MultiProcExecutor, UniProcExecutor
from asyncexec.messages import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from asyncexec.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "AsyncExecError",
    "CachedRequestData",
    "ConfigError",
    "EngineConfig",
    "EngineOverloadedError",
    "Executor",
    "ExecutorClosedError",
    "ExecutorTimeoutError",
    "InvalidRequestError",
    "ModelRunnerOutput",
    "MultiProcExecutor",
    "NewRequestData",
    "ProtocolError",
    "SamplingParams",
    "SchedulerOutput",
    "UniProcExecutor",
    "WorkerDiedError",
    "WorkerFailedError",
    "WorkerStartupError",
    "__version__",
]
