"""`asyncexec stress` (also `scripts/stress.py`): a bounded run of random load that checks the invariants.

Clients keep `--concurrency` requests in flight: random prompt and output lengths, some aborted by the
client part-way (closing the stream, or cancelling the task), some invalid on purpose, some greedy
copies of reference prompts whose output must equal the reference computed before any worker was
killed. `--kill-worker-every S` SIGKILLs a random worker rank (mp only; restarting is then on).

Two more kinds probe the engine's limits: "long" requests (`--long-prompt-rate`) have a prompt longer than a
step's token budget, so their prefill is chunked and its first chunks sample nothing (run with
`--quantization int8` and a small `--max-num-batched-tokens`: that once killed a quantized engine);
"oversize" ones (`--oversize-rate`) ask for more tokens than the KV cache holds, where it holds less than
one `max_model_len` sequence (as the default cache does), and must be refused, never left waiting.

The run fails (exit status 1) when a request was lost or errored, a bad request was accepted, a greedy
output disagreed with its reference, the KV pool did not return to full, RSS grew by more than
`--max-rss-growth` after warm-up, or a file descriptor or `/dev/shm/asyncexec-*` segment leaked.
The report is printed and written as JSON.

The greedy check runs in float32 only. In bfloat16 and float16 a greedy output depends on what else is
in the batch (the GEMMs' reduction order changes with the batch's shape), so it may differ from the
reference with no fault at all: with such a dtype (`--dtype`, or "auto" on a checkpoint saved in it)
the check is skipped, the reason printed and written as the report's `greedy_check`.

Defaults come from the model the run loads (`--model`, a folder or a built-in name, else a tiny random
model): 2 ranks when the model's heads, KV heads and MLP width split over 2 (else 1), and a KV cache
of `default_kv_blocks` blocks, a third of what the clients' longest requests take at once, so that
requests get preempted.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncexec.errors import ConfigError

if TYPE_CHECKING:
    from asyncexec.config import EngineConfig

__all__ = [
    "ModelFacts",
    "add_stress_args",
    "default_kv_blocks",
    "greedy_skip_reason",
    "model_facts",
    "run_stress",
    "stress_config",
]

_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def add_stress_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("stress run")
    g.add_argument(
        "--duration", type=float, default=None, help="seconds of load (default: 60 unless --requests)"
    )
    g.add_argument("--requests", type=int, default=None, help="stop after this many requests instead")
    g.add_argument("--concurrency", type=int, default=16, help="requests in flight (default: 16)")
    g.add_argument("--max-prompt-len", type=int, default=64, help="longest random prompt (default: 64)")
    g.add_argument("--max-output-len", type=int, default=48, help="longest random output (default: 48)")
    g.add_argument(
        "--abort-rate", type=float, default=0.15, help="share of requests the client aborts (0.15)"
    )
    g.add_argument("--bad-request-rate", type=float, default=0.05, help="share of invalid requests (0.05)")
    g.add_argument("--reference-rate", type=float, default=0.2, help="share of greedy reference copies (0.2)")
    g.add_argument(
        "--long-prompt-rate",
        type=float,
        default=0.05,
        help="share of prompts longer than a step's token budget (--max-num-batched-tokens), prefilled in "
        "chunks whose first ones sample nothing, up to 3 budgets or what the model and KV cache hold (0.05)",
    )
    g.add_argument(
        "--oversize-rate",
        type=float,
        default=0.05,
        help="share of requests whose prompt and max_tokens need more KV cache than it holds, which must "
        "be refused; drawn only where the cache holds less than one max_model_len sequence (0.05)",
    )
    g.add_argument(
        "--kill-worker-every",
        type=float,
        default=None,
        metavar="S",
        help="SIGKILL a random worker rank every S seconds of serving (S s after the start, then S s after "
        "each restart completes) until --duration ends; not during the drain (mp executor)",
    )
    g.add_argument("--warmup", type=float, default=5.0, help="seconds of load before the RSS baseline (5)")
    g.add_argument(
        "--max-rss-growth", type=float, default=0.10, help="allowed RSS growth after warm-up (0.10)"
    )
    g.add_argument("--stress-seed", type=int, default=0, help="the run's random seed (default: 0)")
    g.add_argument(
        "--arch", default="llama", help="architecture of the tiny model built when --model is not given"
    )
    g.add_argument("--json", default="bench-results/stress.json", help="where to write the report")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


@dataclass(frozen=True)
class ModelFacts:
    """What the stress defaults need to know of a model folder (read from its config.json)."""

    folder: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # what the workers load it in: --dtype, else the checkpoint's, else float32
    split_dims: dict[str, int]  # the dimensions tensor parallelism splits
    has_tp_plan: bool

    def can_split(self, world_size: int) -> bool:
        """Whether `world_size` ranks can share the model (the check the workers make at start-up)."""
        if world_size == 1:
            return True
        return self.has_tp_plan and all(v % world_size == 0 for v in self.split_dims.values())

    def kv_block_bytes(self, block_size: int, world_size: int) -> int:
        """Bytes of one KV block on one rank: layers * (K and V) * tokens * KV heads * head_dim * dtype."""
        kv_heads = max(1, self.num_kv_heads // world_size)
        return self.num_layers * 2 * block_size * kv_heads * self.head_dim * _ELEMENT_BYTES[self.dtype]


def model_facts(model: str, dtype: str = "auto") -> ModelFacts:
    """The facts of `model` (a folder, a GGUF file or a built-in name), loaded in `dtype`."""
    from asyncexec.gguf.file import load_hf_config
    from asyncexec.model_registry import resolve_model
    from asyncexec.worker.model_checks import SPLIT_DIMS, auto_dtype

    folder = resolve_model(model)
    try:
        hf = load_hf_config(folder)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the model config in {folder!r}: {e}") from e
    text = hf.get_text_config()
    heads = int(text.num_attention_heads)
    if dtype == "auto":  # as the workers resolve it (ModelRunner._dtype)
        dtype = auto_dtype(folder, hf)
    dims = {n: getattr(text, n) for n in SPLIT_DIMS if isinstance(getattr(text, n, None), int)}
    return ModelFacts(
        folder=folder,
        num_layers=int(text.num_hidden_layers),
        num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
        dtype=dtype,
        split_dims=dims,
        has_tp_plan=bool(getattr(hf, "base_model_tp_plan", None)),
    )


def greedy_skip_reason(dtype: str) -> str | None:
    """Why the greedy check cannot hold in `dtype` (None in float32, where it is checked)."""
    if dtype == "float32":
        return None
    return (
        f"skipped: {dtype} greedy output depends on what else is in the batch (GEMM reduction order), "
        "so it can differ from the reference with no fault; the check holds in float32 only"
    )


def default_kv_blocks(ns: argparse.Namespace, block_size: int) -> int:
    """The default KV cache in blocks: a third of what `--concurrency` requests of the longest length
    take (so requests get preempted), and at least 4 of them; plus the null block. With the default
    flags, 38 blocks (608 tokens) for 16 clients whose requests reach 112 tokens (7 blocks)."""
    longest = -(-(ns.max_prompt_len + ns.max_output_len) // block_size)
    return int(max(4 * longest, ns.concurrency * longest // 3)) + 1


def stress_config(ns: argparse.Namespace) -> EngineConfig:
    """The engine config: the flags given, over stress defaults sized for the model `ns.model` resolves
    to: mp; 2 ranks where the model splits over 2, else 1; a KV cache of `default_kv_blocks` blocks."""
    from asyncexec.config import EngineConfig
    from asyncexec.entrypoints.config_args import engine_config_from_args

    if getattr(ns, "model", None) is None:
        raise ConfigError("the stress run needs a model")
    from asyncexec.gguf.file import is_gguf
    from asyncexec.model_registry import resolve_model

    # a GGUF file (the built-in model's too) runs in float32 unless --dtype says otherwise: its default,
    # the file as it ships in bf16, would turn the greedy check off
    dtype = getattr(ns, "dtype", None) or ("float32" if is_gguf(resolve_model(ns.model)) else "auto")
    facts = model_facts(ns.model, dtype)
    world_size = getattr(ns, "tensor_parallel_size", None) or (2 if facts.can_split(2) else 1)
    block_size = getattr(ns, "block_size", EngineConfig.block_size)
    num_blocks = default_kv_blocks(ns, block_size)
    defaults: dict[str, Any] = {
        "dtype": dtype,
        "executor": "mp",
        "tensor_parallel_size": world_size,
        "kv_cache_memory_bytes": num_blocks * facts.kv_block_bytes(block_size, world_size),
    }
    if ns.kill_worker_every:
        defaults["restart_on_worker_failure"] = True
        defaults["max_worker_restarts"] = math.ceil((ns.duration or 600) / ns.kill_worker_every) + 2
    return engine_config_from_args(ns, **{k: v for k, v in defaults.items() if not hasattr(ns, k)})


def run_stress(
    ns: argparse.Namespace, wrap: Callable[[Coroutine[Any, Any, Any]], Coroutine[Any, Any, Any]] | None = None
) -> int:
    """Run the stress test the flags describe; 0 when every invariant held, else 1.

    `wrap` wraps the run's coroutine (the CLI's cancels it on SIGTERM; the library installs no handler).
    """
    import uvloop

    from asyncexec.stress.report import build_report, print_report
    from asyncexec.stress.run import stress

    if ns.requests is None and ns.duration is None:
        ns.duration = 60.0
    if ns.requests is not None and ns.duration is not None:
        raise ConfigError("give --duration or --requests, not both")
    rates = ("bad_request_rate", "reference_rate", "abort_rate", "long_prompt_rate", "oversize_rate")
    if any(not 0 <= getattr(ns, r) <= 1 for r in rates) or sum(getattr(ns, r) for r in rates) > 1:
        shares = ", ".join(f"--{r.replace('_', '-')} {getattr(ns, r):g}" for r in rates)
        raise ConfigError(f"the request shares must each be in [0, 1] and sum to at most 1, got {shares}")
    if ns.kill_worker_every is not None and ns.kill_worker_every <= 0:
        raise ConfigError(f"--kill-worker-every must be > 0, got {ns.kill_worker_every}")
    with tempfile.TemporaryDirectory(prefix="asyncexec-stress-") as tmp:
        if getattr(ns, "model", None) is None:
            from asyncexec.testing import make_tiny_model

            ns.model = str(make_tiny_model(Path(tmp) / ns.arch, ns.arch))
        config = stress_config(ns)
        if ns.kill_worker_every and config.executor_kind != "mp":
            raise ConfigError("--kill-worker-every needs the mp executor (its workers are processes)")
        skip = greedy_skip_reason(model_facts(ns.model, config.dtype).dtype)
        if skip is not None:
            print(f"stress: greedy check {skip}", file=sys.stderr)
        coro = stress(ns, config, greedy_skip=skip)
        result = uvloop.run(wrap(coro) if wrap is not None else coro)
    report = build_report(ns, config, result)
    print_report(report)
    out = Path(ns.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"stress: report written to {out}")
    return 0 if report["passed"] else 1
