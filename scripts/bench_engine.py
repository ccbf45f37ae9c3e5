"""Benchmark AsyncEngine against transformers on one workload, each peer in its own process.

Workload: 64 (`--requests`) greedy requests on the real model (default: the built-in smollm2), prompts
of 16-384 tokens cut from English text, outputs of 16-128 tokens (EOS ignored, so every peer makes the
same number of tokens), all submitted at once. `--quick`: 16 shorter requests on a tiny random llama.
Peers: HF `model.generate` in static padded batches of 16; transformers' `generate_batch` (its own
continuous batching); asyncexec uni x1 and mp x1 (graph mode, the default), and uni x1 with
enforce_eager=True for reference. Each peer runs in a fresh process (an engine started
after an HF model ran in the same process was measured 1.7x slower), for every `--dtype`.
Reports output tokens/s and its ratios to both HF peers, TTFT and ITL p50/p99, engine overhead (share of
step time that is not rank 0's model forward), and how many outputs agree token for token with HF static
batching up to the first EOS (in bfloat16, greedy output depends on the batch: expect some to differ).
`--quantization int8|int4` runs the asyncexec peers with those weights (the HF peers stay in dtype).
`--breakdown`: also the per-step breakdown of a decode step (GEMM, attention, everything else) at 8
and 32 sequences, eager and graph mode, for each `--dtype` (`bench_graph.py --what breakdown`).
`--single-stream`: the lone-stream benchmark instead (see `_bench_single.py`): the matmul floor, a lone
stream's gap, TTFT and per-step breakdown for bf16 eager, bf16 graph, int8 and int4, and 32-stream throughput.
`--scale`: the real-size benchmark instead (see `bench_scale.py`, which takes its other options): a random
llama of Llama-3.2-1B's shape (`--size 3b`: 3B's) in bf16, int8 and int4: resident and peak memory, time to
ready, a lone stream's gap against the byte floor, tokens/s at 16 and 32 streams, TTFT of 1,024 tokens.
`--speculative`: speculative decoding (n-gram) against plain decoding instead (see `bench_spec.py`, which
takes its other options, `--speculative-config` among them): a lone stream's tokens/s on input-grounded
and open-ended tasks with the acceptance figures, and 2-32 streams at once.
`--batch-invariant`: the batch-invariant mode against the default mode instead (see `bench_invariant.py`,
which takes its other options): 32-stream tokens/s, a lone stream, a 1,024-token prompt's TTFT, for the
built-in model's GGUF as it ships, bf16 and int8 weights.
Writes JSON. Usage: python scripts/bench_engine.py [--model NAME|DIR] [--dtype float32 bfloat16]
[--requests N] [--peers ...] [--quantization int8] [--quick] | --single-stream [--streams N]
| --scale [--size 1b|3b] [--quantization bf16 int8 int4] | --speculative [--speculative-config JSON]
| --batch-invariant [--weights auto bf16 int8] [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from typing import Any

from _bench_common import TEXT as TEXT  # bench_serve.py imports it from here
from _bench_common import Work, child_main, pct, progress, run_isolated, workload, write_json

from asyncexec.config import QUANTIZATIONS

PEERS = ["hf_static", "hf_generate_batch", "uni1", "mp1", "uni1_eager"]
TINY = os.path.join(".cache", "bench-llama")


# ----- the peers, each run in its own process by `--peer` ----------------------------------------------


async def run_engine(
    model: str, dtype: str, kind: str, work: Work, eager: bool = False, quantization: str | None = None
) -> dict[str, Any]:
    from asyncexec import AsyncEngine, EngineConfig

    cfg = EngineConfig(
        model=model, executor=kind, dtype=dtype, max_model_len=1024,  # type: ignore[arg-type]
        max_num_batched_tokens=1024, max_num_seqs=64, kv_cache_memory_bytes=1 << 30, enforce_eager=eager,
        quantization=quantization,  # type: ignore[arg-type]
    )  # fmt: skip
    started = time.perf_counter()
    async with AsyncEngine(cfg) as engine:
        start_s = time.perf_counter() - started
        await _one(engine, work[0][0][:8], 4, [], [])  # warm-up
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
        start = time.perf_counter()
        outs = await asyncio.gather(*(_one(engine, p, m, ttft, itl) for p, m in work))
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
        "start_s": start_s,
        "graph_steps": stats.get("graph_steps", 0) - base.get("graph_steps", 0),
        "steps": stats["steps"] - base["steps"],
        "outputs": outs,
    }


async def _one(engine: Any, prompt: list[int], n: int, ttft: list[float], itl: list[float]) -> list[int]:
    from asyncexec import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    sent = last = time.perf_counter()
    tokens: list[int] = []
    async for out in engine.generate(prompt, sp):
        now = time.perf_counter()
        (ttft if not tokens else itl).append(now - (sent if not tokens else last))
        last, tokens = now, out.token_ids
    return tokens


def hf_static(model: Any, pad: int, work: Work, batch: int = 16) -> dict[str, Any]:
    import torch

    start, outs = time.perf_counter(), []
    for i in range(0, len(work), batch):
        chunk = work[i : i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        longest = max(m for _, m in chunk)
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                pad_token_id=pad,
            )  # fmt: skip
        outs += [out[j, width : width + m].tolist() for j, (_, m) in enumerate(chunk)]
    wall = time.perf_counter() - start
    return {"tok_s": sum(m for _, m in work) / wall, "outputs": outs}


def hf_generate_batch(model: Any, pad: int, work: Work) -> dict[str, Any]:
    from transformers import GenerationConfig

    cfg = GenerationConfig(
        do_sample=False, max_new_tokens=max(m for _, m in work), eos_token_id=-1, pad_token_id=pad
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


def run_peer(
    peer: str, model: str, dtype: str, work: Work, quantization: str | None = None
) -> dict[str, Any]:
    if peer in ("uni1", "mp1", "uni1_eager"):
        import uvloop

        kind = "mp" if peer.startswith("mp") else "uni"
        return uvloop.run(run_engine(model, dtype, kind, work, peer.endswith("eager"), quantization))
    import torch

    from asyncexec.gguf.file import load_reference_model
    from asyncexec.model_registry import resolve_model

    hf = load_reference_model(resolve_model(model), getattr(torch, dtype))
    pad = hf.generation_config.pad_token_id
    pad = pad if isinstance(pad, int) else 0
    try:
        return (hf_static if peer == "hf_static" else hf_generate_batch)(hf, pad, work)
    except Exception as e:  # a peer that cannot run is reported, not hidden
        return {"tok_s": float("nan"), "error": f"{type(e).__name__}: {e}", "outputs": []}


# ----- the parent: one subprocess per (dtype, peer) ------------------------------------------------------


def main() -> None:
    if "--scale" in sys.argv[1:]:  # bench_scale.py parses the rest
        import bench_scale

        bench_scale.main([a for a in sys.argv[1:] if a != "--scale"])
        return
    if "--batch-invariant" in sys.argv[1:]:  # bench_invariant.py parses the rest
        import bench_invariant

        bench_invariant.main([a for a in sys.argv[1:] if a != "--batch-invariant"])
        return
    if "--speculative" in sys.argv[1:]:  # bench_spec.py parses the rest
        import bench_spec

        bench_spec.main([a for a in sys.argv[1:] if a != "--speculative"])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="built-in name or HF folder (default: smollm2)")
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--peers", nargs="+", default=PEERS, choices=PEERS)
    ap.add_argument("--requests", type=int, default=64, help="number of requests (default 64)")
    ap.add_argument("--quick", action="store_true", help="16 shorter requests on a tiny random llama")
    ap.add_argument(
        "--quantization", choices=QUANTIZATIONS, help="the asyncexec peers' weights (HF peers: dtype)"
    )
    ap.add_argument("--breakdown", action="store_true", help="also the per-step breakdown (bench_graph)")
    ap.add_argument("--single-stream", action="store_true", help="the lone-stream benchmark instead")
    ap.add_argument("--scale", action="store_true", help="the real-size benchmark instead (bench_scale.py)")
    ap.add_argument(
        "--speculative", action="store_true", help="speculative decoding against plain (bench_spec.py)"
    )
    ap.add_argument("--streams", type=int, default=3, help="--single-stream: lone streams per config")
    ap.add_argument("--rounds", type=int, default=1, help="--single-stream: rounds of every config (median)")
    ap.add_argument("--json", default=None, help="default bench-results/bench_engine[_single].json")
    ap.add_argument("--job", help=argparse.SUPPRESS)  # internal: run one peer, write its result
    args = ap.parse_args()
    if args.job:
        child_main(args.job, _child)
        return
    model, tokenizer, eos = prepare_model(args)
    if args.single_stream:
        return single_stream(args, model, tokenizer)
    args.json = args.json or "bench-results/bench_engine.json"
    n = args.requests
    work = workload(tokenizer, min(n, 16), 128, 64) if args.quick else workload(tokenizer, n, 384, 128)
    progress(f"{len(work)} requests, {sum(len(p) for p, _ in work)} prompt and {sum(m for _, m in work)} "
             f"output tokens, model {model}")  # fmt: skip
    res: dict[str, dict[str, Any]] = {}
    for dtype in args.dtype:
        res[dtype] = {}
        for peer in args.peers:
            progress(f"{dtype}: {peer} (own process)")
            job = {"peer": peer, "model": model, "dtype": dtype, "work": work}
            r = run_isolated(__file__, {**job, "quantization": args.quantization})
            r.setdefault("tok_s", float("nan"))
            r.setdefault("outputs", [])
            res[dtype][peer] = r
            progress(f"{dtype}: {peer}: {r['tok_s']:.1f} tok/s")
            save(res, args.json, model, len(work))  # a long run keeps what it measured if it is cut short
    report(res, eos, model, len(work))
    save(res, args.json, model, len(work))
    if args.breakdown:  # its own processes too; prints its table after this one
        graph = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_graph.py")
        cmd = [sys.executable, graph, "--what", "breakdown", "--model", args.model, "--dtype", *args.dtype]
        subprocess.run(cmd, check=False)


def _child(j: dict[str, Any]) -> dict[str, Any]:
    if "single" in j:
        return _single_child(j)
    return run_peer(j["peer"], j["model"], j["dtype"], [tuple(w) for w in j["work"]], j.get("quantization"))


def _single_child(j: dict[str, Any]) -> dict[str, Any]:
    import _bench_single as single
    import uvloop

    from asyncexec.model_registry import resolve_model

    kind, cfg = j["single"], dict(single.CONFIGS.get(j.get("config", ""), {}))
    os.environ.update(cfg.pop("env", {}))  # this child's process only
    if kind == "floor":
        return single.matmul_floor(resolve_model(j["model"]))
    if kind == "lone":
        return uvloop.run(single.lone_stream(j["model"], cfg, j["streams"], 128))
    from asyncexec.gguf.file import load_tokenizer

    tok = load_tokenizer(resolve_model(j["model"]))
    return uvloop.run(single.batch32(j["model"], cfg, tok))


def single_stream(args: argparse.Namespace, model: str, tokenizer: Any) -> None:
    """Every job once per round, rounds one after the other (so a slow minute of a shared machine falls
    on every configuration alike); the report gives each round's ratios and their median."""
    import _bench_single as single

    jobs = [("floor", "floor", "")] + [(f"lone:{c}", "lone", c) for c in single.CONFIGS]
    jobs += [(f"batch32:{c}", "batch32", c) for c in single.BATCH32]
    rounds: list[dict[str, Any]] = []
    path = args.json or "bench-results/bench_engine_single.json"
    for i in range(args.rounds):
        res: dict[str, Any] = {}
        rounds.append(res)
        for key, kind, cfg in jobs:
            progress(f"round {i + 1}/{args.rounds}: {key} (own process)")
            res[key] = run_isolated(
                __file__, {"single": kind, "config": cfg, "model": model, "streams": args.streams}
            )
            progress(f"{key}: {res[key]}")
            write_json(path, {"model": model, "rounds": rounds})
    for i, res in enumerate(rounds):
        print(f"\n## round {i + 1} of {len(rounds)}")
        single.report(res)
    if len(rounds) > 1:
        single.report_ratios(rounds)


def prepare_model(args: argparse.Namespace) -> tuple[str, Any, int | None]:
    from asyncexec.gguf.file import load_tokenizer
    from asyncexec.model_registry import resolve_model

    if args.quick:
        from asyncexec.testing import BENCH_MODEL, EOS, make_tiny_model

        if not os.path.isdir(TINY):
            progress(f"building {TINY}")
            make_tiny_model(TINY, "llama", **BENCH_MODEL)
        return TINY, None, EOS
    path = resolve_model(args.model)  # a built-in name's GGUF file
    tok = load_tokenizer(path)
    return args.model, tok, tok.eos_token_id


def _agree(a: list[int], b: list[int], eos: int | None) -> bool:
    """Equal up to the first EOS: past it, HF's min_new_tokens (which masks EOS) and ignore_eos differ."""
    n = a.index(eos) if eos in a else len(a)
    return a[:n] == b[:n]


def report(res: dict[str, dict[str, Any]], eos: int | None, model: str, n: int) -> None:
    print(f"\nmodel {model}, {n} requests, greedy, all at once; each peer in its own process")
    head = f"{'dtype':9s} {'peer':18s} {'tok/s':>7s} {'xstatic':>8s} {'xgen_b':>7s} {'TTFT50':>7s} "
    print(head + f"{'TTFT99':>7s} {'ITL50':>6s} {'ITL99':>6s} {'ovh':>5s} {'agrees':>7s}")
    for dtype, peers in res.items():
        ref = peers.get("hf_static", {}).get("outputs") or []
        static = peers.get("hf_static", {}).get("tok_s", float("nan"))
        cb = peers.get("hf_generate_batch", {}).get("tok_s", float("nan"))
        for name, r in peers.items():
            agree = sum(_agree(a, b, eos) for a, b in zip(r["outputs"], ref, strict=False))
            cols = [f"{dtype:9s} {name:18s}", f"{r['tok_s']:7.1f}", f"{r['tok_s'] / static:8.2f}"]
            cols.append(f"{r['tok_s'] / cb:7.2f}")
            if "ttft_p50_ms" in r:
                cols += [f"{r['ttft_p50_ms']:7.0f}", f"{r['ttft_p99_ms']:7.0f}", f"{r['itl_p50_ms']:6.1f}"]
                cols += [f"{r['itl_p99_ms']:6.1f}", f"{r['overhead']:5.1%}"]
            else:
                cols += [" " * 7, " " * 7, " " * 6, " " * 6, " " * 5]
            extra = (
                f" start {r['start_s']:.1f}s graph {r['graph_steps']}/{r['steps']}" if "steps" in r else ""
            )
            print(" ".join([*cols, f"{agree:3d}/{len(ref)}" if ref else "    -"]) + extra)
            if "error" in r:
                print(f"  ({r['error']})")
        if "uni1" in peers and "mp1" in peers:
            print(f"{dtype:9s} uni1 / mp1 = {peers['uni1']['tok_s'] / peers['mp1']['tok_s']:.2f}")


def save(res: dict[str, dict[str, Any]], path: str, model: str, n: int) -> None:
    slim = {
        d: {k: {kk: vv for kk, vv in v.items() if kk != "outputs"} for k, v in p.items()}
        for d, p in res.items()
    }
    write_json(path, {"model": model, "requests": n, "results": slim})


if __name__ == "__main__":
    main()
