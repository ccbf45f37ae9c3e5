"""Helpers shared by bench_engine.py and bench_graph.py: the workload, percentiles, progress lines, and
running one measurement in a fresh process (a JSON job file in, the same file with the result out)."""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from typing import Any

TEXT = (
    "The history of science is the study of the development of science and scientific knowledge, "
    "including both the natural and social sciences. Science is a body of empirical, theoretical, and "
    "practical knowledge about the natural world, produced by scientists who emphasize the observation, "
    "explanation, and prediction of real-world phenomena. The earliest roots of science can be traced to "
    "Ancient Egypt and Mesopotamia in around 3000 to 1200 BCE. Their contributions to mathematics, "
    "astronomy, and medicine entered and shaped Greek natural philosophy of classical antiquity, whereby "
    "formal attempts were made to provide explanations of events in the physical world based on natural "
    "causes. After the fall of the Western Roman Empire, knowledge of Greek conceptions of the world "
    "deteriorated in Western Europe during the early centuries of the Middle Ages, but was preserved in "
    "the Muslim world during the Islamic Golden Age. The recovery and assimilation of Greek works and "
    "Islamic inquiries into Western Europe from the 10th to 13th century revived natural philosophy, which "
    "was later transformed by the Scientific Revolution that began in the 16th century as new ideas and "
    "discoveries departed from previous Greek conceptions and traditions. The scientific method soon "
    "played a greater role in knowledge creation and it was not until the 19th century that many of the "
    "institutional and professional features of science began to take shape, along with the changing of "
    "natural philosophy to natural science. "
)
Work = list[tuple[list[int], int]]
NAN = float("nan")


def progress(msg: str) -> None:
    print(f"  .. {msg}", file=sys.stderr, flush=True)


def workload(tokenizer: Any, n: int, max_prompt: int, max_out: int, seed: int = 0) -> Work:
    """Prompts are slices of real text at random offsets (or random bytes for the tiny model)."""
    rng = random.Random(seed)
    ids = tokenizer.encode(TEXT * 8, add_special_tokens=False) if tokenizer is not None else None
    work = []
    for _ in range(n):
        length, out = rng.randint(16, max_prompt), rng.randint(16, max_out)
        if ids is None:
            work.append(([rng.randrange(256) for _ in range(length)], out))
        else:
            at = rng.randrange(len(ids) - length)
            work.append((ids[at : at + length], out))
    return work


def random_prompt(n: int, seed: int, vocab: int = 49152) -> list[int]:
    """Random token ids (distinct per seed, so prefix caching never shares a block between repeats)."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(len(xs) * q))] if xs else NAN


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else NAN


def ratio(a: Any, b: Any) -> float:
    try:
        return float(a) / float(b) if float(b) else NAN
    except (TypeError, ValueError):
        return NAN


async def timed_request(
    engine: Any, prompt: list[int], max_tokens: int, ignore_eos: bool = False
) -> tuple[int, float, float]:
    """One greedy request through `engine.generate`: (tokens, seconds to the first token, seconds from the
    first token to the last)."""
    import time

    from asyncexec import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    t0 = time.perf_counter()
    first = last = t0
    n = 0
    async for out in engine.generate(prompt, sp):
        now = time.perf_counter()
        if n == 0 and out.token_ids:
            first = now
        n, last = len(out.token_ids), now
    return n, first - t0, last - first


def run_isolated(
    script: str, job: dict[str, Any], env: dict[str, str] | None = None, timeout: float = 900
) -> dict[str, Any]:
    """Run `script --job FILE` in a fresh interpreter; the child overwrites FILE with its result dict."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    try:
        try:
            rc = subprocess.call(
                [sys.executable, script, "--job", f.name], env={**os.environ, **(env or {})}, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        if rc != 0:
            return {"error": f"process exited with status {rc}"}
        with open(f.name) as r:
            result: dict[str, Any] = json.load(r)
        return result
    finally:
        os.unlink(f.name)


def child_main(job_path: str, run: Any) -> None:
    """The child side of `run_isolated`: read the job, run it, write the result over the job file."""
    with open(job_path) as f:
        job = json.load(f)
    result = run(job)
    with open(job_path, "w") as f:
        json.dump(result, f)


# ----- profiler: where a forward's time goes ----------------------------------------------------------

GEMM = {"aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul", "aten::_addmm_activation"}
ATTN = {"aten::scaled_dot_product_attention", "aten::index_select",
        "aten::index_copy_", "aten::index_copy"}  # fmt: skip


def is_gemm(name: str) -> bool:
    kernels = ("mkldnn", "onednn", "mkl_linear", "_linear_pointwise", "int8pack")
    return name in GEMM or any(k in name for k in kernels)


def is_attention(name: str) -> bool:
    """Eager attention ops, or the inductor kernel that holds the decode softmax (graph mode fuses the
    attention into the layer graph: with `cpp.enable_kernel_profile` each kernel is a profiler event;
    that kernel also holds the rotary embedding and the KV write, which inductor fuses into it), or
    asyncexec's C++ decode kernel (`asyncexec::paged_decode`, the attention alone)."""
    return name in ATTN or ("cpp_fused" in name and "softmax" in name) or "paged_decode" in name


def classify(events: Any) -> dict[str, float]:
    """Inclusive CPU time of GEMM and attention ops, top-down (nothing counted twice), in us."""
    acc = {"gemm": 0.0, "attn": 0.0, "prof_total": 0.0, "gemm_calls": 0, "attn_calls": 0}

    def walk(ev: Any) -> None:
        kind = "attn" if is_attention(ev.name) else "gemm" if is_gemm(ev.name) else None
        if kind is not None:
            acc[kind] += ev.cpu_time_total
            acc[f"{kind}_calls"] += 1
        elif ev.name != "aten::embedding":  # its index_select is not attention
            for c in ev.cpu_children:
                walk(c)

    for ev in events:
        if ev.cpu_parent is None:
            acc["prof_total"] += ev.cpu_time_total
            walk(ev)
    return acc


def write_json(path: str, data: Any) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    print(f"wrote {path}", file=sys.stderr)
