"""Graph mode on CPU (issue 13): where a decode step's time goes, start-up, long-prompt TTFT, and the
inter-token gap of a running stream while a long prompt is admitted. Every configuration runs in its own
process (`_bench_common.run_isolated`); the mixed-workload throughput is `bench_engine.py`.

--what breakdown: a ModelRunner built directly, random KV, uniform decode batches of 8 and 32 sequences
    (contexts 16-384); median forward ms, then torch.profiler over a few forwards: GEMM (mm/addmm/bmm/
    linear/mkldnn), attention (eager's SDPA + index_select + index_copy; in graph mode the inductor
    kernel that holds the decode softmax, profiled through `cpp.enable_kernel_profile`: it also holds the
    rotary embedding and the KV write, fused into it), everything else = total - GEMM - attention.
    Eager (enforce_eager) vs graph.
--what startup: AsyncEngine start to ready: graph mode with an empty TORCHINDUCTOR_CACHE_DIR (cold), again
    with the same folder (warm), and eager.
--what ttft: lone prompts of 2,000 and 8,000 random tokens, max_tokens=1, through AsyncEngine (graph,
    eager, and eager with the pre-issue masked-SDPA prefill `attention._prefill` patched in, 2,000 only),
    vs one HF forward (logits_to_keep=1) over the same ids.
--what gap: one greedy stream (ignore_eos); after 20 tokens an 8,000-token prompt arrives; the stream's
    gaps until that prompt's first token, at the default long_prefill_token_threshold (256, scaled down
    with context by the model's attention crossover); if the max gap is over 1 s, 128 is tried too.
Usage: python scripts/bench_graph.py [--what ...] [--dtype float32 bfloat16] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import tempfile
import time
from typing import Any

from _bench_common import (
    NAN,
    child_main,
    classify,
    median,
    progress,
    random_prompt,
    ratio,
    run_isolated,
    write_json,
)

WHATS = ["breakdown", "startup", "ttft", "gap"]
NPROF = 3  # profiled forwards per batch


# ----- children ------------------------------------------------------------------------------------------


def breakdown(job: dict[str, Any]) -> dict[str, Any]:
    import random

    import torch

    from asyncexec.config import EngineConfig
    from asyncexec.messages import CachedRequestData, NewRequestData, SchedulerOutput
    from asyncexec.model_registry import resolve_config
    from asyncexec.sampling_params import SamplingParams
    from asyncexec.worker.model_runner import ModelRunner

    cfg = resolve_config(EngineConfig(model=job["model"], dtype=job["dtype"], max_num_seqs=64))
    r = ModelRunner(cfg, torch.device("cpu"), 1)
    r.load_model()
    r.profile_run()
    r.allocate_kv_cache(1200)
    with torch.inference_mode():
        for kc, vc in r.kv_caches:
            kc.normal_()
            vc.normal_()
    res: dict[str, Any] = {"threads": torch.get_num_threads()}
    if not job["eager"]:
        import torch._inductor.config

        torch._inductor.config.cpp.enable_kernel_profile = True  # each fused kernel a profiler event

        t = time.perf_counter()
        r.config = r.config.replace(cudagraph_capture_sizes=tuple(job["sizes"]), enforce_eager=False)
        r.capture_model(progress=False)
        assert r.graphs is not None, "graph mode did not start (see the log)"
        res["capture_s"] = time.perf_counter() - t
    rng, bs = random.Random(0), cfg.block_size
    done: list[str] = []
    for step, n in enumerate(job["sizes"]):
        reqs, blk = [], 1
        for i in range(n):
            ln = rng.randint(16, 384)
            nb = -(-ln // bs)
            ids = [rng.randrange(3, 40000) for _ in range(ln)]
            table = list(range(blk, blk + nb))
            reqs.append(NewRequestData(f"s{n}_{i}", ids, SamplingParams(temperature=0), table, ln - 1))
            blk += nb
        so = SchedulerOutput(step, reqs, CachedRequestData(), {q.req_id: 1 for q in reqs}, n, done)
        done = [q.req_id for q in reqs]
        r.input_batch.update_states(so)
        batch = r.input_batch.prepare(so)
        with torch.inference_mode():
            g0 = r.stats["graph_steps"]
            for _ in range(3):
                r._forward(batch)
            ts = []
            for _ in range(job["reps"]):
                t = time.perf_counter()
                r._forward(batch)
                ts.append(time.perf_counter() - t)
            graph_steps = r.stats["graph_steps"] - g0
            k = NPROF
            for rounds in (1, k):  # the first profiler session pays one-time set-up costs: thrown away
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    for _ in range(rounds):
                        r._forward(batch)
        acc = classify(prof.events())
        total = median(ts) * 1e3
        gemm, attn = acc["gemm"] / k / 1e3, acc["attn"] / k / 1e3
        calls = {f"{c}_calls": acc[f"{c}_calls"] // k for c in ("gemm", "attn")}
        res[str(n)] = {"total_ms": total, "gemm_ms": gemm, "attn_ms": attn, "other_ms": total - gemm - attn,
                       "profiled_total_ms": acc["prof_total"] / k / 1e3, "graph_steps": graph_steps,
                       "reps": job["reps"], **calls}  # fmt: skip
    return res


def _config(job: dict[str, Any], **kw: Any) -> Any:
    from asyncexec import EngineConfig

    return EngineConfig(model=job["model"], dtype=job["dtype"], enforce_eager=job.get("eager", False),
                        kv_cache_memory_bytes=1 << 30, **kw)  # fmt: skip


async def _first(engine: Any, prompt: list[int]) -> float:
    from asyncexec import SamplingParams

    t = time.perf_counter()
    async for _ in engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1)):
        return time.perf_counter() - t
    return NAN


async def startup(job: dict[str, Any]) -> dict[str, Any]:
    from asyncexec import AsyncEngine
    from asyncexec.ops.build import compile_cache_dir

    t = time.perf_counter()
    async with AsyncEngine(_config(job)) as engine:
        ready = time.perf_counter() - t
        first = await _first(engine, random_prompt(32, 1))
    return {"ready_s": ready, "first_request_s": first, "cache_dir": compile_cache_dir()}


async def ttft_engine(job: dict[str, Any]) -> dict[str, Any]:
    from asyncexec import AsyncEngine

    if job.get("legacy"):  # the masked-SDPA prefill of before the issue (uni: the rank is in this process)
        import asyncexec.worker.attention as attention

        setattr(attention, "prefill_attention", attention._prefill)  # noqa: B010
    res: dict[str, Any] = {}
    async with AsyncEngine(_config(job, max_model_len=8192)) as engine:
        await _first(engine, random_prompt(300, 99))  # warm-up
        for n, reps in job["lens"]:
            res[str(n)] = [await _first(engine, random_prompt(n, n * 10 + i)) for i in range(reps)]
    return res


def ttft_hf(job: dict[str, Any]) -> dict[str, Any]:
    import torch

    from asyncexec.gguf.file import load_reference_model
    from asyncexec.model_registry import resolve_model

    hf = load_reference_model(resolve_model(job["model"]), getattr(torch, job["dtype"]))
    hf.eval()
    res: dict[str, Any] = {}
    with torch.inference_mode():
        hf(torch.tensor([random_prompt(300, 99)]), logits_to_keep=1, use_cache=False)
        for n, reps in job["lens"]:
            res[str(n)] = []
            for i in range(reps):
                ids = torch.tensor([random_prompt(n, n * 10 + i)])
                t = time.perf_counter()
                hf(ids, logits_to_keep=1, use_cache=False)
                res[str(n)].append(time.perf_counter() - t)
    return res


async def gap(job: dict[str, Any]) -> dict[str, Any]:
    from asyncexec import AsyncEngine, SamplingParams

    cfg = _config(job, max_model_len=8192, long_prefill_token_threshold=job["threshold"])
    async with AsyncEngine(cfg) as engine:
        await _first(engine, random_prompt(300, 99))
        stamps: list[float] = []
        submitted = asyncio.Event()
        marks: dict[str, float] = {}

        async def long() -> None:
            await submitted.wait()
            marks["submit"] = time.perf_counter()
            marks["ttft"] = await _first(engine, random_prompt(job["long"], 7))
            marks["first"] = time.perf_counter()

        async def stream() -> None:
            sp = SamplingParams(temperature=0.0, max_tokens=job["stream_tokens"], ignore_eos=True)
            async for _ in engine.generate(random_prompt(64, 5), sp):
                stamps.append(time.perf_counter())
                if len(stamps) == 20:
                    submitted.set()
                if "first" in marks and stamps[-1] > marks["first"] + 0.5:
                    break

        await asyncio.gather(stream(), long())
    gaps = [(y - x, x, y) for x, y in itertools.pairwise(stamps)]
    during = [g for g, x, y in gaps if y > marks["submit"] and x < marks["first"]]
    before = [g for g, _, y in gaps[1:] if y <= marks["submit"]]
    return {"max_gap_s": max(during, default=NAN), "p50_gap_s": median(during), "n_gaps": len(during),
            "before_p50_s": median(before), "long_ttft_s": marks["ttft"], "stream_tokens": len(stamps),
            "stream_ended_early": "first" not in marks or stamps[-1] < marks["first"]}  # fmt: skip


def run_child(job: dict[str, Any]) -> dict[str, Any]:
    fn = {"breakdown": breakdown, "startup": startup, "ttft_engine": ttft_engine, "ttft_hf": ttft_hf,
          "gap": gap}[job["kind"]]  # fmt: skip
    out = fn(job)
    if asyncio.iscoroutine(out):
        import uvloop

        out = uvloop.run(out)
    assert isinstance(out, dict)
    return out


# ----- the parent ----------------------------------------------------------------------------------------


def go(args: argparse.Namespace, res: dict[str, Any], key: tuple[str, str, str], job: dict[str, Any],
       env: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """One configuration in its own process; the JSON is rewritten after each."""
    what, dtype, name = key
    progress(f"{what} {dtype} {name} (own process)")
    t = time.perf_counter()
    r = run_isolated(__file__, {"model": args.model, "dtype": dtype, **job}, env)
    res.setdefault(what, {}).setdefault(dtype, {})[name] = r
    progress(f"{what} {dtype} {name}: {time.perf_counter() - t:.0f} s wall; {r}")
    write_json(args.json, res)
    return r


def measure(args: argparse.Namespace, res: dict[str, Any]) -> None:
    q = args.quick
    lens = [[512, 1], [1024, 1]] if q else [[2000, 2], [8000, 1]]
    long, tokens = (1024, 120) if q else (8000, 400)
    for what in args.what:
        for dtype in args.dtype:
            if what == "breakdown":
                for mode in ("eager", "graph"):
                    job = {"kind": what, "eager": mode == "eager", "sizes": [32, 8], "reps": 3 if q else 10}
                    go(args, res, (what, dtype, mode), job)
            elif what == "startup":
                with tempfile.TemporaryDirectory(prefix="inductor-cold-") as tmp:
                    for name in ("graph_cold", "graph_warm"):
                        go(args, res, (what, dtype, name), {"kind": what}, {"TORCHINDUCTOR_CACHE_DIR": tmp})
                go(args, res, (what, dtype, "eager"), {"kind": what, "eager": True})
            elif what == "ttft":
                go(args, res, (what, dtype, "hf_forward"), {"kind": "ttft_hf", "lens": lens})
                go(args, res, (what, dtype, "graph"), {"kind": "ttft_engine", "lens": lens})
                go(args, res, (what, dtype, "eager"), {"kind": "ttft_engine", "lens": lens, "eager": True})
                job = {"kind": "ttft_engine", "lens": lens[:1], "eager": True, "legacy": True}
                go(args, res, (what, dtype, "eager_legacy_prefill"), job)
            elif what == "gap":
                for th in (256, 128):
                    job = {"kind": what, "threshold": th, "long": long, "stream_tokens": tokens}
                    if not go(args, res, (what, dtype, f"threshold_{th}"), job).get("max_gap_s", NAN) > 1.0:
                        break


def report(res: dict[str, Any]) -> None:
    for dtype, d in res.get("breakdown", {}).items():
        print(f"\nbreakdown {dtype}: one decode forward, ms (share of total); x = total / eager's")
        heads = ("mode", "seqs", "total", "GEMM", "attention", "other", "x")
        print("{:6s} {:>4s} {:>7s} {:>13s} {:>13s} {:>13s} {:>5s}".format(*heads))
        for n in ("8", "32"):
            for mode in ("eager", "graph"):
                r = d.get(mode, {}).get(n)
                if not r:
                    continue
                tot = r["total_ms"]
                cols = [f"{r[k]:6.1f} {r[k] / tot:6.1%}" for k in ("gemm_ms", "attn_ms", "other_ms")]
                x = ratio(tot, d.get("eager", {}).get(n, {}).get("total_ms"))
                print(
                    f"{mode:6s} {n:>4s} {tot:7.1f} {' '.join(cols)} {x:5.2f} graph steps {r['graph_steps']}"
                )
    for dtype, d in res.get("startup", {}).items():
        print(f"\nstart-up {dtype}: " + ", ".join(f"{k} {v.get('ready_s', NAN):.1f} s" for k, v in d.items()))
    for dtype, d in res.get("ttft", {}).items():
        print(f"\nTTFT {dtype}, s (median of repeats); x = / one HF forward")
        for n in ("512", "1024", "2000", "8000"):
            hf = median(d.get("hf_forward", {}).get(n, []))
            if hf == hf:
                cols = [f"{k} {median(v[n]):.2f} x{median(v[n]) / hf:.2f}" for k, v in d.items() if n in v]
                print(f"  {n:>5s} tokens: " + "; ".join(cols))
    for dtype, d in res.get("gap", {}).items():
        print(f"\ngap {dtype}: the stream's inter-token gaps while the long prompt is prefilled")
        for k, r in d.items():
            if "error" in r:
                print(f"  {k}: {r['error']}")
                continue
            print(f"  {k}: max {r['max_gap_s'] * 1e3:.0f} ms, p50 {r['p50_gap_s'] * 1e3:.0f} ms "
                  f"({r['n_gaps']} gaps); before it p50 {r['before_p50_s'] * 1e3:.0f} ms; "
                  f"long prompt TTFT {r['long_ttft_s']:.1f} s")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--what", nargs="+", default=WHATS, choices=WHATS)
    ap.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"], choices=["float32", "bfloat16"])
    ap.add_argument("--quick", action="store_true", help="fewer repeats, prompts of 512-1,024 tokens")
    ap.add_argument("--json", default="bench-results/bench_graph.json")
    ap.add_argument("--job", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.job:
        child_main(args.job, run_child)
        return
    res: dict[str, Any] = {"model": args.model}
    measure(args, res)
    report(res)
    write_json(args.json, res)


if __name__ == "__main__":
    main()
