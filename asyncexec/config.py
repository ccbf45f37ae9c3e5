"""The one frozen config tree.

`EngineConfig` is validated once, in `__post_init__`, and sent to every worker once at spawn as msgpack
(msgspec encodes and decodes frozen dataclasses natively and re-runs `__post_init__` on decode). Nothing on
a hot path reads environment variables; derived values are properties.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Literal

from asyncexec.errors import ConfigError

__all__ = ["DeviceKind", "EngineConfig", "ExecutorKind"]

ExecutorKind = Literal["uni", "mp", "ray"]
DeviceKind = Literal["auto", "cpu", "cuda"]

_EXECUTORS = ("uni", "mp", "ray")
_DEVICES = ("auto", "cpu", "cuda")
_EXTENSION_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
MiB = 1 << 20


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine, its executor and its workers need to start.

    Fields:
        model: a local Hugging Face model folder, or None to run the runtime alone (no model; the
            workers serve `collective_rpc` and `worker_extension` methods only).
        tensor_parallel_size: the number of worker ranks.
        executor: "uni" (in-process), "mp" (worker processes) or "ray"; None picks "uni" for one rank,
            else "mp".
        device: "cpu", "cuda", or "auto" (cuda when available).
        worker_extension: "package.module:Class", mixed into the worker class (before it in the MRO), so
            its public methods are served through `collective_rpc` with the worker's attributes
            (`self.rank`, `self.config`, ...).
        rpc_timeout_s: the default timeout of one call, in seconds; None waits for ever (a dead worker
            still fails the call at once).
        worker_start_timeout_s: how long start-up may take before it fails.
        shm_arena_bytes: the size of each process's outbound shared-memory arena; 0 sends every large
            tensor through a one-off segment.
        inline_tensor_bytes: tensors of at most this many bytes travel inside the message itself.
    """

    model: str | None = None
    tensor_parallel_size: int = 1
    executor: ExecutorKind | None = None
    device: DeviceKind = "auto"
    worker_extension: str | None = None
    rpc_timeout_s: float | None = 300.0
    worker_start_timeout_s: float = 300.0
    shm_arena_bytes: int = 128 * MiB
    inline_tensor_bytes: int = 16 * 1024

    def __post_init__(self) -> None:
        _check_int("tensor_parallel_size", self.tensor_parallel_size, minimum=1)
        _check_int("shm_arena_bytes", self.shm_arena_bytes, minimum=0)
        _check_int("inline_tensor_bytes", self.inline_tensor_bytes, minimum=0)
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ConfigError(f"model must be a non-empty path string or None, got {self.model!r}")
        if self.executor is not None and self.executor not in _EXECUTORS:
            raise ConfigError(f"executor must be one of {_EXECUTORS} or None, got {self.executor!r}")
        if self.device not in _DEVICES:
            raise ConfigError(f"device must be one of {_DEVICES}, got {self.device!r}")
        if self.worker_extension is not None and not (
            isinstance(self.worker_extension, str) and _EXTENSION_RE.match(self.worker_extension)
        ):
            raise ConfigError(
                f"worker_extension must look like 'package.module:ClassName', got {self.worker_extension!r}"
            )
        if self.rpc_timeout_s is not None:
            _check_positive("rpc_timeout_s", self.rpc_timeout_s)
        _check_positive("worker_start_timeout_s", self.worker_start_timeout_s)

    @property
    def world_size(self) -> int:
        """The number of worker ranks."""
        return self.tensor_parallel_size

    @property
    def executor_kind(self) -> ExecutorKind:
        """The executor actually used: `executor`, or its default for this world size."""
        if self.executor is not None:
            return self.executor
        return "uni" if self.world_size == 1 else "mp"

    def replace(self, **changes: object) -> EngineConfig:
        """A copy with `changes` applied, validated again."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
