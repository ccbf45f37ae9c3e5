"""`bench_engine.py --scale`: asyncexec's memory, speed and byte floor at a real model's size on CPU.

The model: a random-weight llama of Llama-3.2-1B's shape (`--size 3b`: Llama-3.2-3B's), bf16 safetensors,
written once to `$XDG_CACHE_HOME/asyncexec/scale/llama-1b` (else `~/.cache/...`) and reused. It has no
tokenizer: every prompt is random token ids, so detokenization is not measured. For each `--quantization`
config (bf16, int8, int4 from the folder; gguf-q8_0, gguf-q4_0: the same weights written once as a GGUF
file of that type by `gguf`'s quantizers, served as it ships with dtype "auto"), in its own process
(`--timeout` seconds at most; one that fails or times out is reported with its error, the others run),
AsyncEngine uni, graph mode, dtype bfloat16, KV cache 256 MiB, max_model_len 2048, max_num_seqs 32, and
worker_start_timeout_s `--timeout` (a slow load is measured, not cut off at the default 300 s):
- resident memory once the engine is ready, before any request (VmRSS, RssAnon, RssFile of
  /proc/self/status), net of the same process after `import torch, asyncexec` and a warm-up matmul; peak:
  VmHWM when ready minus that baseline's VmRSS (VmHWM cannot be reset: it includes the imports);
- time to ready: `async with AsyncEngine(cfg)` entry, start to ready; warm (the compile cache as earlier
  runs left it) or, with `--cold`, from an empty compile cache (every graph and kernel built anew);
- a lone greedy stream's inter-token gap p50: 3 streams of 64 tokens from 16-token prompts, one after the
  other, first tokens excluded;
- output tokens/s of 16 and of 32 concurrent streams (32-token prompts, 64 tokens each, wall time from
  submission to the last token, prefill included);
- time to first token of a lone 1,024-token prompt (median of 3).
And, in one more process, the memory read bandwidth on 2 threads: the best of a bf16 GEMV over a 512 MiB
weight (`F.linear`, [1, 8192] x [32768, 8192]) and an fp32 `torch.sum` over 1 GiB. Each config's byte
floor is the bytes a lone decode step reads over that bandwidth: the engine's packed weights that serve a
one-row step (every linear, lm_head included, not the embedding table), read from `REGISTRY` in the engine
process; estimated from the shape only where they cannot be read (the JSON's `floor_bytes_from`).
Prints a table and the int8/bf16 and int4/bf16 ratios; writes JSON (bench-results/bench_scale.json).
Usage: python scripts/bench_engine.py --scale [--size 1b|3b] [--quantization bf16 int8 int4 gguf-q8_0 ...]
[--timeout S] [--cold] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
import timeit
from typing import Any

from _bench_common import child_main, median, progress, random_prompt, ratio, run_isolated, write_json
from _bench_single import _count, _stream

MiB = 1 << 20
VOCAB = 128256
SIZES: dict[str, dict[str, int]] = {
    "1b": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 8192},
    "3b": {"hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24,
           "num_key_value_heads": 8, "intermediate_size": 8192},
    "tiny": {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 512},  # a quick check of the script
}  # fmt: skip
CONFIGS: dict[str, str | None] = {"bf16": None, "int8": "int8", "int4": "int4"}
GGUF: dict[str, str] = {
    "gguf-q8_0": "Q8_0",
    "gguf-q4_0": "Q4_0",
}  # the same model as a GGUF file, served as is
TOKENS = 64  # each stream's output


def write_model(path: str, size: str) -> dict[str, Any]:
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        **SIZES[size], vocab_size=VOCAB, tie_word_embeddings=True, rope_theta=500000.0,
        max_position_embeddings=4096, initializer_range=0.02, bos_token_id=128000, eos_token_id=128001,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)  # no float32 copy
    tmp = path + ".partial"  # a write cut short is never taken for the model
    model.save_pretrained(tmp)
    os.replace(tmp, path)
    return {"params": sum(p.numel() for p in model.parameters())}


def proc_status() -> dict[str, float]:
    """This process's VmRSS, VmHWM, RssAnon and RssFile in MiB."""
    with open("/proc/self/status") as f:
        rows = dict(line.split(":", 1) for line in f if ":" in line)
    return {k: int(rows[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}


def bandwidth(reps: int = 7) -> dict[str, Any]:
    import torch

    torch.set_num_threads(2)

    def best_gbs(fn: Any, nbytes: int) -> float:  # the best rep: the first one warms up
        return nbytes / min(timeit.repeat(fn, number=1, repeat=reps)) / 1e9

    w = torch.ones(32768, 8192, dtype=torch.bfloat16)
    x = torch.ones(1, 8192, dtype=torch.bfloat16)
    big = torch.ones(1 << 28)
    with torch.inference_mode():
        gemv = best_gbs(lambda: torch.nn.functional.linear(x, w), w.nbytes)
        total = best_gbs(lambda: torch.sum(big), big.nbytes)
    return {"gemv_bf16_gbs": gemv, "sum_fp32_gbs": total, "gbs": max(gemv, total), "threads": 2}


def one_row_bytes() -> int:
    """The bytes of this process's packed weights that a one-row step reads: every tensor of a packed
    weight but its dense copy (which serves bigger steps of quantized weights), or the dense weight where
    it is all there is (bf16)."""
    import dataclasses

    import torch

    from asyncexec.ops.packed_linear import REGISTRY

    packed = {}
    for p in list(REGISTRY.values()):
        q = p.group.packed if p.group is not None else p  # a group's members and key share one weight
        packed[id(q)] = q
    total = 0
    for q in packed.values():
        ts = {f.name: getattr(q, f.name) for f in dataclasses.fields(q)}
        ts = {k: t for k, t in ts.items() if isinstance(t, torch.Tensor)}
        dense_only = ts.keys() <= {"dense", "bias"}
        read = [t for k, t in ts.items() if dense_only or k != "dense"]
        total += sum(t.numel() * t.element_size() for t in read)
    return total


def write_gguf_file(folder: str, path: str, weight_type: str) -> dict[str, Any]:
    """The bf16 folder's model as a GGUF file of `weight_type` (every 2-D weight, the tied embedding too),
    quantized by `gguf`'s own quantizers."""
    import torch
    import transformers

    from asyncexec.gguf.writer import write_gguf

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    tmp = path + ".partial"
    write_gguf(model, tmp, weight_type)
    os.replace(tmp, path)
    return {"bytes": os.path.getsize(path)}


def shape_bytes(size: str, quantization: str | None) -> float:
    """An estimate from the shape: bytes per parameter of bf16 2; int8 1 + a bf16 scale per 32 inputs
    (Q8_0); int4 0.5 + a bf16 scale and minimum per 32 inputs (Q4_1), its lm_head in int8."""
    s = SIZES[size]
    h = s["hidden_size"]
    kv = h // s["num_attention_heads"] * s["num_key_value_heads"]
    body = s["num_hidden_layers"] * (2 * h * h + 2 * h * kv + 3 * h * s["intermediate_size"])
    per_body, per_head = {None: (2.0, 2.0), "int8": (1.0625, 1.0625), "int4": (0.625, 1.0625)}[quantization]
    return body * per_body + VOCAB * h * per_head


async def measure(model: str, quantization: str | None, timeout: float, r: dict[str, Any]) -> None:
    """Fills `r` as it goes, so a failure keeps what was measured before it. `timeout`: the load's limit.
    A GGUF file loads with dtype "auto": its quantized tensors as they ship, bf16 activations."""
    import torch

    import asyncexec.worker.model_runner as runner
    from asyncexec import AsyncEngine, EngineConfig

    x = torch.ones(8, 256, dtype=torch.bfloat16)
    torch.nn.functional.linear(x, torch.ones(256, 256, dtype=torch.bfloat16))  # oneDNN and threads up
    base = proc_status()
    pack = runner.pack_linears  # type: ignore[attr-defined]

    def spy(*a: Any, **k: Any) -> dict[str, int]:  # the engine's own count of its weights
        r["pack_stats"] = pack(*a, **k)
        return r["pack_stats"]  # type: ignore[no-any-return]

    runner.pack_linears = spy  # type: ignore[attr-defined]
    cfg = EngineConfig(
        model=model, executor="uni", dtype="auto" if model.endswith(".gguf") else "bfloat16",
        quantization=quantization,  # type: ignore[arg-type]
        max_model_len=2048, max_num_batched_tokens=2048, max_num_seqs=32, kv_cache_memory_bytes=256 * MiB,
        worker_start_timeout_s=timeout,
    )  # fmt: skip
    seeds = iter(range(1, 1 << 30))  # distinct prompts: prefix caching shares nothing
    started = time.perf_counter()
    async with AsyncEngine(cfg) as engine:
        r["ready_s"] = time.perf_counter() - started
        ready = proc_status()
        r["status_baseline_mib"], r["status_ready_mib"] = base, ready
        r["resident_mib"] = ready["VmRSS"] - base["VmRSS"]
        r["anon_mib"] = ready["RssAnon"] - base["RssAnon"]
        r["file_mib"] = ready["RssFile"] - base["RssFile"]
        r["peak_mib"] = ready["VmHWM"] - base["VmRSS"]
        r["one_row_bytes"] = one_row_bytes()
        progress(f"ready in {r['ready_s']:.1f} s, {r['resident_mib']:.0f} MiB resident (net)")
        await _stream(engine, random_prompt(8, 0, VOCAB), 4, [])  # warm-up
        gaps: list[float] = []
        for _ in range(3):
            await _stream(engine, random_prompt(16, next(seeds), VOCAB), TOKENS, gaps)
        r["gap_p50_ms"] = median(gaps) * 1e3
        progress(f"lone stream gap p50 {r['gap_p50_ms']:.1f} ms")
        for n in (16, 32):
            t = time.perf_counter()
            prompts = [random_prompt(32, next(seeds), VOCAB) for _ in range(n)]
            counts = await asyncio.gather(*(_count(engine, p, TOKENS) for p in prompts))
            r[f"tok_s_{n}"] = sum(counts) / (time.perf_counter() - t)
            progress(f"{n} streams: {r[f'tok_s_{n}']:.1f} tok/s")
        ttfts = [await _stream(engine, random_prompt(1024, next(seeds), VOCAB), 1, []) for _ in range(3)]
        r["ttft_1024_ms"] = median(ttfts) * 1e3
    r["peak_end_mib"] = proc_status()["VmHWM"] - base["VmRSS"]


def _child(j: dict[str, Any]) -> dict[str, Any]:
    if "write" in j:
        return write_model(j["path"], j["write"])
    if "write_gguf" in j:
        return write_gguf_file(j["folder"], j["path"], j["write_gguf"])
    if "bandwidth" in j:
        return bandwidth()
    import uvloop

    r: dict[str, Any] = {}
    try:
        uvloop.run(measure(j["model"], CONFIGS.get(j["config"]), j["timeout"], r))
    except Exception as e:  # reported, with what was measured before it
        r["error"] = f"{type(e).__name__}: {e}"
    return r


def add_floor(r: dict[str, Any], size: str, config: str, gbs: float) -> None:
    if "one_row_bytes" in r:
        r["floor_bytes"], r["floor_bytes_from"] = r["one_row_bytes"], "the engine's packed weights"
    else:
        r["floor_bytes"], r["floor_bytes_from"] = (
            shape_bytes(size, CONFIGS.get(config)),
            "estimate from shape",
        )
    r["floor_ms"] = ratio(r["floor_bytes"], gbs * 1e9) * 1e3
    r["gap_over_floor"] = ratio(r.get("gap_p50_ms"), r["floor_ms"])
    r["peak_over_resident"] = ratio(r.get("peak_mib"), r.get("resident_mib"))


def ratios(res: dict[str, dict[str, Any]]) -> dict[str, float]:
    out = {}
    keys = {"resident memory": "resident_mib", "16-stream tok/s": "tok_s_16", "32-stream tok/s": "tok_s_32",
            "TTFT-1024": "ttft_1024_ms"}  # fmt: skip
    for q in ("int8", "int4", *GGUF):
        for label, k in keys.items():
            out[f"{q}/bf16 {label}"] = ratio(res.get(q, {}).get(k), res.get("bf16", {}).get(k))
    for name, r in res.items():
        out[f"{name} gap/floor"] = ratio(r.get("gap_p50_ms"), r.get("floor_ms"))
    return out


COLUMNS = (("resident MiB", "resident_mib", 0), ("anon MiB", "anon_mib", 0), ("file MiB", "file_mib", 0),
           ("peak MiB", "peak_mib", 0), ("peak/res", "peak_over_resident", 2), ("ready s", "ready_s", 1),
           ("gap ms", "gap_p50_ms", 1), ("floor ms", "floor_ms", 1), ("gap/floor", "gap_over_floor", 2),
           ("tok/s @16", "tok_s_16", 1), ("tok/s @32", "tok_s_32", 1),
           ("TTFT-1024 ms", "ttft_1024_ms", 0))  # fmt: skip


def report(out: dict[str, Any]) -> None:
    bw = {k: float(out["bandwidth"].get(k, "nan")) for k in ("gbs", "gemv_bf16_gbs", "sum_fp32_gbs")}
    print(f"\nmodel {out['model']} ({out['params_b']:.2f}B parameters), random weights, token-id prompts")
    print(f"read bandwidth, 2 threads: {bw['gbs']:.1f} GB/s (best of a bf16 GEMV {bw['gemv_bf16_gbs']:.1f} "
          f"and an fp32 sum {bw['sum_fp32_gbs']:.1f})")  # fmt: skip
    print("\n| config | " + " | ".join(c[0] for c in COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    for name, r in out["results"].items():
        cells = [f"{float(r.get(k, float('nan'))):.{d}f}" for _, k, d in COLUMNS]
        print(f"| {name} | " + " | ".join(cells) + " |")
    for name, r in out["results"].items():
        if "error" in r:
            print(f"{name} failed: {r['error']}")
    print()
    for label, v in out["ratios"].items():
        print(f"{label}: {v:.2f}")


def main(argv: list[str] | None = None) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser(prog="bench_engine.py --scale", description=__doc__, formatter_class=fmt)
    ap.add_argument("--size", default="1b", help="1b (default) or 3b: Llama-3.2's shape")
    choices = [*CONFIGS, *GGUF]
    ap.add_argument("--quantization", nargs="+", default=choices, choices=choices,
                    help="bf16, int8, int4 (the bf16 folder); gguf-q8_0, gguf-q4_0 (it as GGUF)")  # fmt: skip
    ap.add_argument("--timeout", type=float, default=1500, help="seconds per config's process (default 1500)")
    ap.add_argument("--cold", action="store_true",
                    help="each config starts with an empty compile cache (all built anew)")  # fmt: skip
    ap.add_argument("--json", default="bench-results/bench_scale.json")
    ap.add_argument("--job", help=argparse.SUPPRESS)  # internal: run one job, write its result
    args = ap.parse_args(argv)
    if args.job:
        child_main(args.job, _child)
        return
    if args.size not in SIZES:
        ap.error(f"--size: 1b or 3b, not {args.size!r}")
    from asyncexec.model_registry import model_cache_dir

    path = str(model_cache_dir().parent / "scale" / f"llama-{args.size}")
    if not os.path.isdir(path):
        progress(f"writing a random llama of {args.size}'s shape to {path} (once; own process)")
        done = run_isolated(__file__, {"write": args.size, "path": path}, timeout=args.timeout)
        if "error" in done:
            raise SystemExit(f"could not write {path}: {done['error']}")
    progress("memory read bandwidth, 2 threads (own process)")
    bw = run_isolated(__file__, {"bandwidth": True}, timeout=args.timeout)
    progress(f"bandwidth: {bw}")
    out: dict[str, Any] = {
        "size": args.size, "model": path, "shape": SIZES[args.size], "vocab": VOCAB,
        "params_b": shape_bytes(args.size, None) / 2e9,  # tied: the lm_head is the embedding
        "prompts": "random token ids, no tokenizer (no detokenization)", "bandwidth": bw, "results": {},
    }  # fmt: skip
    for name in args.quantization:
        model = path
        if name in GGUF:
            model = f"{path}-{GGUF[name]}.gguf"
            if not os.path.isfile(model):
                progress(f"writing {model} (once; own process)")
                job = {"write_gguf": GGUF[name], "folder": path, "path": model}
                done = run_isolated(__file__, job, timeout=args.timeout)
                if "error" in done:
                    raise SystemExit(f"could not write {model}: {done['error']}")
        progress(f"{name} (own process, at most {args.timeout:.0f} s)")
        with tempfile.TemporaryDirectory() as empty:
            env = {"TORCHINDUCTOR_CACHE_DIR": empty} if args.cold else None
            job = {"model": model, "config": name, "timeout": args.timeout}
            r = run_isolated(__file__, job, env=env, timeout=args.timeout)
        r["compile_cache"] = "empty (cold)" if args.cold else "as left by earlier runs (warm)"
        add_floor(r, args.size, name, float(bw.get("gbs", float("nan"))))
        out["results"][name] = r
        progress(f"{name}: " + ", ".join(f"{k} {v:.4g}" for k, v in r.items() if isinstance(v, float)))
        write_json(args.json, out)  # a long run keeps what it measured if it is cut short
    out["ratios"] = ratios(out["results"])
    report(out)
    write_json(args.json, out)


if __name__ == "__main__":
    main()
