"""Benchmark AsyncEngine against transformers on one workload, in one run.

Workload: 64 greedy requests on a tiny random llama (4 layers, width 256), prompt lengths drawn from
16-512, output lengths from 16-256 (EOS ignored, so every peer makes exactly the same tokens), all
submitted at once, then again with Poisson arrivals.
Peers: asyncexec uni x1, mp x1, mp x2, ray x2; HF `model.generate` in static padded batches of 16; HF's own
continuous batching (`init_continuous_batching` manager, per-request lengths).
Reports output tokens/s, TTFT and ITL p50/p99, engine overhead (share of step time that is not the
model forward, at rank 0), and how many greedy outputs agree with HF static batching up to their first
EOS (past it, HF's `min_new_tokens` masks EOS while `ignore_eos` samples it). Writes JSON.
Usage: python scripts/bench_engine.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import sys
import time
from typing import Any

import torch
import uvloop

from asyncexec import AsyncEngine, EngineConfig, SamplingParams
from asyncexec.models import BENCH_MODEL, EOS, PAD, make_tiny_model

MODEL = os.path.join(".cache", "bench-llama")
Work = list[tuple[list[int], int]]


def progress(msg: str) -> None:
    print(f"  .. {msg}", file=sys.stderr, flush=True)


def workload(n: int, max_prompt: int, max_out: int, seed: int = 0) -> Work:
    rng = random.Random(seed)
    return [
        ([rng.randrange(256) for _ in range(rng.randint(16, max_prompt))], rng.randint(16, max_out))
        for _ in range(n)
    ]


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(len(xs) * q))] if xs else float("nan")


async def run_engine(kind: str, ranks: int, work: Work, rate: float | None) -> dict[str, Any]:
    cfg = EngineConfig(
        model=MODEL, executor=kind, tensor_parallel_size=ranks, max_model_len=1024,  # type: ignore[arg-type]
        max_num_batched_tokens=1024, max_num_seqs=64, kv_cache_memory_bytes=512 << 20,
    )  # fmt: skip
    async with AsyncEngine(cfg) as engine:
        await _one(engine, [1, 2, 3], 4, 0.0, [], [])  # warm-up
        base = (await engine.collective_rpc("get_runner_stats"))[0]
        step_s = 0.0
        real_step = engine.step

        async def timed_step() -> Any:
            nonlocal step_s
            t = time.perf_counter()
            out = await real_step()
            step_s += time.perf_counter() - t
            return out

        engine.step = timed_step  # type: ignore[method-assign]
        ttft: list[float] = []
        itl: list[float] = []
        rng = random.Random(1)
        delays, t = [], 0.0
        for _ in work:
            delays.append(t)
            t += rng.expovariate(rate) if rate else 0.0
        start = time.perf_counter()
        outs = await asyncio.gather(
            *(_one(engine, p, m, d, ttft, itl) for (p, m), d in zip(work, delays, strict=True))
        )
        wall = time.perf_counter() - start
        stats = (await engine.collective_rpc("get_runner_stats"))[0]
    fwd = stats["forward_s"] - base["forward_s"]
    return {
        "tok_s": sum(len(o) for o in outs) / wall,
        "ttft_p50_ms": pct(ttft, 0.5) * 1e3,
        "ttft_p99_ms": pct(ttft, 0.99) * 1e3,
        "itl_p50_ms": pct(itl, 0.5) * 1e3,
        "itl_p99_ms": pct(itl, 0.99) * 1e3,
        "overhead": 1 - fwd / step_s if step_s else float("nan"),
        "outputs": outs,
    }


async def _one(
    engine: AsyncEngine, prompt: list[int], n: int, delay: float, ttft: list[float], itl: list[float]
) -> list[int]:
    await asyncio.sleep(delay)
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    sent = last = time.perf_counter()
    tokens: list[int] = []
    async for out in engine.generate(prompt, sp):
        now = time.perf_counter()
        (ttft if not tokens else itl).append(now - (sent if not tokens else last))
        last, tokens = now, out.token_ids
    return tokens


def hf_static(model: Any, work: Work, batch: int = 16) -> dict[str, Any]:
    start, outs = time.perf_counter(), []
    for i in range(0, len(work), batch):
        chunk = work[i : i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[PAD] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        longest = max(m for _, m in chunk)
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                pad_token_id=PAD,
            )  # fmt: skip
        outs += [out[j, width : width + m].tolist() for j, (_, m) in enumerate(chunk)]
    wall = time.perf_counter() - start
    return {"tok_s": sum(m for _, m in work) / wall, "outputs": outs}


def hf_continuous(model: Any, work: Work) -> dict[str, Any]:
    from transformers import GenerationConfig

    cfg = GenerationConfig(
        do_sample=False, max_new_tokens=max(m for _, m in work), eos_token_id=-1, pad_token_id=PAD
    )
    start = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=cfg, block=True, timeout=5) as manager:
        ids = [manager.add_request(p, max_new_tokens=m) for p, m in work]
        results: dict[str, Any] = {}
        while len(results) < len(ids):
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                results[r.request_id] = r
    wall = time.perf_counter() - start
    outs = [list(results[i].generated_tokens) for i in ids]
    return {"tok_s": sum(len(o) for o in outs) / wall, "outputs": outs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="16 shorter requests")
    ap.add_argument("--json", default="bench-results/bench_engine.json")
    args = ap.parse_args()
    if not os.path.isdir(MODEL):
        progress(f"building {MODEL}")
        make_tiny_model(MODEL, "llama", **BENCH_MODEL)
    work = workload(16, 128, 64) if args.quick else workload(64, 512, 256)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    res: dict[str, Any] = {}
    progress("HF generate, static batches of 16")
    res["hf_static"] = hf_static(hf, work)
    progress("HF continuous batching")
    try:
        res["hf_generate_batch"] = hf_continuous(hf, work)
    except Exception as e:  # a peer that cannot run is reported, not hidden
        res["hf_generate_batch"] = {"tok_s": float("nan"), "error": f"{type(e).__name__}: {e}", "outputs": []}
    for case, rate in (("at once", None), ("poisson", 8.0)):
        peers = [("uni", 1), ("mp", 1), ("mp", 2)] + ([("ray", 2)] if importlib.util.find_spec("ray") else [])
        for kind, ranks in peers:
            progress(f"asyncexec {kind} x{ranks}, {case}")
            res[f"{kind}{ranks} {case}"] = uvloop.run(run_engine(kind, ranks, work, rate))
    report(res, args.json)


def _agree(a: list[int], b: list[int]) -> bool:
    """Equal up to the first EOS: past it, HF's min_new_tokens (which masks EOS) and ignore_eos differ."""
    n = a.index(EOS) if EOS in a else len(a)
    return a[:n] == b[:n]


def report(res: dict[str, Any], path: str) -> None:
    ref = res["hf_static"]["outputs"]
    static, cb = res["hf_static"]["tok_s"], res["hf_generate_batch"]["tok_s"]
    print(f"\n{'peer':24s} {'tok/s':>8s} {'xstatic':>8s} {'xgen_b':>7s} {'TTFT50':>7s} {'TTFT99':>7s} "
          f"{'ITL50':>6s} {'ITL99':>6s} {'ovh':>5s} {'agrees':>6s}")  # fmt: skip
    for name, r in res.items():
        agree = sum(_agree(a, b) for a, b in zip(r["outputs"], ref, strict=False)) if r["outputs"] else 0
        cols = [f"{name:24s}", f"{r['tok_s']:8.0f}", f"{r['tok_s'] / static:8.2f}", f"{r['tok_s'] / cb:7.2f}"]
        if "ttft_p50_ms" in r:
            cols += [f"{r['ttft_p50_ms']:7.0f}", f"{r['ttft_p99_ms']:7.0f}", f"{r['itl_p50_ms']:6.1f}"]
            cols += [f"{r['itl_p99_ms']:6.1f}", f"{r['overhead']:5.1%}"]
        else:
            cols += [" " * 7, " " * 7, " " * 6, " " * 6, " " * 5]
        print(" ".join([*cols, f"{agree:3d}/{len(ref)}"]))
        if "error" in r:
            print(f"  ({r['error']})")
    print("targets: uni1 >= 1.5x static and >= 2x generate_batch; overhead <= 10% at 1 rank")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(
            {k: {kk: vv for kk, vv in v.items() if kk != "outputs"} for k, v in res.items()}, f, indent=1
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
