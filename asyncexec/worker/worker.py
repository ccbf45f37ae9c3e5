"""The worker: the object every rank's loop dispatches calls to.

`build_worker` mixes the configured `worker_extension` class in front of `Worker` (so its public
methods are served through `collective_rpc` and see `self.rank`, `self.config`, ...), then constructs it.
Only public methods (no leading underscore) defined on the class are callable from the executor.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncexec.config import EngineConfig
from asyncexec.errors import ConfigError
from asyncexec.messages import ModelRunnerOutput, SchedulerOutput

__all__ = ["GPUWorker", "MethodSpec", "Worker", "build_worker", "lookup_method"]

logger = logging.getLogger(__name__)

# On CPU without `kv_cache_memory_bytes`, this share of MemAvailable is offered to the KV cache.
CPU_KV_CACHE_FRACTION = 0.25


class Worker:
    """One rank. Model-facing duties (`init_device`, `load_model`, ...) need `config.model`."""

    def __init__(self, config: EngineConfig, rank: int, local_rank: int, world_size: int) -> None:
        if config.model is not None:
            raise ConfigError(
                f"model={config.model!r}: this version of asyncexec runs the runtime alone; "
                "start it with model=None and drive the ranks through worker_extension methods"
            )
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = world_size

    def check_health(self) -> None:
        """Raises if this rank cannot serve; the executor's health check calls it on every rank."""

    def determine_available_memory(self) -> int:
        """Bytes this rank can give to the KV cache."""
        return int(_mem_available_bytes() * CPU_KV_CACHE_FRACTION)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._require_model("initialize_kv_cache")

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._require_model("execute_model")
        raise AssertionError("unreachable: a worker with a model is refused at construction")

    def shutdown(self) -> None:
        """Releases this rank's resources; called once before the worker exits."""

    def _require_model(self, method: str) -> None:
        if self.config.model is None:
            raise RuntimeError(
                f"{method} needs a model, but this executor was started with model=None "
                "(the runtime alone: collective_rpc and worker_extension methods only)"
            )


GPUWorker = Worker  # vLLM's name for the same role


def _mem_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resolve_worker_class(config: EngineConfig) -> type[Worker]:
    """`Worker`, or a subclass with `config.worker_extension` mixed in before it."""
    if config.worker_extension is None:
        return Worker
    module_name, _, class_name = config.worker_extension.partition(":")
    try:
        ext = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ImportError(f"cannot load worker_extension {config.worker_extension!r}: {e}") from e
    if not isinstance(ext, type):
        raise TypeError(f"worker_extension {config.worker_extension!r} is not a class")
    overridden = sorted(n for n in vars(ext) if not n.startswith("_") and hasattr(Worker, n))
    if overridden:
        logger.debug(
            "worker_extension %s overrides Worker.%s", ext.__qualname__, ", Worker.".join(overridden)
        )
    return type(f"{ext.__name__}Worker", (ext, Worker), {})


def build_worker(config: EngineConfig, rank: int, local_rank: int, world_size: int) -> Worker:
    return resolve_worker_class(config)(config, rank, local_rank, world_size)


@dataclass(frozen=True)
class MethodSpec:
    """A callable worker method and the types its arguments are decoded as (Any where unannotated)."""

    fn: Callable[..., Any]
    positional: tuple[Any, ...]
    var_positional: Any | None
    keyword: dict[str, Any]


def lookup_method(worker: Worker, name: str) -> MethodSpec:
    """The public method `name` of `worker`, or AttributeError naming what is served."""
    attr = getattr(type(worker), name, None) if not name.startswith("_") else None
    if attr is None or not callable(attr) or isinstance(attr, (type, property)):
        served = sorted(
            n for n in dir(type(worker)) if not n.startswith("_") and callable(getattr(worker, n))
        )
        raise AttributeError(f"worker has no public method {name!r}; it serves {served}")
    fn = getattr(worker, name)
    try:
        hints = typing.get_type_hints(attr)
    except Exception:  # unresolvable annotations: decode those arguments untyped
        hints = {}
    positional: list[Any] = []
    var_positional = None
    keyword: dict[str, Any] = {}
    for p in inspect.signature(fn).parameters.values():
        hint = hints.get(p.name, Any)
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            positional.append(hint)
        elif p.kind is p.VAR_POSITIONAL:
            var_positional = hint
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            keyword[p.name] = hint
    return MethodSpec(fn, tuple(positional), var_positional, keyword)
