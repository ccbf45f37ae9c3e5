"""asyncexec: an asyncio-native execution runtime for LLM inference."""

from asyncexec.config import EngineConfig
from asyncexec.engine import AsyncEngine
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
from asyncexec.outputs import RequestOutput
from asyncexec.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "AsyncEngine",
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
    "RequestOutput",
    "SamplingParams",
    "SchedulerOutput",
    "UniProcExecutor",
    "WorkerDiedError",
    "WorkerFailedError",
    "WorkerStartupError",
    "__version__",
]
