"""The main job: stream a few concurrent prompts through AsyncEngine with 2 worker processes.

Without --model it builds a tiny random llama under .cache/ (nothing is downloaded), so the text is
noise; point it at a real checkpoint folder with `--model DIR` for real text.
Usage: python scripts/demo.py [--model DIR] [--tp 2] [--executor mp] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import uvloop

from asyncexec import AsyncEngine, EngineConfig, SamplingParams
from asyncexec.models import make_tiny_model

PROMPTS = [
    "The quick brown fox",
    "Once upon a time,",
    "In a shared-memory arena,",
    "asyncio loops and ZeroMQ sockets",
]
DEMO_MODEL = os.path.join(".cache", "demo-llama")


def model_dir(arg: str | None) -> str:
    if arg is not None:
        if not os.path.isdir(arg):
            sys.exit(f"demo: --model {arg!r} is not a folder")
        return arg
    if not os.path.isdir(DEMO_MODEL):
        print(f"building a tiny random llama in {DEMO_MODEL} ...", flush=True)
        make_tiny_model(DEMO_MODEL, "llama", hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    print("note: this model's weights are random, so its text is noise; use --model DIR for a real one\n")
    return DEMO_MODEL


async def main(args: argparse.Namespace) -> None:
    cfg = EngineConfig(
        model=model_dir(args.model), tensor_parallel_size=args.tp, executor=args.executor,
        kv_cache_memory_bytes=256 << 20, max_model_len=1024,
    )  # fmt: skip
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=args.max_tokens, ignore_eos=True)
    async with AsyncEngine(cfg) as engine:
        print(f"engine up: {args.executor} executor, {args.tp} rank(s), {engine.num_blocks} KV blocks\n")

        async def stream(i: int, prompt: str) -> int:
            shown = 0
            async for out in engine.generate(prompt, sp):
                text = out.text or ""
                if len(text) > shown:
                    print(f"[{i}] {text[shown:]!r}", flush=True)
                    shown = len(text)
            print(f"[{i}] done: {len(out.token_ids)} tokens, finish_reason={out.finish_reason}")
            return len(out.token_ids)

        start = time.perf_counter()
        counts = await asyncio.gather(*(stream(i, p) for i, p in enumerate(PROMPTS)))
        elapsed = time.perf_counter() - start
    print(f"\n{sum(counts)} tokens from {len(PROMPTS)} concurrent requests in {elapsed:.2f} s: "
          f"{sum(counts) / elapsed:.0f} tokens/s")  # fmt: skip


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a local Hugging Face model folder (default: a tiny random llama)")
    ap.add_argument("--tp", type=int, default=2, help="worker ranks (tensor parallel size)")
    ap.add_argument("--executor", default="mp", choices=["uni", "mp"])
    ap.add_argument("--max-tokens", type=int, default=48)
    uvloop.run(main(ap.parse_args()))
