"""`bench_engine.py --single-stream`: one person chatting, the most common CPU use.

In one run, each configuration in its own process:
- `floor`: the model's matmul floor, every `nn.Linear` (lm_head included) applied once to one row, eager
  bf16, median of 50 (no engine, no attention: what a token costs at least without compiling).
- `lone:<config>`: a lone greedy stream through AsyncEngine (uni), `--streams` of them one after the other,
  128 tokens each: inter-token gap p50/p99, time to first token, and the per-step breakdown in ms: model
  forward (rank 0), sampling (rank 0, after the forward), executor (the engine's wait for the rank minus
  the rank's own step time: queues, thread or process hand-off), scheduling (`schedule` +
  `update_from_output`), detokenize (`make_outputs`: detokenization and stop checks), and stream delivery
  (the rest of the mean gap: the engine loop, the queue, waking the consumer). Non-model time is the mean
  gap minus the mean forward.
- `batch32:<config>`: 32 concurrent streams (prompts 16-384, outputs 16-128): output tokens/s.
Configs: bf16 eager, bf16 graph, int8 graph, int4 graph (and int8 eager, and int8 graph with PyTorch's
int8 kernel instead of asyncexec's, for the record).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from _bench_common import median, pct, workload

CONFIGS: dict[str, dict[str, Any]] = {
    "bf16_eager": {"dtype": "bfloat16", "enforce_eager": True},
    "bf16_graph": {"dtype": "bfloat16"},
    "int8_graph": {"dtype": "bfloat16", "quantization": "int8"},
    # the same with PyTorch's int8 kernel instead of asyncexec's (`ops/int8_gemv.py`)
    "int8_graph_aten": {"dtype": "bfloat16", "quantization": "int8", "env": {"ASYNCEXEC_INT8_GEMV": "0"}},
    "int8_eager": {"dtype": "bfloat16", "quantization": "int8", "enforce_eager": True},
    "int4_graph": {"dtype": "bfloat16", "quantization": "int4"},
}
BATCH32 = ("bf16_graph", "int8_graph", "int4_graph")
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def matmul_floor(model_path: str, reps: int = 50) -> dict[str, Any]:
    import torch

    from asyncexec.gguf.file import load_reference_model

    model = load_reference_model(model_path, torch.bfloat16)
    lins = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    xs = {m.in_features: torch.randn(1, m.in_features, dtype=torch.bfloat16) for m in lins}
    times = []
    with torch.inference_mode():
        for i in range(reps + 5):
            t = time.perf_counter()
            for m in lins:
                m(xs[m.in_features])
            if i >= 5:
                times.append(time.perf_counter() - t)
    return {"floor_ms": statistics.median(times) * 1e3, "linears": len(lins)}


class _Timers:
    """Wraps engine internals with timers (the bench's own instrumentation; the engine pays nothing)."""

    def __init__(self, engine: Any) -> None:
        self.t: dict[str, float] = {"schedule": 0.0, "execute": 0.0, "detok": 0.0, "step": 0.0}
        self.steps = 0
        sched, outputs, executor = engine.scheduler, engine._outputs, engine.executor
        self._wrap(sched, "schedule", "schedule")
        self._wrap(sched, "update_from_output", "schedule")
        self._wrap(outputs, "make_outputs", "detok")
        self._wrap_async(executor, "execute_model", "execute")
        self._wrap_async(engine, "step", "step", count=True)

    def _wrap(self, obj: Any, name: str, key: str) -> None:
        real = getattr(obj, name)

        def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                self.t[key] += time.perf_counter() - t

        setattr(obj, name, timed)

    def _wrap_async(self, obj: Any, name: str, key: str, count: bool = False) -> None:
        real = getattr(obj, name)

        async def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return await real(*a, **k)
            finally:
                self.t[key] += time.perf_counter() - t
                self.steps += count

        setattr(obj, name, timed)


async def _stream(
    engine: Any, prompt: Any, n: int, gaps: list[float], walls: list[float] | None = None
) -> float:
    """Time to first token; appends the inter-token gaps to `gaps` and the stream's wall time (sent to last
    token) to `walls`."""
    from asyncexec import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    sent = time.perf_counter()
    last = ttft = 0.0
    async for _ in engine.generate(prompt, sp):
        now = time.perf_counter()
        if not ttft:
            ttft = now - sent
        else:
            gaps.append(now - last)
        last = now
    if walls is not None:
        walls.append(last - sent)
    return ttft


async def lone_stream(model: str, cfg: dict[str, Any], streams: int, tokens: int) -> dict[str, Any]:
    from asyncexec import AsyncEngine, EngineConfig

    config = EngineConfig(
        model=model, executor="uni", max_model_len=2048, kv_cache_memory_bytes=1 << 28, **cfg
    )
    started = time.perf_counter()
    async with AsyncEngine(config) as engine:
        start_s = time.perf_counter() - started
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True
        )
        prompt = list(getattr(prompt, "input_ids", prompt))
        await _stream(engine, prompt, 16, [])  # warm-up
        base = (await engine.collective_rpc("get_runner_stats"))[0]
        timers = _Timers(engine)
        gaps: list[float] = []
        walls: list[float] = []
        ttfts = [await _stream(engine, prompt, tokens, gaps, walls) for _ in range(streams)]
        stats = (await engine.collective_rpc("get_runner_stats"))[0]
    steps = max(1, timers.steps)
    per = {k: v / steps * 1e3 for k, v in timers.t.items()}
    d = {k: (stats[k] - base.get(k, 0.0)) / steps * 1e3 for k in ("forward_s", "sample_s", "execute_s")}
    gap = median(gaps) * 1e3
    breakdown = {
        "forward": d["forward_s"],
        "sampling": d["sample_s"],
        "runner_other": d["execute_s"] - d["forward_s"] - d["sample_s"],
        "executor": per["execute"] - d["execute_s"],
        "scheduling": per["schedule"],
        "detokenize": per["detok"],
    }
    # the parts are means over all steps, each stream's prefill step included: so is the wall time per step
    wall = sum(walls) / steps * 1e3
    breakdown["stream_delivery"] = wall - sum(breakdown.values())
    return {
        "gap_p50_ms": gap,
        "gap_p99_ms": pct(gaps, 0.99) * 1e3,
        "ttft_ms": median(ttfts) * 1e3,
        "start_s": start_s,
        "breakdown_ms": breakdown,
        "non_model_ms": wall - d["forward_s"],
        "graph_steps": stats.get("graph_steps", 0) - base.get("graph_steps", 0),
        "steps": steps,
    }


async def batch32(model: str, cfg: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    from asyncexec import AsyncEngine, EngineConfig

    work = workload(tokenizer, 32, 384, 128)
    config = EngineConfig(
        model=model, executor="uni", max_model_len=1024, max_num_batched_tokens=1024, max_num_seqs=64,
        kv_cache_memory_bytes=1 << 30, **cfg,
    )  # fmt: skip
    async with AsyncEngine(config) as engine:
        await _stream(engine, work[0][0][:8], 4, [])
        start = time.perf_counter()
        n = await asyncio.gather(*(_count(engine, p, m) for p, m in work))
        wall = time.perf_counter() - start
    return {"tok_s": sum(n) / wall}


async def _count(engine: Any, prompt: list[int], n: int) -> int:
    from asyncexec import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    got = 0
    async for out in engine.generate(prompt, sp):
        got = len(out.token_ids)
    return got


def report(res: dict[str, Any]) -> None:
    floor = res.get("floor", {}).get("floor_ms", float("nan"))
    print(f"\nmatmul floor (every nn.Linear once on one row, eager bf16): {floor:.2f} ms")
    keys = ["forward", "sampling", "runner_other", "executor", "scheduling", "detokenize", "stream_delivery"]
    print("\n| config | gap p50 ms | p99 ms | TTFT ms | gap / floor | non-model ms | "
          + " | ".join(keys) + " |")  # fmt: skip
    print("|---" * (6 + len(keys)) + "|")
    for name in CONFIGS:
        r = res.get(f"lone:{name}")
        if not r or "error" in r:
            print(f"| {name} | {r.get('error') if r else 'not run'} |")
            continue
        b = r["breakdown_ms"]
        print(
            f"| {name} | {r['gap_p50_ms']:.2f} | {r['gap_p99_ms']:.2f} | {r['ttft_ms']:.1f} | "
            f"{r['gap_p50_ms'] / floor:.2f}x | {r['non_model_ms']:.2f} | "
            + " | ".join(f"{b[k]:.2f}" for k in keys)
            + " |"
        )
    lone = {n: res.get(f"lone:{n}", {}).get("gap_p50_ms") for n in CONFIGS}
    for q in ("int8_graph", "int8_graph_aten", "int4_graph"):
        if lone.get(q) and lone.get("bf16_graph"):
            print(f"{q} / bf16_graph lone-stream gap: {lone[q] / lone['bf16_graph']:.2f}x")
    tput = {n: res.get(f"batch32:{n}", {}).get("tok_s") for n in BATCH32}
    if tput["bf16_graph"]:
        print("32 streams: " + ", ".join(f"{n} {v:.1f} tok/s ({v / tput['bf16_graph']:.2f}x)"
                                         for n, v in tput.items() if v))  # fmt: skip


def ratios(res: dict[str, Any]) -> dict[str, float]:
    """The issue's targets of one round: bf16 graph gap / floor, int8 / bf16 gap, int8 / bf16 at 32."""
    nan = float("nan")

    def get(key: str, field: str) -> float:
        r = res.get(key) or {}
        return float(r.get(field, nan)) if "error" not in r else nan

    floor = get("floor", "floor_ms")
    gap = {c: get(f"lone:{c}", "gap_p50_ms") for c in CONFIGS}
    tput = {c: get(f"batch32:{c}", "tok_s") for c in BATCH32}
    return {
        "bf16_graph_gap / floor": gap["bf16_graph"] / floor,
        "bf16_eager_gap / floor": gap["bf16_eager"] / floor,
        "int8_graph_gap / bf16_graph_gap": gap["int8_graph"] / gap["bf16_graph"],
        "int8 / bf16 tok/s at 32 streams": tput["int8_graph"] / tput["bf16_graph"],
        "int8_graph_aten_gap / bf16_graph_gap": gap["int8_graph_aten"] / gap["bf16_graph"],
        "int4_graph_gap / bf16_graph_gap": gap["int4_graph"] / gap["bf16_graph"],
        "int4 / bf16 tok/s at 32 streams": tput["int4_graph"] / tput["bf16_graph"],
        "bf16_graph non-model ms": get("lone:bf16_graph", "non_model_ms"),
    }  # fmt: skip


def report_ratios(rounds: list[dict[str, Any]]) -> None:
    per = [ratios(r) for r in rounds]
    print(f"\n## the targets, each round and the median of {len(rounds)}")
    print("| ratio | " + " | ".join(f"round {i + 1}" for i in range(len(per))) + " | median |")
    print("|---" * (len(per) + 2) + "|")
    for key in per[0]:
        vals = [p[key] for p in per]
        print(f"| {key} | " + " | ".join(f"{v:.2f}" for v in vals) + f" | {statistics.median(vals):.2f} |")
