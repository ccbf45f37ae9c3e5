"""The batch-invariant mode (`EngineConfig(batch_invariant=True)`) against the default mode, each
configuration in its own process.

`python scripts/bench_engine.py --batch-invariant [--model smollm2] [--weights auto bf16 int8] [--rounds N]`:
for each weight format (`auto`: the built-in model's GGUF as it ships, Q4_1 int4 with an int8 lm_head;
`bf16`: every tensor dequantized to bfloat16; `int8`: requantized to int8), default mode and
batch-invariant mode, graph mode, greedy:
- **32 streams**: 32 requests at once (prompts of 16-384 tokens of English text, 16-128 output tokens, EOS
  ignored), output tokens/s: the issue's acceptance figure (the invariant mode >= 0.85x the default);
- **lone stream**: one request of 128 tokens, decode tokens/s (first token to last);
- **long prompt**: the time to the first token of a 1,024-token prompt alone (where the invariant mode pays
  most: every prompt token attends through the decode kernel instead of the flash prefill kernel).
Prints each round and the median ratio invariant / default over rounds; writes JSON
(bench-results/bench_invariant.json).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from typing import Any

from _bench_common import TEXT, child_main, progress, run_isolated, timed_request, workload, write_json

WEIGHTS: dict[str, dict[str, Any]] = {  # name: EngineConfig fields
    "auto": {"dtype": "auto"},
    "bf16": {"dtype": "bfloat16"},
    "int8": {"dtype": "bfloat16", "quantization": "int8"},
}
STREAMS = 32
LONE_TOKENS = 128
LONG_PROMPT = 1024


async def _child_run(j: dict[str, Any]) -> dict[str, Any]:
    from asyncexec import AsyncEngine, EngineConfig

    cfg = EngineConfig(
        model=j["model"], max_model_len=2048, max_num_seqs=64, max_num_batched_tokens=1024,
        kv_cache_memory_bytes=1 << 30, batch_invariant=j["invariant"], **WEIGHTS[j["weights"]],
    )  # fmt: skip
    out: dict[str, Any] = {}
    started = time.perf_counter()
    async with AsyncEngine(cfg) as engine:
        out["start_s"] = time.perf_counter() - started
        tok = engine.tokenizer
        text = tok.encode(TEXT * 12, add_special_tokens=False)
        await timed_request(engine, text[:64], 8, ignore_eos=True)  # warm-up
        work = workload(tok, STREAMS, 384, 128)
        t0 = time.perf_counter()
        res = await asyncio.gather(*(timed_request(engine, p, m, ignore_eos=True) for p, m in work))
        out["streams_tok_s"] = sum(r[0] for r in res) / (time.perf_counter() - t0)
        n, _, decode = await timed_request(engine, text[100:164], LONE_TOKENS, ignore_eos=True)
        out["lone_tok_s"] = (n - 1) / decode
        # a prompt no earlier one shares a block with (prefix caching would skip most of it)
        _, ttft, _ = await timed_request(engine, text[-LONG_PROMPT:], 1, ignore_eos=True)
        out["long_ttft_s"] = ttft
        out["runner"] = (await engine.collective_rpc("get_runner_stats"))[0]
    return out


def _child(j: dict[str, Any]) -> dict[str, Any]:
    import uvloop

    return uvloop.run(_child_run(j))


METRICS = {  # key: (label, higher is better)
    "streams_tok_s": (f"{STREAMS} streams, output tok/s", True),
    "lone_tok_s": ("lone stream, decode tok/s", True),
    "long_ttft_s": (f"TTFT of a {LONG_PROMPT}-token prompt, s", False),
    "start_s": ("start-up, s", False),
}


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--weights", nargs="+", default=list(WEIGHTS), choices=list(WEIGHTS))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", default="bench-results/bench_invariant.json")
    args = ap.parse_args(argv)
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        res: dict[str, Any] = {}
        rounds.append(res)
        for weights in args.weights:
            for invariant in (False, True):
                name = f"{weights}_{'invariant' if invariant else 'default'}"
                progress(f"round {r + 1}/{args.rounds}: {name} (own process)")
                job = {"model": args.model, "weights": weights, "invariant": invariant}
                res[name] = run_isolated(__file__, job, timeout=1800)
                if "error" in res[name]:
                    progress(f"{name}: {res[name]['error']}")
                write_json(args.json, {"model": args.model, "rounds": rounds})
    report(rounds, args)


def _value(res: dict[str, Any], peer: str, key: str) -> float:
    return float(res.get(peer, {}).get(key, float("nan")))


def report(rounds: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\nmodel {args.model}, graph mode, greedy; each configuration in its own process; "
          "ratio = invariant / default")  # fmt: skip
    print(f"{'weights':8s} {'metric':36s} {'default':>9s} {'invariant':>9s} {'ratio':>6s}  per round")
    for weights in args.weights:
        for key, (label, _) in METRICS.items():
            per_round = []
            for res in rounds:
                d, i = _value(res, f"{weights}_default", key), _value(res, f"{weights}_invariant", key)
                per_round.append((d, i, i / d if d else float("nan")))
            med = [statistics.median(x[k] for x in per_round) for k in range(3)]
            each = " ".join(f"{x[2]:.2f}" for x in per_round)
            print(f"{weights:8s} {label:36s} {med[0]:9.2f} {med[1]:9.2f} {med[2]:6.2f}  {each}")


if __name__ == "__main__":
    if "--job" in sys.argv:
        child_main(sys.argv[sys.argv.index("--job") + 1], _child)
    else:
        main(sys.argv[1:])
