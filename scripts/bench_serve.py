"""Benchmark the OpenAI-compatible server against the same workload run in-process, in one run.

Workload: 64 concurrent streaming clients, each sending `--per-client` greedy requests one after the
other (prompt lengths 16-256, outputs 32-128 tokens, EOS ignored, so both peers make exactly the same
tokens) to a tiny random llama (4 layers, width 256).
Peers: `engine.generate` in-process (uni x1), and `asyncexec serve` (uni x1, a real uvicorn process)
driven over HTTP/SSE from this process by aiohttp (the load generator vLLM's serving benchmark uses)
and by httpx. Repeated `--repeats` times, alternating; medians.
Reports requests/s, output tokens/s, TTFT and ITL p50/p99, the CPU seconds the clients themselves
took (they share this machine's cores with the server), the HTTP overhead (1 - aiohttp/in-process
throughput; target <= 15%) and whether the greedy outputs agree. Writes JSON.
Usage: python scripts/bench_serve.py [--quick] [--json PATH]
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
from asyncexec.models import BENCH_MODEL, make_tiny_model

MODEL = os.path.join(".cache", "bench-llama")
FLAGS = {
    "max_model_len": 1024,
    "max_num_batched_tokens": 1024,
    "max_num_seqs": 64,
    "kv_cache_memory_bytes": 512 << 20,
}
Work = list[list[tuple[list[int], int]]]  # per client: (prompt, max_tokens) requests


def progress(msg: str) -> None:
    print(f"  .. {msg}", file=sys.stderr, flush=True)


def workload(clients: int, per_client: int, seed: int = 0) -> Work:
    rng = random.Random(seed)
    return [
        [
            ([rng.randrange(256) for _ in range(rng.randint(16, 256))], rng.randint(32, 128))
            for _ in range(per_client)
        ]
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


async def in_process(work: Work, executor: str) -> dict[str, Any]:
    cfg = EngineConfig(model=MODEL, executor=executor, **FLAGS)  # type: ignore[arg-type]
    async with AsyncEngine(cfg) as engine:

        async def one(p: list[int], m: int, lat: Latencies) -> list[int]:
            tick, toks = lat.clock(), []
            async for out in engine.generate(
                p, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
            ):
                tick()
                toks = out.token_ids
            return toks

        return await run_clients(one, work)


_chunk = msgspec.json.Decoder()


def _body(p: list[int], m: int) -> dict[str, Any]:
    return {
        "prompt": p,
        "max_tokens": m,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
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


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(coro: Any) -> dict[str, Any]:
    """Run a peer; adds the CPU seconds this (client) process took."""
    c0 = cpu_seconds()
    res: dict[str, Any] = uvloop.run(coro)
    res["client_cpu_s"] = cpu_seconds() - c0
    return res


def start_server(port: int, executor: str) -> subprocess.Popen[bytes]:
    argv = [
        sys.executable,
        "-m",
        "asyncexec",
        "serve",
        "--model",
        MODEL,
        "--port",
        str(port),
        "--executor",
        executor,
        "--log-level",
        "warning",
    ]
    for k, v in FLAGS.items():
        argv += ["--" + k.replace("_", "-"), str(v)]
    proc = subprocess.Popen(argv)
    deadline = time.monotonic() + 120
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
    raise SystemExit("the server did not become healthy in 120 s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 repeat, 1 request per client")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--per-client", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--executor", choices=["uni", "mp"], default="uni", help="both peers' executor (uni)")
    ap.add_argument("--json", default="bench-results/bench_serve.json")
    args = ap.parse_args()
    repeats, per_client = (1, 1) if args.quick else (args.repeats, args.per_client)
    if not os.path.isdir(MODEL):
        progress(f"building {MODEL}")
        make_tiny_model(MODEL, "llama", **BENCH_MODEL)
    work = workload(args.clients, per_client)
    runs: dict[str, list[dict[str, Any]]] = {"in-process": [], "http aiohttp": [], "http httpx": []}
    progress("starting asyncexec serve")
    server = start_server(args.port, args.executor)
    try:
        for i in range(repeats):
            progress(f"repeat {i + 1}/{repeats}: in-process engine.generate")
            runs["in-process"].append(timed(in_process(work, args.executor)))
            url = f"http://127.0.0.1:{args.port}"
            progress(f"repeat {i + 1}/{repeats}: {args.clients} streaming HTTP clients (aiohttp)")
            runs["http aiohttp"].append(timed(over_aiohttp(url, work)))
            progress(f"repeat {i + 1}/{repeats}: {args.clients} streaming HTTP clients (httpx)")
            runs["http httpx"].append(timed(over_httpx(url, work)))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    report(runs, args.json)


def report(runs: dict[str, list[dict[str, Any]]], path: str) -> None:
    med = {
        name: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "outputs"}
        for name, rs in runs.items()
    }
    ref = runs["in-process"]
    agree = {
        name: all(a["outputs"] == b["outputs"] for a, b in zip(ref, rs, strict=True))
        for name, rs in runs.items()
    }
    base = med["in-process"]["tok_s"]
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
    overhead = {name: 1 - med[name]["tok_s"] / base for name in runs if name != "in-process"}
    per_run = {
        name: [1 - h["tok_s"] / p["tok_s"] for p, h in zip(ref, runs[name], strict=True)] for name in overhead
    }
    for name, o in overhead.items():
        runs_text = ", ".join(f"{x:.1%}" for x in per_run[name])
        print(
            f"HTTP overhead with {name.split()[-1]}: {o:.1%} of in-process throughput (per run: {runs_text})"
        )
    print("target: overhead <= 15% (measured with aiohttp, the lighter load generator)")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(
            {
                "medians": med,
                "overhead": overhead,
                "overhead_per_run": per_run,
                "outputs_agree": agree,
                "runs": {
                    k: [{kk: vv for kk, vv in r.items() if kk != "outputs"} for r in v]
                    for k, v in runs.items()
                },
            },
            f,
            indent=1,
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
