"""`asyncexec stress` (also `scripts/stress.py`): a bounded run of random load that checks the invariants.

Clients keep `--concurrency` requests in flight: random prompt and output lengths, some aborted by the
client part-way (closing the stream, or cancelling the task), some invalid on purpose, some greedy
copies of reference prompts whose output must equal the reference computed before any worker was
killed. `--kill-worker-every S` SIGKILLs a random worker rank (mp only; restarting is then on).

The run fails (exit status 1) when a request was lost or errored, a bad request was accepted, a greedy
output disagreed with its reference, the KV pool did not return to full, RSS grew by more than
`--max-rss-growth` after warm-up, or a file descriptor or `/dev/shm/asyncexec-*` segment leaked.
The report is printed and written as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncexec.errors import ConfigError

if TYPE_CHECKING:
    from asyncexec.config import EngineConfig

__all__ = ["add_stress_args", "run_stress", "stress_config"]


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
        "--kill-worker-every",
        type=float,
        default=None,
        metavar="S",
        help="SIGKILL a random worker rank every S seconds (mp executor)",
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


def stress_config(ns: argparse.Namespace) -> EngineConfig:
    """The engine config: the flags given, over stress defaults (mp, 2 ranks, a small KV cache)."""
    from asyncexec.entrypoints.config_args import engine_config_from_args

    # A KV cache of 256 KiB (64 blocks of the tiny llama) is small enough that requests get preempted.
    defaults: dict[str, Any] = {
        "executor": "mp",
        "tensor_parallel_size": 2,
        "kv_cache_memory_bytes": 256 << 10,
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
    if ns.kill_worker_every is not None and ns.kill_worker_every <= 0:
        raise ConfigError(f"--kill-worker-every must be > 0, got {ns.kill_worker_every}")
    with tempfile.TemporaryDirectory(prefix="asyncexec-stress-") as tmp:
        if getattr(ns, "model", None) is None:
            from asyncexec.models import make_tiny_model

            ns.model = str(make_tiny_model(Path(tmp) / ns.arch, ns.arch))
        config = stress_config(ns)
        if ns.kill_worker_every and config.executor_kind != "mp":
            raise ConfigError("--kill-worker-every needs the mp executor (its workers are processes)")
        coro = stress(ns, config)
        result = uvloop.run(wrap(coro) if wrap is not None else coro)
    report = build_report(ns, config, result)
    print_report(report)
    out = Path(ns.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"stress: report written to {out}")
    return 0 if report["passed"] else 1
