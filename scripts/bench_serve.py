"""Benchmark the OpenAI-compatible server against the same workload run in-process, in one run.

Workload: 64 concurrent streaming clients, each sending `--per-client` greedy requests one after the
other (prompts of 16-256 tokens cut from English text, outputs of 32-128 tokens, EOS ignored, so both
peers make exactly the same tokens) to `--model` (default: the built-in smollm2), for each `--dtype`
(default: float32 and bfloat16). `--quick`: a tiny random llama, one repeat, one request per client.
Peers: `engine.generate` in-process (uni x1), and `asyncexec serve` (uni x1, a real uvicorn process)
driven over HTTP/SSE from this process by aiohttp (the load generator vLLM's serving benchmark uses)
and by httpx. Repeated `--repeats` times, alternating; medians.
Reports requests/s, output tokens/s, TTFT and ITL p50/p99, the CPU seconds the clients themselves
took (they share this machine's cores with the server), the HTTP overhead (1 - aiohttp/in-process
throughput; target <= 15%) and whether the greedy outputs agree. Writes JSON.
`--stop` adds four stop strings that never match (the text is still scanned for them every step) and
`--penalties` adds presence, frequency and repetition penalties (outputs stay the same length, as EOS is
ignored); with either, every repeat runs the plain workload and then the same with those fields on the
same server, and the throughput cost is reported per repeat. `--structured json` does the same with a
`response_format` json_schema (an array of at least 16 small objects: longer than any `max_tokens`, so the
constrained outputs end at the same length as the plain ones, and the cost is the grammar's alone; target
<= 15%). `--peers` picks the peers to run.
`--score N` instead measures prompt-logprob scoring: N requests from `--clients` clients, each `echo` +
`logprobs=5` + `max_tokens: 0` over a 256-token prompt; prompt tokens/s are reported.
`--speculative-config JSON` runs both peers with speculative decoding (`EngineConfig.speculative_config`).
Usage: python scripts/bench_serve.py [--model NAME|DIR] [--dtype float32 bfloat16] [--quick] [--json PATH]
       [--stop] [--penalties] [--structured json] [--peers in-process aiohttp httpx] [--score N]
       [--speculative-config JSON]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import httpx
import msgspec
import uvloop

from asyncexec import AsyncEngine, EngineConfig, SamplingParams
from asyncexec.sampling_params import StructuredOutputsParams
from asyncexec.testing import BENCH_MODEL, make_tiny_model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_engine import TEXT  # the same English text

TINY = os.path.join(".cache", "bench-llama")
FLAGS: dict[str, Any] = {
    "max_model_len": 1024,
    "max_num_batched_tokens": 1024,
    "max_num_seqs": 64,
    "kv_cache_memory_bytes": 512 << 20,
}
Work = list[list[tuple[list[int], int]]]  # per client: (prompt, max_tokens) requests
STOP = ["<|never|>", "QQZX", "\n\n\n\n\n", "zzzz"]
PENALTIES = {"presence_penalty": 0.2, "frequency_penalty": 0.2, "repetition_penalty": 1.1}
ITEMS: dict[str, Any] = {
    "type": "array",
    "minItems": 16,
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "tag": {"type": "string", "maxLength": 8}},
        "required": ["id", "tag"],
        "additionalProperties": False,
    },
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "items", "schema": ITEMS}}
EXTRA: dict[str, Any] = {}  # --stop / --penalties: sampling fields added to every request, both peers


def progress(msg: str) -> None:
    print(f"  .. {msg}", file=sys.stderr, flush=True)


def workload(text_ids: list[int] | None, clients: int, per_client: int, seed: int = 0) -> Work:
    """Prompts are slices of real text at random offsets (random bytes for the tiny model)."""
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        if text_ids is None:
            return [rng.randrange(256) for _ in range(n)]
        at = rng.randrange(len(text_ids) - n)
        return text_ids[at : at + n]

    return [
        [(prompt(rng.randint(16, 256)), rng.randint(32, 128)) for _ in range(per_client)]
        for _ in range(clients)
    ]


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(len(xs) * q))] * 1e3 if xs else float("nan")


def summarize(wall: float, outs: list[list[int]], ttft: list[float], itl: list[float]) -> dict[str, Any]:
    return {
        "wall_s": wall,
        "req_s": len(outs) / wall,
        "tok_s": sum(map(len, outs)) / wall,
        "ttft_p50_ms": pct(ttft, 0.5),
        "ttft_p99_ms": pct(ttft, 0.99),
        "itl_p50_ms": pct(itl, 0.5),
        "itl_p99_ms": pct(itl, 0.99),
        "outputs": outs,
    }


class Latencies:
    """TTFT and ITL samples; `clock()` times one request's chunks."""

    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.itl: list[float] = []

    def clock(self) -> Callable[[], None]:
        t0 = last = time.perf_counter()
        first = True

        def tick() -> None:
            nonlocal last, first
            now = time.perf_counter()
            (self.ttft if first else self.itl).append(now - (t0 if first else last))
            last, first = now, False

        return tick


One = Callable[[list[int], int, Latencies], Awaitable[list[int]]]


async def run_clients(one: One, work: Work) -> dict[str, Any]:
    """A full-batch warm-up, then every client's requests one after the other, all clients at once."""
    await asyncio.gather(*(one(cl[0][0], 4, Latencies()) for cl in work))
    lat = Latencies()

    async def client(reqs: list[tuple[list[int], int]]) -> list[list[int]]:
        return [await one(p, m, lat) for p, m in reqs]

    start = time.perf_counter()
    outs = await asyncio.gather(*(client(cl) for cl in work))
    wall = time.perf_counter() - start
    return summarize(wall, [o for cl in outs for o in cl], lat.ttft, lat.itl)


async def in_process(work: Work, flags: dict[str, Any]) -> dict[str, Any]:
    cfg = EngineConfig(**flags)
    async with AsyncEngine(cfg) as engine:

        async def one(p: list[int], m: int, lat: Latencies) -> list[int]:
            tick, toks = lat.clock(), []
            async for out in engine.generate(
                p, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, **engine_fields(EXTRA))
            ):
                tick()
                toks = out.token_ids
            return toks

        return await run_clients(one, work)


def engine_fields(extra: dict[str, Any]) -> dict[str, Any]:
    """The request body's extra fields as `SamplingParams` fields (`response_format` becomes
    `structured_outputs`)."""
    fields = {k: v for k, v in extra.items() if k != "response_format"}
    if "response_format" in extra:
        schema = extra["response_format"]["json_schema"]["schema"]
        fields["structured_outputs"] = StructuredOutputsParams(json=schema)
    return fields


_chunk = msgspec.json.Decoder()


def _body(p: list[int], m: int) -> dict[str, Any]:
    return {
        "prompt": p,
        "max_tokens": m,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        **EXTRA,
    }


def _new_tokens(line: bytes | str) -> list[int]:
    return (
        list(_chunk.decode(line[6:])["choices"][0]["token_ids"])
        if line[:7] in (b"data: {", "data: {")
        else []
    )


async def over_httpx(url: str, work: Work) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=len(work), max_keepalive_connections=len(work))
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=None) as c:

        async def one(p: list[int], m: int, lat: Latencies) -> list[int]:
            tick, toks = lat.clock(), []
            async with c.stream("POST", "/v1/completions", json=_body(p, m)) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if new := _new_tokens(line):
                        tick()
                        toks += new
            return toks

        return await run_clients(one, work)


async def over_aiohttp(url: str, work: Work) -> dict[str, Any]:
    conn = aiohttp.TCPConnector(limit=len(work))
    async with aiohttp.ClientSession(url, connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as c:

        async def one(p: list[int], m: int, lat: Latencies) -> list[int]:
            tick, toks = lat.clock(), []
            async with c.post("/v1/completions", json=_body(p, m)) as r:
                r.raise_for_status()
                async for line in r.content:
                    if new := _new_tokens(line):
                        tick()
                        toks += new
            return toks

        return await run_clients(one, work)


async def score(url: str, text_ids: list[int] | None, clients: int, requests: int) -> dict[str, Any]:
    """`requests` scoring requests (256-token prompts, echo + logprobs=5, max_tokens 0) from `clients`
    concurrent clients; prompt tokens per second."""
    rng = random.Random(1)
    prompts = [
        text_ids[(at := rng.randrange(len(text_ids) - 256)) : at + 256]
        if text_ids
        else [rng.randrange(256) for _ in range(256)]
        for _ in range(requests)
    ]
    body = {"echo": True, "logprobs": 5, "max_tokens": 0}
    async with aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(limit=clients)) as c:

        async def one(p: list[int]) -> int:
            async with c.post("/v1/completions", json=dict(body, prompt=p)) as r:
                r.raise_for_status()
                got = await r.json()
                assert len(got["choices"][0]["logprobs"]["token_logprobs"]) == len(p)
                return int(got["usage"]["prompt_tokens"])

        await one(prompts[0])  # warm-up
        sem = asyncio.Semaphore(clients)

        async def limited(p: list[int]) -> int:
            async with sem:
                return await one(p)

        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(limited(p) for p in prompts)))
        wall = time.perf_counter() - start
    return {"requests": requests, "prompt_tokens": tokens, "wall_s": wall, "prompt_tok_s": tokens / wall}


def run_peer(name: str, work: Work, flags: dict[str, Any], url: str) -> Awaitable[dict[str, Any]]:
    if name == "in-process":
        return in_process(work, flags)
    return over_aiohttp(url, work) if name == "http aiohttp" else over_httpx(url, work)


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(coro: Any) -> dict[str, Any]:
    """Run a peer; adds the CPU seconds this (client) process took."""
    c0 = cpu_seconds()
    res: dict[str, Any] = uvloop.run(coro)
    res["client_cpu_s"] = cpu_seconds() - c0
    return res


def start_server(port: int, flags: dict[str, Any]) -> subprocess.Popen[bytes]:
    argv = [
        sys.executable,
        "-m",
        "asyncexec",
        "serve",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    for k, v in flags.items():
        argv += ["--" + k.replace("_", "-"), json.dumps(v) if isinstance(v, dict) else str(v)]
    proc = subprocess.Popen(argv)
    deadline = time.monotonic() + 600  # graph compile on a busy CPU takes minutes
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not become healthy in 600 s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="built-in name or HF folder (default: smollm2)")
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--quick", action="store_true", help="a tiny llama, 1 repeat, 1 request per client")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--per-client", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--executor", choices=["uni", "mp"], default="uni", help="both peers' executor (uni)")
    ap.add_argument("--json", default="bench-results/bench_serve.json")
    ap.add_argument("--stop", action="store_true", help="add 4 stop strings that never match")
    ap.add_argument("--penalties", action="store_true", help="add presence/frequency/repetition penalties")
    ap.add_argument("--structured", choices=["json"], default=None, help="add a json_schema response_format")
    ap.add_argument("--peers", nargs="+", choices=["in-process", "aiohttp", "httpx"], default=None)
    ap.add_argument("--score", type=int, default=0, metavar="N", help="measure prompt scoring, N clients")
    ap.add_argument(
        "--speculative-config", type=json.loads, default=None, metavar="JSON", help="both peers' (vLLM's)"
    )
    args = ap.parse_args()
    # With --stop/--penalties every repeat runs the plain workload, then the same with those fields, on
    # one server: the pair shares the machine's state of the moment, so their ratio is the cost.
    fields = {**({"stop": STOP} if args.stop else {}), **(PENALTIES if args.penalties else {})}
    if args.structured:
        fields["response_format"] = RESPONSE_FORMAT
    names = [k for k in ("stop", "penalties") if getattr(args, k)] + (
        ["json_schema"] if args.structured else []
    )
    variants = {"plain": {}, "with " + "+".join(names): fields}
    if not fields:
        del variants[next(v for v in variants if v != "plain")]
    repeats, per_client = (1, 1) if args.quick else (args.repeats, args.per_client)
    model, text_ids = prepare_model(args)
    work = workload(text_ids, args.clients, per_client)
    results = {}
    peers = args.peers or ["in-process", "aiohttp", "httpx"]
    for dtype in args.dtype:
        flags = dict(FLAGS, model=model, dtype=dtype, executor=args.executor)
        if args.speculative_config is not None:
            flags["speculative_config"] = args.speculative_config
        progress(f"{dtype}: starting asyncexec serve")
        server = start_server(args.port, flags)
        url = f"http://127.0.0.1:{args.port}"
        try:
            if args.score:
                results[dtype] = timed(score(url, text_ids, args.clients, args.score))
                print(f"\nmodel {model}, {dtype}: prompt scoring {results[dtype]}")
                continue
            names = [("" if p == "in-process" else "http ") + p for p in peers]
            runs: dict[str, dict[str, list[dict[str, Any]]]] = {v: {n: [] for n in names} for v in variants}
            for i in range(repeats):
                for v, extra in variants.items():
                    EXTRA.clear()
                    EXTRA.update(extra)
                    for name in names:
                        progress(f"{dtype}, repeat {i + 1}/{repeats}: {name}, {v}")
                        runs[v][name].append(timed(run_peer(name, work, flags, url)))
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(60)
        if not args.score:
            results[dtype] = {}
            for v, extra in variants.items():
                print(f"\nmodel {model}, {dtype}, {args.executor} x1, {v}: {extra or 'no extra fields'}")
                results[dtype][v] = report(runs[v])
            if len(variants) == 2:
                results[dtype]["cost"] = report_cost(runs)
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"model": model, "results": results}, f, indent=1)
    print(f"wrote {args.json}")


def prepare_model(args: argparse.Namespace) -> tuple[str, list[int] | None]:
    if args.quick:
        if not os.path.isdir(TINY):
            progress(f"building {TINY}")
            make_tiny_model(TINY, "llama", **BENCH_MODEL)
        return TINY, None
    from asyncexec.gguf.file import load_tokenizer
    from asyncexec.model_registry import resolve_model

    tok = load_tokenizer(resolve_model(args.model))
    return args.model, tok.encode(TEXT * 4, add_special_tokens=False)


def report_cost(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, list[float]]:
    """Per peer and repeat, the throughput lost to the extra fields: 1 - tok/s with / tok/s plain."""
    plain, (name_with, with_) = runs["plain"], next((v, r) for v, r in runs.items() if v != "plain")
    cost = {
        peer: [1 - w["tok_s"] / p["tok_s"] for p, w in zip(plain[peer], with_[peer], strict=True)]
        for peer in plain
    }
    for peer, c in cost.items():
        print(
            f"cost of {name_with} for {peer}: median {statistics.median(c):.1%} (per repeat: "
            + ", ".join(f"{x:.1%}" for x in c)
            + ")"
        )
    print("target: the cost of a json_schema <= 15%" if "json_schema" in name_with else "")
    return cost


def report(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    med = {
        name: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "outputs"}
        for name, rs in runs.items()
    }
    ref_name = next(iter(runs))  # in-process, unless --peers left it out
    ref = runs[ref_name]
    agree = {
        name: all(a["outputs"] == b["outputs"] for a, b in zip(ref, rs, strict=True))
        for name, rs in runs.items()
    }
    base = med[ref_name]["tok_s"]
    print(
        f"\n{'peer':14s} {'req/s':>7s} {'tok/s':>8s} {'ratio':>6s} {'TTFT50':>7s} {'TTFT99':>7s} "
        f"{'ITL50':>6s} {'ITL99':>6s} {'cli CPU':>7s} agree   (medians of {len(ref)} runs; ms, s)"
    )
    for name, m in med.items():
        print(
            f"{name:14s} {m['req_s']:7.2f} {m['tok_s']:8.0f} {m['tok_s'] / base:6.2f} "
            f"{m['ttft_p50_ms']:7.0f} {m['ttft_p99_ms']:7.0f} {m['itl_p50_ms']:6.1f} {m['itl_p99_ms']:6.1f} "
            f"{m['client_cpu_s']:7.1f} {agree[name]}"
        )
    overhead = {name: 1 - med[name]["tok_s"] / base for name in runs if name != ref_name}
    per_run = {
        name: [1 - h["tok_s"] / p["tok_s"] for p, h in zip(ref, runs[name], strict=True)] for name in overhead
    }
    for name, o in overhead.items():
        runs_text = ", ".join(f"{x:.1%}" for x in per_run[name])
        print(
            f"HTTP overhead with {name.split()[-1]}: {o:.1%} of in-process throughput (per run: {runs_text})"
        )
    print("target: overhead <= 15% (measured with aiohttp, the lighter load generator)")
    return {
        "medians": med,
        "overhead": overhead,
        "overhead_per_run": per_run,
        "outputs_agree": agree,
        "runs": {k: [{x: y for x, y in r.items() if x != "outputs"} for r in v] for k, v in runs.items()},
    }


if __name__ == "__main__":
    main()
