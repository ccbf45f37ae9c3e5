"""The worker: the object every rank's loop dispatches calls to.

`build_worker` mixes the configured `worker_extension` class in front of `Worker` (so its public
methods are served through `collective_rpc` and see `self.rank`, `self.config`, ...), then constructs it.
Only public methods (no leading underscore) defined on the class are callable from the executor.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
import os
import random
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asyncexec.config import EngineConfig
from asyncexec.errors import ConfigError
from asyncexec.messages import ModelRunnerOutput, SchedulerOutput
from asyncexec.worker.model_runner import ModelRunner

__all__ = ["GPUWorker", "MethodSpec", "Worker", "build_worker", "lookup_method"]

logger = logging.getLogger(__name__)

# Served straight from the `ModelRunner` where no worker_extension overrides them (`lookup_method`).
SERVED_BY_RUNNER = frozenset({"execute_model"})
# On CPU without `kv_cache_memory_bytes`: this share of MemAvailable, at most CPU_KV_CACHE_MAX_BYTES.
CPU_KV_CACHE_FRACTION = 0.25
CPU_KV_CACHE_MAX_BYTES = 4 << 30


class Worker:
    """One rank: `init_device`, `load_model`, `profile_run` / `determine_available_memory`,
    `allocate_kv_cache` and `execute_model`. With `config.model=None` it serves only the runtime
    (`check_health`, extension methods); the model duties then say so.
    """

    def __init__(
        self,
        config: EngineConfig,
        rank: int,
        local_rank: int,
        world_size: int,
        distributed_init_method: str | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = world_size
        self.distributed_init_method = distributed_init_method
        self.device: torch.device | None = None
        self.model_runner: ModelRunner | None = None

    # ----- vLLM's duties --------------------------------------------------------------------------

    def init_device(self) -> None:
        """Pick the device, join the process group (gloo on CPU, nccl on CUDA), seed everything."""
        want = self.config.device
        if want == "auto":
            want = "cuda" if torch.cuda.is_available() else "cpu"
        if want == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError("device='cuda' but torch sees no CUDA device")
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            if self.world_size > 1:  # ranks share the cores: oversubscribed threads stall every collective
                torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // self.world_size))
        if self.world_size > 1:
            import torch.distributed as dist

            if self.distributed_init_method is None:
                raise ConfigError("several ranks need a distributed_init_method")
            if not dist.is_initialized():
                dist.init_process_group(
                    "nccl" if self.device.type == "cuda" else "gloo",
                    init_method=self.distributed_init_method,
                    rank=self.rank,
                    world_size=self.world_size,
                )
        random.seed(self.config.seed)
        np.random.seed(self.config.seed)
        torch.manual_seed(self.config.seed)
        self.model_runner = ModelRunner(self.config, self.device, self.world_size, self.rank)

    def load_model(self) -> None:
        if self.rank != 0:
            import transformers

            transformers.utils.logging.disable_progress_bar()
        self._runner("load_model").load_model()

    def profile_run(self) -> None:
        self._runner("profile_run").profile_run()

    def determine_available_memory(self) -> int:
        """Bytes this rank can give to the KV cache.

        With a model: on CUDA, `total * gpu_memory_utilization` minus the peak of a profile run at
        `max_num_batched_tokens`; on CPU, `kv_cache_memory_bytes`, else CPU_KV_CACHE_FRACTION of
        MemAvailable, capped at CPU_KV_CACHE_MAX_BYTES. Without a model, the CPU answer.
        """
        has_model = self.model_runner is not None and self.model_runner.model is not None
        if self.config.kv_cache_memory_bytes is not None:
            if has_model:
                self._profiled_runner("determine_available_memory")
            return self.config.kv_cache_memory_bytes
        if self.device is not None and self.device.type == "cuda":  # the peak must be measured afresh
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.profile_run()
            total = torch.cuda.mem_get_info(self.device)[1]
            peak = torch.cuda.max_memory_allocated(self.device)
            return max(0, int(total * self.config.gpu_memory_utilization) - peak)
        if has_model:
            self._profiled_runner("determine_available_memory")
        return min(int(_mem_available_bytes() * CPU_KV_CACHE_FRACTION), CPU_KV_CACHE_MAX_BYTES)

    def get_kv_cache_block_bytes(self) -> int:
        """Bytes one KV block takes on this rank (all layers, K and V)."""
        return self._profiled_runner("get_kv_cache_block_bytes").kv_cache_block_bytes()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._profiled_runner("allocate_kv_cache").allocate_kv_cache(num_blocks)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache, then capture CUDA graphs or compile CPU decode graphs."""
        self.allocate_kv_cache(num_blocks)
        self.compile_or_warm_up_model()

    def compile_or_warm_up_model(self) -> None:
        self._runner("compile_or_warm_up_model").capture_model(progress=self.rank == 0)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One step. The executor's calls reach `ModelRunner.execute_model` directly (`lookup_method`),
        unless a `worker_extension` overrides this method (which may call it through `super()`)."""
        return self._runner("execute_model").execute_model(scheduler_output)

    def get_runner_stats(self) -> dict[str, float]:
        """Cumulative step counts and times: `graph_steps` replayed a captured or compiled graph,
        `guard_free_steps` of them called the compiled code without dynamo's guards (CPU), `forward_s` is
        the model forward alone."""
        return dict(self._runner("get_runner_stats").stats)

    def get_model_info(self) -> dict[str, Any]:
        """What the scheduler needs to know of the model."""
        runner = self._runner("get_model_info")
        eos = getattr(runner.hf_config, "eos_token_id", None)
        return {
            "architecture": runner.arch,
            "max_model_len": runner.max_model_len,
            "vocab_size": int(runner.hf_config.get_text_config().vocab_size),
            "eos_token_ids": [eos] if isinstance(eos, int) else list(eos or []),
            "attention_crossover": attention_crossover(runner.model, runner.hf_config.get_text_config()),
        }

    def check_health(self) -> None:
        """Raises if this rank cannot serve; the executor's health check calls it on every rank."""

    def shutdown(self) -> None:
        """Releases this rank's resources; called once before the worker exits."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    def _profiled_runner(self, method: str) -> ModelRunner:
        """The runner, after one profile run (which sizes the KV cache): start-up profiles once."""
        runner = self._runner(method)
        if not runner.kv_spec:
            runner.profile_run()
        return runner

    def _runner(self, method: str) -> ModelRunner:
        if self.config.model is None:
            raise RuntimeError(
                f"{method} needs a model, but this executor was started with model=None "
                "(the runtime alone: collective_rpc and worker_extension methods only)"
            )
        if self.model_runner is None:
            raise RuntimeError(f"{method} needs init_device() first")
        return self.model_runner


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


def build_worker(
    config: EngineConfig,
    rank: int,
    local_rank: int,
    world_size: int,
    distributed_init_method: str | None = None,
) -> Worker:
    return resolve_worker_class(config)(config, rank, local_rank, world_size, distributed_init_method)


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
    runner = worker.model_runner if worker.config.model is not None else None
    if name in SERVED_BY_RUNNER and attr is getattr(Worker, name) and runner is not None:
        fn = getattr(runner, name)  # the worker's own method would only pass the call on
    try:
        hints = typing.get_type_hints(fn)
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


def attention_crossover(model: torch.nn.Module, text_config: Any) -> int:
    """The context length at which a prefill token's attention takes as long as its linear layers. In
    FLOPs: linear weights (lm_head aside, it runs once per sequence) over 2 x layers x heads x head size
    (a score and a weighted value, a multiply-add each, per key); attention runs at about half the GEMMs'
    FLOP rate (fitted on SmolLM2, 2 cores: 2.4x), hence the 4. The scheduler's prefill cap shrinks with
    context by it."""
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    skip = get_output_embeddings() if callable(get_output_embeddings) else None
    params = 0
    for m in model.modules():
        weight = getattr(m, "weight", None)
        if m is not skip and not isinstance(m, torch.nn.Embedding) and isinstance(weight, torch.Tensor):
            params += math.prod(weight.shape) if weight.dim() == 2 else 0
    heads = int(text_config.num_attention_heads)
    head_dim = int(getattr(text_config, "head_dim", None) or text_config.hidden_size // heads)
    return max(1, params // (4 * int(text_config.num_hidden_layers) * heads * head_dim))
