"""GPU check for the model runner: CUDA-graph replay against eager on a ~100M-parameter model.

  1. makes a random llama of about 100M parameters (hidden 768, 12 layers, vocab 16000);
  2. for batch sizes 1..64, runs the same greedy decode with `enforce_eager=True` and with graphs (float32,
     so that rounding cannot flip a token) and checks the tokens are equal;
  3. times decode steps per batch size in bfloat16, graph against eager;
  4. reports how long the capture took.

Prints a table and writes JSON. Bounded: it stops trying sizes once `--budget-s` (default 300) is spent.
`--device cpu --small` runs the same harness on CPU (where both runs are eager) as a smoke test.
Usage: python scripts/gpu_check.py [--json PATH] [--steps N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from asyncexec import (
    CachedRequestData,
    EngineConfig,
    Executor,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)
from asyncexec.executor.uniproc import UniProcExecutor
from asyncexec.testing import make_tiny_model

SIZES = [1, 2, 4, 8, 16, 32, 64]
BLOCK = 16


async def decode_run(ex: Executor, batch: int, steps: int, seed: int) -> tuple[list[list[int]], list[float]]:
    """Prefill `batch` random prompts in one step, then `steps` uniform decode steps.

    Returns the tokens and the decode step times.
    """
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(8, 64))] for _ in range(batch)]
    blocks: list[list[int]] = []
    nxt = 1  # block 0 is the null block
    for p in prompts:
        n = -(-(len(p) + steps + 1) // BLOCK)
        blocks.append(list(range(nxt, nxt + n)))
        nxt += n
    greedy = SamplingParams(temperature=0.0)
    ids = [f"r{i}" for i in range(batch)]
    new = [NewRequestData(r, p, greedy, b, 0) for r, p, b in zip(ids, prompts, blocks, strict=True)]
    so = SchedulerOutput(
        0, new, CachedRequestData(), {r: len(p) for r, p in zip(ids, prompts, strict=True)}, 0
    )
    so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
    out = await ex.execute_model(so)
    tokens = [list(t) for t in out.sampled_token_ids]
    computed = [len(p) for p in prompts]
    times = []
    for step in range(steps):
        cached = CachedRequestData(ids, [False] * batch, [[] for _ in ids], [[] for _ in ids], list(computed))
        so = SchedulerOutput(step + 1, [], cached, dict.fromkeys(ids, 1), batch)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = await ex.execute_model(so)
        times.append(time.perf_counter() - t)
        for i, tok in enumerate(out.sampled_token_ids):
            tokens[i] += tok
            computed[i] += 1
    finish = SchedulerOutput(steps + 1, [], CachedRequestData(), {}, 0, finished_req_ids=ids)
    await ex.execute_model(finish)
    return tokens, times


async def start(model: str, dtype: str, eager: bool, device: str) -> Executor:
    cfg = EngineConfig(
        model=model, device=device, dtype=dtype, enforce_eager=eager, block_size=BLOCK,  # type: ignore[arg-type]
        max_num_seqs=max(SIZES), max_num_batched_tokens=8192, max_model_len=1024,
        kv_cache_memory_bytes=4 << 30,
    )  # fmt: skip
    ex = Executor.create(cfg)
    await ex.start()
    block_bytes = max(await ex.collective_rpc("get_kv_cache_block_bytes"))
    await ex.initialize_kv_cache(await ex.determine_available_memory() // block_bytes)
    return ex


async def start_pair(model: str, dtype: str, device: str) -> tuple[Executor, Executor]:
    """An eager executor and a graph-capturing one on the same model."""
    return await start(model, dtype, True, device), await start(model, dtype, False, device)


def capture_seconds(ex: Executor) -> float:
    assert isinstance(ex, UniProcExecutor)
    runner = ex._workers[0].model_runner
    return float(runner.graphs.capture_seconds) if runner is not None and runner.graphs is not None else 0.0


async def main(args: argparse.Namespace) -> dict[str, Any]:
    deadline = time.monotonic() + args.budget_s
    shape = {} if args.small else LLAMA_100M
    model = str(make_tiny_model(os.path.join(tempfile.mkdtemp(), "m"), "llama", **shape))
    print("model written; checking graph replay against eager (float32)", file=sys.stderr, flush=True)
    res: dict[str, Any] = {"equal": {}, "eager_ms": {}, "graph_ms": {}, "capture_s": {}}
    eager, graph = await start_pair(model, "float32", args.device)
    res["capture_s"]["float32"] = capture_seconds(graph)
    for b in SIZES:
        if time.monotonic() > deadline:
            break
        want, _ = await decode_run(eager, b, 8, seed=b)
        got, _ = await decode_run(graph, b, 8, seed=b)
        res["equal"][b] = want == got
        print(f"  batch {b:3d}: graph == eager: {want == got}", file=sys.stderr, flush=True)
    await eager.shutdown()
    await graph.shutdown()
    print("timing decode steps (bfloat16)", file=sys.stderr, flush=True)
    eager, graph = await start_pair(model, "bfloat16", args.device)
    res["capture_s"]["bfloat16"] = capture_seconds(graph)
    for b in SIZES:
        if time.monotonic() > deadline:
            break
        for name, ex in (("eager_ms", eager), ("graph_ms", graph)):
            _, times = await decode_run(ex, b, args.steps, seed=b)
            res[name][b] = statistics.median(times[3:]) * 1e3
    await eager.shutdown()
    await graph.shutdown()
    return res


LLAMA_100M = dict(
    hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
    num_key_value_heads=4, vocab_size=16000, max_position_embeddings=1024,
)  # fmt: skip


def report(res: dict[str, Any], path: str) -> None:
    print(f"\n{'batch':>6s} {'graph==eager':>13s} {'eager ms':>9s} {'graph ms':>9s} {'speedup':>8s}")
    for b in SIZES:
        e, g = res["eager_ms"].get(b), res["graph_ms"].get(b)
        speed = f"{e / g:8.2f}" if e and g else f"{'-':>8s}"
        print(f"{b:6d} {res['equal'].get(b, '-')!s:>13s} {e or 0:9.2f} {g or 0:9.2f} {speed}")
    print(f"capture: {res['capture_s']}")
    small = [res["eager_ms"][b] / res["graph_ms"][b] for b in SIZES if b <= 8 and b in res["graph_ms"]]
    print(f"target: graph >= 2x eager at batch <= 8: min speedup {min(small) if small else float('nan'):.2f}")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="bench-results/gpu_check.json")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="the 2-layer test model instead of ~100M")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run it on a GPU machine", file=sys.stderr)
        sys.exit(2)
    report(asyncio.run(main(a)), a.json)
