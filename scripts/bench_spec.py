"""Speculative decoding (n-gram) against plain decoding, each configuration in its own process.

`python scripts/bench_engine.py --speculative [--model smollm2] [--dtype bfloat16] [--rounds N]
[--speculative-config JSON]`:
- **lone stream**: one request at a time (the engine in the process, no HTTP: the leanest client), greedy,
  on input-grounded tasks (repeat a passage, rewrite it, quote it to answer a question, complete code next
  to similar code) and open-ended ones (a story, an explanation): tokens/s of the decode (first token to
  last) with and without speculation, the acceptance rate and mean acceptance length;
- **streams**: 2, 4, 8 and 32 requests at once (half grounded, half open), output tokens/s: plain, the
  default policy, and speculation at every batch size (`disable_by_batch_size: null`), which shows where
  speculation stops paying (the crossover); and the worst case, open-ended requests only, plain and
  speculating at every batch size.

Prints ratios to plain decoding per round and their median over rounds; writes JSON
(bench-results/bench_spec.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Any

from _bench_common import child_main, progress, run_isolated, timed_request, write_json

PASSAGE = (
    "The river rises in the hills north of the town and runs south for about forty miles before it reaches "
    "the sea. For most of its length it is slow and shallow, and in summer children wade across it at the "
    "old ford below the mill. In the spring, when the snow melts in the hills, the water comes up quickly "
    "and the meadows along the banks are flooded for a week or two. The town was built where the river "
    "could be crossed, and the first bridge, made of wood, stood for nearly two hundred years until a "
    "storm carried it away. The stone bridge that replaced it has seven arches and is still in use today."
)
CODE = '''import math


def area_of_circle(radius: float) -> float:
    """The area of a circle of the given radius."""
    if radius < 0:
        raise ValueError("radius must not be negative")
    return math.pi * radius * radius


def circumference_of_circle(radius: float) -> float:
    """The circumference of a circle of the given radius."""
    if radius < 0:
        raise ValueError("radius must not be negative")
    return 2 * math.pi * radius


def area_of_square(side: float) -> float:
'''
TASKS: dict[str, tuple[bool, str]] = {  # name: (chat template?, prompt)
    "repeat": (True, f"Repeat the following passage exactly, word for word.\n\n{PASSAGE}"),
    "rewrite": (True, f"Rewrite the following passage in the past tense.\n\n{PASSAGE}"),
    "quote": (True, f"{PASSAGE}\n\nQuote the sentences of the passage that describe the bridges."),
    "code": (False, CODE),
    "story": (True, "Write a short story about a lighthouse keeper who finds a message in a bottle."),
    "explain": (True, "Explain in a few paragraphs why the sky is blue and sunsets are red."),
}
GROUNDED = ["repeat", "rewrite", "quote", "code"]
OPEN = ["story", "explain"]
STREAMS = [2, 4, 8, 32]
MAX_TOKENS = 160
DEFAULT_SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}


def _prompt(tokenizer: Any, task: str) -> list[int]:
    chat, text = TASKS[task]
    if not chat:
        return list(tokenizer.encode(text))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(getattr(ids, "input_ids", ids))


async def _child_run(j: dict[str, Any]) -> dict[str, Any]:
    from asyncexec import AsyncEngine, EngineConfig

    cfg = EngineConfig(
        model=j["model"], dtype=j["dtype"], max_model_len=2048, max_num_seqs=64,
        kv_cache_memory_bytes=1 << 29, speculative_config=j["spec"],
    )  # fmt: skip
    out: dict[str, Any] = {}
    async with AsyncEngine(cfg) as engine:
        tok = engine.tokenizer
        prompts = {t: _prompt(tok, t) for t in TASKS}
        await timed_request(engine, prompts["repeat"], 16)  # warm-up
        if j["what"] == "lone":
            for task in TASKS:
                before = engine.stats()
                n, ttft, decode = await timed_request(engine, prompts[task], MAX_TOKENS)
                after = engine.stats()
                drafts, acc, steps = (
                    after.get(k, 0) - before.get(k, 0)
                    for k in (
                        "spec_decode_num_draft_tokens",
                        "spec_decode_num_accepted_tokens",
                        "spec_decode_num_drafts",
                    )
                )
                out[task] = {
                    "tokens": n, "ttft_s": ttft, "tok_s": (n - 1) / decode if decode > 0 else float("nan"),
                    "draft_tokens": drafts, "accepted": acc, "verify_steps": steps,
                }  # fmt: skip
        else:
            for n in STREAMS:
                tasks = [GROUNDED[i % len(GROUNDED)] if i % 2 == 0 else OPEN[i % len(OPEN)] for i in range(n)]
                if j["what"] == "streams_open":  # the worst case: nothing to copy
                    tasks = [OPEN[i % len(OPEN)] for i in range(n)]
                t0 = time.perf_counter()
                res = await asyncio.gather(*(timed_request(engine, prompts[t], MAX_TOKENS) for t in tasks))
                wall = time.perf_counter() - t0
                out[str(n)] = {"tok_s": sum(r[0] for r in res) / wall, "tokens": sum(r[0] for r in res)}
        out["stats"] = {k: v for k, v in engine.stats().items() if k.startswith("spec_decode")}
    return out


def _child(j: dict[str, Any]) -> dict[str, Any]:
    import uvloop

    return uvloop.run(_child_run(j))


PEERS = {  # name: (what, speculative_config or None)
    "lone_plain": ("lone", None),
    "lone_spec": ("lone", "spec"),
    "streams_plain": ("streams", None),
    "streams_spec": ("streams", "spec"),
    "streams_spec_always": ("streams", "always"),
    "open_streams_plain": ("streams_open", None),
    "open_streams_spec_always": ("streams_open", "always"),
}


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--speculative-config", default=json.dumps(DEFAULT_SPEC), help="JSON (vLLM's)")
    ap.add_argument("--peers", nargs="+", default=list(PEERS), choices=list(PEERS))
    ap.add_argument("--json", default="bench-results/bench_spec.json")
    args = ap.parse_args(argv)
    spec = json.loads(args.speculative_config)
    specs = {None: None, "spec": spec, "always": {**spec, "disable_by_batch_size": None}}
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        res: dict[str, Any] = {}
        rounds.append(res)
        for name in args.peers:
            what, which = PEERS[name]
            progress(f"round {r + 1}/{args.rounds}: {name} (own process)")
            job = {"model": args.model, "dtype": args.dtype, "what": what, "spec": specs[which]}
            res[name] = run_isolated(__file__, job, timeout=1800)
            write_json(args.json, {"model": args.model, "dtype": args.dtype, "spec": spec, "rounds": rounds})
    report(rounds, args)


def _tok_s(res: dict[str, Any], peer: str, key: str) -> float:
    return float(res.get(peer, {}).get(key, {}).get("tok_s", float("nan")))


def _ratio(res: dict[str, Any], a: str, b: str, key: str) -> float:
    den = _tok_s(res, b, key)
    return _tok_s(res, a, key) / den if den else float("nan")


def report(rounds: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\nmodel {args.model}, {args.dtype}, greedy, max_tokens {MAX_TOKENS}; speculative_config "
          f"{args.speculative_config}; each configuration in its own process")  # fmt: skip
    med = statistics.median
    print("\nlone stream: decode tok/s (first token to last), per round; ratio = spec / plain")
    print(
        f"{'task':10s} {'kind':9s} {'plain':>7s} {'spec':>7s} {'ratio':>6s} {'accept':>7s} {'mean len':>8s}"
    )
    for task in TASKS:
        kind = "grounded" if task in GROUNDED else "open"
        ratios = []
        for res in rounds:
            p, s = res.get("lone_plain", {}).get(task, {}), res.get("lone_spec", {}).get(task, {})
            ratios.append(_ratio(res, "lone_spec", "lone_plain", task))
            acc = s.get("accepted", 0) / s["draft_tokens"] if s.get("draft_tokens") else 0.0
            mean_len = 1 + s.get("accepted", 0) / s["verify_steps"] if s.get("verify_steps") else 0.0
            pt, st = _tok_s(res, "lone_plain", task), _tok_s(res, "lone_spec", task)
            print(f"{task:10s} {kind:9s} {pt:7.1f} {st:7.1f} {ratios[-1]:6.2f} {acc:7.1%} {mean_len:8.2f}")
        if len(rounds) > 1:
            print(f"{task:10s} median ratio over {len(rounds)} rounds: {med(ratios):.2f}")
    for group, names in (("grounded", GROUNDED), ("open", OPEN)):
        per_round = [med([_ratio(res, "lone_spec", "lone_plain", t) for t in names]) for res in rounds]
        each = [round(x, 2) for x in per_round]
        print(f"lone stream, {group}: median ratio {med(per_round):.2f} (per round {each})")
    print("\nstreams at once (half grounded, half open): output tok/s; ratios to plain")
    print(f"{'streams':>7s} {'plain':>7s} {'spec':>7s} {'ratio':>6s} {'always':>7s} {'ratio':>6s}")
    for n in STREAMS:
        for res in rounds:
            p, s, a = (
                _tok_s(res, peer, str(n)) for peer in ("streams_plain", "streams_spec", "streams_spec_always")
            )
            print(f"{n:7d} {p:7.1f} {s:7.1f} {s / p:6.2f} {a:7.1f} {a / p:6.2f}")
    print("\nopen-ended streams only (the worst case): output tok/s; speculation at every batch size")
    print(f"{'streams':>7s} {'plain':>7s} {'always':>7s} {'ratio':>6s}")
    for n in STREAMS:
        for res in rounds:
            p, a = (_tok_s(res, peer, str(n)) for peer in ("open_streams_plain", "open_streams_spec_always"))
            print(f"{n:7d} {p:7.1f} {a:7.1f} {a / p:6.2f}")
    for res in rounds:
        print("spec_decode stats:", {k: res[k].get("stats") for k in res if "spec" in k})


if __name__ == "__main__":
    if "--job" in sys.argv:
        child_main(sys.argv[sys.argv.index("--job") + 1], _child)
    else:
        main(sys.argv[1:])
