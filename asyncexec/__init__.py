"""asyncexec: an asyncio-native execution runtime for LLM inference."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
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


# Modules that moved when the package was grouped into layers (engine/, core/, worker/graphs/), under
# their old names: `import asyncexec.scheduler` gives the module itself (one object, so a monkeypatch
# through either name reaches the code).
MOVED_MODULES = {
    **{
        f"asyncexec.{m}": f"asyncexec.engine.{m}"
        for m in ("supervisor", "processor", "detokenizer", "parallel_sampling", "metrics")
    },
    **{f"asyncexec.{m}": f"asyncexec.core.{m}" for m in ("scheduler", "kv_cache", "request")},
    "asyncexec.models": "asyncexec.testing",
    "asyncexec.worker.cpu_graph": "asyncexec.worker.graphs.cpu",
    "asyncexec.worker.cuda_graph": "asyncexec.worker.graphs.cuda",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a module of MOVED_MODULES under its old name as the module of its new one."""

    def find_spec(
        self, fullname: str, path: Any = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED_MODULES else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(MOVED_MODULES[spec.name])
        module.__dict__.setdefault("__moved_spec__", module.__spec__)  # the import system resets it
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__spec__ = module.__dict__.pop("__moved_spec__")


if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedModuleFinder())


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
