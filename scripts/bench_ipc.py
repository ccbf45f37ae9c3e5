"""Benchmark the runtime's data path against its floor and its peers, in one run.

Measures (medians of individually timed calls):
  floor      zmq.asyncio + uvloop broadcast of 64 B to N plain-zmq processes, gather N replies
  rpc        collective_rpc no-op: uni, mp x1, mp x2, under uvloop and asyncio
  step       execute_model with a 256-request SchedulerOutput, full, then as steady-state deltas
  tensor     64 MiB to 2 ranks (one way: the ranks only look at the view) and back (each rank echoes it)
  ray        (where Ray is installed) collective_rpc no-op on RayExecutor x2, and plain Ray actor calls
  peers      multiprocessing.Pipe + pickle (64 B round trip, 64 MiB handoff), torch.multiprocessing.Queue
             handoff of a fresh 64 MiB tensor, and single-thread memcpy bandwidth

Prints a table of ratios and writes JSON (default bench-results/bench_ipc.json).
Usage: python scripts/bench_ipc.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch
import uvloop
import zmq
import zmq.asyncio

from asyncexec import (
    CachedRequestData,
    EngineConfig,
    Executor,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)

EXT = "_bench_ext:BenchExtension"
MiB = 1 << 20
_FLOOR_CHILD = """
import sys, zmq
ctx = zmq.Context(); pull = ctx.socket(zmq.PULL); pull.connect(sys.argv[1])
push = ctx.socket(zmq.PUSH); push.connect(sys.argv[2])
while (m := pull.recv()) != b"quit":
    push.send(m)
"""


def progress(msg: str) -> None:
    print(f"  .. {msg}", file=sys.stderr, flush=True)


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def p99(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(len(xs) * 0.99))]


async def timed(fn: Callable[[], Awaitable[Any]], iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        await fn()
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t)
    return out


async def floor(ranks: int, iters: int) -> list[float]:
    d = tempfile.mkdtemp(prefix="asyncexec-bench-")
    ctx = zmq.asyncio.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"ipc://{d}/reply")
    pushes, procs = [], []
    for r in range(ranks):
        s = ctx.socket(zmq.PUSH)
        s.bind(f"ipc://{d}/req{r}")
        pushes.append(s)
        procs.append(
            subprocess.Popen([sys.executable, "-c", _FLOOR_CHILD, f"ipc://{d}/req{r}", f"ipc://{d}/reply"])
        )
    msg = b"x" * 64

    async def once() -> None:
        for s in pushes:
            await s.send(msg)
        for _ in range(ranks):
            await pull.recv()

    try:
        return await timed(once, iters, 500)
    finally:
        for s in pushes:
            await s.send(b"quit")
        for p in procs:
            p.wait()
        ctx.destroy(linger=0)
        os.rmdir(d) if not os.listdir(d) else None


def scheduler_outputs(n: int) -> tuple[SchedulerOutput, SchedulerOutput]:
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(64, 512, (n,), generator=g).tolist()
    new = [
        NewRequestData(
            f"req-{i}",
            torch.randint(0, 32000, (ln,), generator=g).tolist(),
            SamplingParams(temperature=0.0, max_tokens=128),
            list(range(i * 32, i * 32 + (ln + 15) // 16)),
            0,
        )
        for i, ln in enumerate(lens)
    ]
    ids = [r.req_id for r in new]
    full = SchedulerOutput(
        0, new, CachedRequestData(), {i: ln for i, ln in zip(ids, lens, strict=True)}, sum(lens)
    )
    delta = SchedulerOutput(
        1,
        [],
        CachedRequestData(ids, [False] * n, [[] for _ in ids], [[] for _ in ids], [ln + 7 for ln in lens]),
        dict.fromkeys(ids, 1),
        n,
    )
    return full, delta


async def executor_suite(kind: str, ranks: int, iters: int, heavy: bool) -> dict[str, list[float]]:
    cfg = EngineConfig(executor=kind, tensor_parallel_size=ranks, worker_extension=EXT)  # type: ignore[arg-type]
    res: dict[str, list[float]] = {}
    async with Executor.create(cfg) as ex:
        res["rpc"] = await timed(lambda: ex.collective_rpc("noop"), iters, 300)
        if heavy:
            full, delta = scheduler_outputs(256)
            res["step_full"] = await timed(lambda: ex.execute_model(full), max(50, iters // 20), 10)
            res["step_delta"] = await timed(lambda: ex.execute_model(delta), max(100, iters // 10), 20)
            t = torch.randn(16 * MiB)
            res["tensor_oneway"] = await timed(lambda: ex.collective_rpc("nbytes", (t,)), 10, 2)
            res["tensor_roundtrip"] = await timed(lambda: ex.collective_rpc("echo", (t,)), 10, 2)
    return res


class _RayEcho:
    def noop(self) -> None:
        return None


def ray_actor_call(iters: int) -> list[float]:
    """The plain Ray peer: `ray.get(actor.method.remote())`, one actor."""
    import ray

    actor = ray.remote(_RayEcho).remote()
    ray.get(actor.noop.remote())
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        ray.get(actor.noop.remote())
        out.append(time.perf_counter() - t)
    ray.kill(actor)
    return out


def _pipe_child(conn: Any) -> None:
    while (m := conn.recv()) is not None:
        conn.send(m if len(m) <= 64 else len(m))


def pipe_pickle(iters: int) -> tuple[list[float], list[float]]:
    a, b = mp.Pipe()
    p = mp.get_context("spawn").Process(target=_pipe_child, args=(b,))
    p.start()
    msg = b"x" * 64
    small, big = [], []
    for i in range(iters + 200):
        t = time.perf_counter()
        a.send(msg)
        a.recv()
        if i >= 200:
            small.append(time.perf_counter() - t)
    for i in range(8):
        payload = torch.full((16 * MiB,), float(i)).numpy().tobytes()  # plain pickle: torch's shm reducer
        t = time.perf_counter()  # would move a tensor's storage once and then send it for free
        a.send(payload)
        a.recv()
        big.append(time.perf_counter() - t)
    a.send(None)
    p.join()
    return small, big


def _tmq_child(q: Any, acks: Any) -> None:
    while (t := q.get()) is not None:
        acks.put(t.numel())
        del t


def tmq_handoff(n: int) -> list[float]:
    ctx = torch.multiprocessing.get_context("spawn")
    q, acks = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_tmq_child, args=(q, acks))
    p.start()
    out = []
    for i in range(n + 2):
        fresh = torch.full((16 * MiB,), float(i))  # a new tensor each time, as a producer makes them
        t0 = time.perf_counter()
        q.put(fresh)
        del fresh
        acks.get()
        if i >= 2:
            out.append(time.perf_counter() - t0)
    q.put(None)
    p.join()
    return out


def memcpy_gbps() -> float:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    src, dst = torch.randn(16 * MiB), torch.empty(16 * MiB)
    dst.copy_(src)
    times = []
    for _ in range(10):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    torch.set_num_threads(threads)
    return 64 * MiB / med(times) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer iterations (the demo)")
    ap.add_argument("--json", default="bench-results/bench_ipc.json", help="where to write the results")
    args = ap.parse_args()
    iters = 1000 if args.quick else 5000
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    r: dict[str, Any] = {}
    for n in (1, 2):
        progress(f"raw floor, {n} rank(s)")
        r[f"floor_{n}"] = uvloop.run(floor(n, iters))
    for loop_name, run in (("uvloop", uvloop.run), ("asyncio", asyncio.run)):
        for kind, ranks in (("uni", 1), ("mp", 1), ("mp", 2)):
            progress(f"executor {kind} x{ranks} under {loop_name}")
            heavy = loop_name == "uvloop" and (kind, ranks) == ("mp", 2)
            for k, v in run(executor_suite(kind, ranks, iters, heavy)).items():
                r[f"{k}_{kind}{ranks}_{loop_name}"] = v
    if importlib.util.find_spec("ray") is not None:
        progress("executor ray x2 under uvloop, and plain Ray actor calls")
        for k, v in uvloop.run(executor_suite("ray", 2, max(200, iters // 5), False)).items():
            r[f"{k}_ray2_uvloop"] = v
        r["ray_actor_call"] = ray_actor_call(max(200, iters // 5))
    progress("peers: multiprocessing.Pipe, torch.multiprocessing.Queue, memcpy")
    r["pipe_small"], r["pipe_64mib"] = pipe_pickle(iters)
    r["tmq_64mib"] = tmq_handoff(8)
    gbps = memcpy_gbps()
    report(r, gbps, args.json)
    return 0


def report(r: dict[str, Any], memcpy: float, path: str) -> None:
    us = {k: med(v) * 1e6 for k, v in r.items()}
    fl = us["floor_2"]
    rows = [("raw floor, 1 rank (zmq.asyncio+uvloop)", "floor_1", us["floor_1"] / us["floor_1"])]
    rows.append(("raw floor, 2 ranks", "floor_2", 1.0))
    for loop_name in ("uvloop", "asyncio"):
        for cfg in ("uni1", "mp1", "mp2"):
            key = f"rpc_{cfg}_{loop_name}"
            rows.append((f"collective_rpc no-op, {cfg}, {loop_name}", key, us[key] / fl))
    if "rpc_ray2_uvloop" in us:
        rows.append(("collective_rpc no-op, ray x2, uvloop", "rpc_ray2_uvloop", us["rpc_ray2_uvloop"] / fl))
        rows.append(
            ("plain Ray actor call, ray.get(a.m.remote())", "ray_actor_call", us["ray_actor_call"] / fl)
        )
    rows.append(("multiprocessing.Pipe+pickle, 64 B", "pipe_small", us["pipe_small"] / fl))
    print(f"\n{'round trip (median)':46s} {'us':>9s} {'p99 us':>9s} {'x floor(2)':>10s}")
    for label, key, ratio in rows:
        print(f"{label:46s} {us[key]:9.1f} {p99(r[key]) * 1e6:9.1f} {ratio:10.2f}")
    print(f"\n{'execute_model, 256 requests, mp x2':46s} {'us':>9s} {'p99 us':>9s}")
    for mode in ("full", "delta"):
        key = f"step_{mode}_mp2_uvloop"
        print(f"{'  ' + mode:46s} {us[key]:9.1f} {p99(r[key]) * 1e6:9.1f}")
    one, back = us["tensor_oneway_mp2_uvloop"] / 1e3, us["tensor_roundtrip_mp2_uvloop"] / 1e3
    tmq, pipe = us["tmq_64mib"] / 1e3, us["pipe_64mib"] / 1e3
    bw = 64 * MiB / (one / 1e3) / 1e9
    print(f"\n{'64 MiB handoff (median)':46s} {'ms':>9s} {'GB/s':>9s} {'vs ours':>10s}")
    print(f"{'asyncexec mp x2, one way (to both ranks)':46s} {one:9.2f} {bw:9.2f} {1.0:10.2f}")
    print(
        f"{'asyncexec mp x2, there and back':46s} {back:9.2f} {128 * MiB / (back / 1e3) / 1e9:9.2f} {'':>10s}"
    )
    for label, ms in (
        ("torch.multiprocessing.Queue, fresh tensor", tmq),
        ("multiprocessing.Pipe + pickle", pipe),
    ):
        print(f"{label:46s} {ms:9.2f} {64 * MiB / (ms / 1e3) / 1e9:9.2f} {ms / one:10.2f}")
    print(f"{'memcpy, one thread':46s} {64 * MiB / memcpy / 1e6:9.2f} {memcpy:9.2f}")
    targets = {
        "mp2_rpc_vs_floor<=1.3": us["rpc_mp2_uvloop"] / fl,
        **(
            {"ray_actor_call_vs_ray2_rpc>=5": us["ray_actor_call"] / us["rpc_ray2_uvloop"]}
            if "ray_actor_call" in us
            else {}
        ),
        "oneway_bw_vs_memcpy>=0.7": bw / memcpy,
        "speedup_vs_tmq>=4": tmq / one,
    }
    print("\ntargets:", ", ".join(f"{k}: {v:.2f}" for k, v in targets.items()))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"median_us": us, "memcpy_gbps": memcpy, "targets": targets, "samples": r}, f)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
