"""The stress run itself: clients, the worker killer, the progress bar, and what they measure."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from asyncexec.config import EngineConfig
from asyncexec.engine import AsyncEngine
from asyncexec.errors import AsyncExecError, InvalidRequestError
from asyncexec.ipc.shm import SHM_DIR
from asyncexec.sampling_params import SamplingParams

__all__ = ["KINDS", "REFUSED_KINDS", "Record", "StressResult", "StressRun", "stress"]

KINDS = ("normal", "reference", "abort", "cancel", "bad", "long", "oversize")
REFUSED_KINDS = ("bad", "oversize")  # requests that must be refused at admission


@dataclass
class Record:
    kind: str
    start: float
    outcome: str | None = None  # finished | aborted | rejected | errored | accepted-bad
    first_token: float | None = None
    end: float | None = None
    error: str | None = None


@dataclass
class StressRun:
    rng: random.Random
    records: list[Record] = field(default_factory=list)
    tokens: int = 0
    mismatches: list[str] = field(default_factory=list)
    greedy_skip: str | None = None  # why greedy outputs are not compared (bfloat16, float16); None: they are
    greedy_checked: int = 0  # greedy outputs compared with their reference
    kills: int = 0
    stop: bool = False


@dataclass
class StressResult:
    run: StressRun
    timeline: list[float]  # tokens generated in each second of the measured phase
    elapsed: float
    stats: dict[str, float]  # engine.stats() at the end, before shutdown
    restart_s: list[float]  # how long each restart took, death seen to ready
    unfinished: bool
    rss_mib: dict[str, dict[str, float]]
    fds: dict[str, int]
    shm_segments: dict[str, int]


def _rss_mib(pid: int) -> float:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _segments() -> int:
    return sum(n.startswith("asyncexec-") for n in os.listdir(SHM_DIR))


def _worker_pids(engine: AsyncEngine) -> list[int]:
    return list(getattr(engine.executor, "worker_pids", []))


def _processes(engine: AsyncEngine) -> dict[str, float]:
    out = {"engine": _rss_mib(os.getpid())}
    for rank, pid in enumerate(_worker_pids(engine)):
        out[f"rank{rank}"] = _rss_mib(pid)
    return out


def _draw_request(
    engine: AsyncEngine, rng: random.Random, refs: list[tuple[list[int], list[int]]], ns: argparse.Namespace
) -> tuple[str, Any, SamplingParams, list[int] | None]:
    """A random request: its kind, prompt, sampling parameters and (a reference) its expected output."""
    kind = _draw_kind(rng, ns)
    vocab = engine.model_info["vocab_size"]
    prompt: Any = [rng.randrange(vocab) for _ in range(rng.randint(1, ns.max_prompt_len))]
    sp = SamplingParams(
        max_tokens=rng.randint(1, ns.max_output_len), temperature=0.8, seed=rng.randrange(1 << 30)
    )
    shaped = _shape(engine, rng, kind, sp.max_tokens)
    if shaped is None and kind in ("long", "oversize"):
        kind = "normal"  # the engine's limits leave no room for such a request
    elif shaped is not None:
        prompt = [rng.randrange(vocab) for _ in range(shaped[0])]
        sp = msgspec.structs.replace(sp, max_tokens=shaped[1])
    ref: list[int] | None = None
    if kind == "reference":
        prompt, ref = rng.choice(refs)
        sp = SamplingParams(max_tokens=len(ref), temperature=0.0, ignore_eos=True)
    elif kind == "bad" and rng.random() < 0.25:  # logprobs past the cap once failed the whole step
        sp = SamplingParams(max_tokens=4, logprobs=engine.config.max_logprobs + 1)
    elif kind == "bad":
        prompt = rng.choice(
            [[], [vocab + 5], [-1, 3], "x" * 0, 3.5, [0] * engine.model_info["max_model_len"]]
        )
    return kind, prompt, sp, ref


async def _one(
    engine: AsyncEngine, run: StressRun, refs: list[tuple[list[int], list[int]]], ns: argparse.Namespace
) -> None:
    rng = run.rng
    kind, prompt, sp, ref = _draw_request(engine, rng, refs, ns)
    rec = Record(kind, time.monotonic())
    run.records.append(rec)
    stop_after = rng.randint(1, max(1, sp.max_tokens - 1)) if kind == "abort" else None

    async def consume() -> list[int]:
        toks: list[int] = []
        async with contextlib.aclosing(engine.generate(prompt, sp)) as stream:
            async for out in stream:
                if rec.first_token is None and out.new_token_ids:
                    rec.first_token = time.monotonic()
                run.tokens += len(out.new_token_ids)
                toks = out.token_ids
                if stop_after is not None and len(toks) >= stop_after and not out.finished:
                    rec.outcome = "aborted"
                    break
        return toks

    try:
        if kind == "cancel":  # the client gives up after a random wait: the request is cancelled
            try:
                await asyncio.wait_for(consume(), timeout=rng.uniform(0.01, 1.0))
            except asyncio.TimeoutError:
                rec.outcome = "aborted"
        else:
            toks = await consume()
            if kind in REFUSED_KINDS:
                rec.outcome = "accepted-bad"
            if ref is not None and run.greedy_skip is None:
                run.greedy_checked += 1
                if toks != ref:
                    run.mismatches.append(f"prompt {prompt[:8]}...: got {toks[:12]}, reference {ref[:12]}")
        if rec.outcome is None:
            rec.outcome = "finished"
    except InvalidRequestError as e:
        rec.outcome = "rejected" if kind in REFUSED_KINDS else "errored"
        rec.error = None if kind in REFUSED_KINDS else str(e)
    except AsyncExecError as e:
        rec.outcome, rec.error = "errored", str(e).splitlines()[0]
    rec.end = time.monotonic()


def _draw_kind(rng: random.Random, ns: argparse.Namespace) -> str:
    """A request's kind, by the flags' shares (what they leave is "normal")."""
    r = rng.random()
    for kind, share in (("bad", ns.bad_request_rate), ("reference", ns.reference_rate),
                        ("abort", ns.abort_rate), ("long", getattr(ns, "long_prompt_rate", 0.0)),
                        ("oversize", getattr(ns, "oversize_rate", 0.0))):  # fmt: skip
        if r < share:
            return rng.choice(("abort", "cancel")) if kind == "abort" else kind
        r -= share
    return "normal"


def _shape(engine: AsyncEngine, rng: random.Random, kind: str, max_tokens: int) -> tuple[int, int] | None:
    """(prompt length, max_tokens) of a "long" request (a prompt longer than a step's token budget, so
    its prefill is chunked and its first chunks sample nothing) or an "oversize" one (a prompt and
    max_tokens that need more KV cache than it holds, which the engine must refuse); None where the
    engine's limits leave no room for one (or for another kind)."""
    if kind not in ("long", "oversize"):
        return None
    longest = engine.max_seq_len  # max_model_len, or fewer where the KV cache holds fewer
    if kind == "long":
        budget = engine.config.max_num_batched_tokens
        top = min(3 * budget, longest - max_tokens)
        return (rng.randint(budget + 1, top), max_tokens) if top > budget else None
    if kind == "oversize" and longest < engine.model_info["max_model_len"]:
        prompt = rng.randint(1, longest - 1)  # the cache holds longest - 1 computed tokens
        most = engine.model_info["max_model_len"] - prompt
        return prompt, rng.randint(min(longest + 1 - prompt, most), most)
    return None


async def _collect(engine: AsyncEngine, prompt: list[int], sp: SamplingParams) -> list[int]:
    toks: list[int] = []
    async for out in engine.generate(prompt, sp):
        toks = out.token_ids
    return toks


async def _load(
    engine: AsyncEngine,
    run: StressRun,
    refs: list[tuple[list[int], list[int]]],
    ns: argparse.Namespace,
    deadline: float,
    budget: int | None,
    drain_s: float = 120.0,
) -> None:
    """`ns.concurrency` clients issue requests until `deadline` or `budget` requests; then drain."""
    started = [0]

    async def client() -> None:
        while not run.stop and time.monotonic() < deadline and (budget is None or started[0] < budget):
            started[0] += 1
            await _one(engine, run, refs, ns)

    tasks = [asyncio.ensure_future(client()) for _ in range(ns.concurrency)]
    wait_s = max(0.0, deadline - time.monotonic()) + drain_s if budget is None else None
    try:
        done, _ = await asyncio.wait(tasks, timeout=wait_s)
    finally:  # a request that never ends is lost (its record keeps outcome None); so is an interrupted one
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for t in done:
        if not t.cancelled() and t.exception() is not None:
            raise t.exception()  # type: ignore[misc]


async def _killer(engine: AsyncEngine, run: StressRun, every: float, deadline: float) -> None:
    """SIGKILL a random rank `every` seconds after the engine last started serving, until `deadline` (the
    drain after it is left alone). A kill waits for the restart it caused to finish (or for the engine to
    fail), so a restart slower than `every` (a real model on few cores) is measured, not killed again
    while it loads."""
    while True:
        await asyncio.sleep(every)
        if time.monotonic() >= deadline:
            return
        pids = _worker_pids(engine)
        if pids:
            rank = run.rng.randrange(len(pids))
            healed = len(engine.restart_seconds)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids[rank], signal.SIGKILL)
                run.kills += 1
                print(f"\nstress: SIGKILLed rank {rank} (pid {pids[rank]})", file=sys.stderr, flush=True)
                while len(engine.restart_seconds) == healed and engine.is_healthy:  # noqa: ASYNC110 (no event to wait on)
                    await asyncio.sleep(0.1)


async def _ticker(engine: AsyncEngine, run: StressRun, ns: argparse.Namespace, timeline: list[float]) -> None:
    from tqdm import tqdm

    total = ns.requests if ns.requests is not None else ns.duration
    unit = "req" if ns.requests is not None else "s"
    bar = tqdm(total=total, unit=unit, disable=ns.no_progress, file=sys.stderr, dynamic_ncols=True)
    t0, last_tokens = time.monotonic(), run.tokens
    try:
        while True:
            await asyncio.sleep(1.0)
            timeline.append(float(run.tokens - last_tokens))
            last_tokens = run.tokens
            done = sum(r.outcome is not None for r in run.records)
            bar.n = min(total, done if ns.requests is not None else round(time.monotonic() - t0))
            bar.set_postfix(done=done, tok_s=int(timeline[-1]), restarts=engine.num_restarts, kills=run.kills)
    finally:
        bar.close()


async def stress(
    ns: argparse.Namespace, config: EngineConfig, greedy_skip: str | None = None
) -> StressResult:
    """Run the load the flags describe on a fresh engine, and measure it. With `greedy_skip` (the
    reason), greedy copies of the references still run but their outputs are not compared."""
    fds0, seg0 = _fds(), _segments()
    run = StressRun(random.Random(ns.stress_seed), greedy_skip=greedy_skip)
    engine = AsyncEngine(config)
    print(f"stress: starting the engine ({config.executor_kind}, {config.world_size} ranks)", file=sys.stderr)
    await engine.start()
    timeline: list[float] = []
    try:
        vocab, rng = engine.model_info["vocab_size"], run.rng
        ref_prompts = [
            [rng.randrange(vocab) for _ in range(rng.randint(4, ns.max_prompt_len))] for _ in range(8)
        ]
        ref_sp = SamplingParams(max_tokens=ns.max_output_len, temperature=0.0, ignore_eos=True)
        ref_outs = await asyncio.gather(*(_collect(engine, p, ref_sp) for p in ref_prompts))
        refs = list(zip(ref_prompts, ref_outs, strict=True))
        print(
            f"stress: {len(refs)} greedy references computed; warming up for {ns.warmup:g} s", file=sys.stderr
        )
        await _load(engine, run, refs, ns, time.monotonic() + ns.warmup, None)
        rss0, fds_warm, seg_warm = _processes(engine), _fds(), _segments()
        t0 = time.monotonic()
        deadline = t0 + ns.duration if ns.requests is None else math.inf
        side = [asyncio.ensure_future(_ticker(engine, run, ns, timeline))]
        if ns.kill_worker_every:
            side.append(asyncio.ensure_future(_killer(engine, run, ns.kill_worker_every, deadline)))
        try:
            await _load(engine, run, refs, ns, deadline, ns.requests)
        finally:
            for t in side:
                t.cancel()
            await asyncio.gather(*side, return_exceptions=True)
        elapsed = time.monotonic() - t0
        stats, rss1, fds_end, seg_end = engine.stats(), _processes(engine), _fds(), _segments()
        unfinished = engine.has_unfinished_requests()
        restart_s = [round(x, 2) for x in engine.restart_seconds]
    finally:
        await engine.shutdown()
    fds1, seg1 = _fds(), _segments()
    return StressResult(
        run,
        timeline,
        elapsed,
        stats,
        restart_s,
        unfinished,
        rss_mib={"start": rss0, "end": rss1},
        fds={"before_start": fds0, "after_warmup": fds_warm, "end": fds_end, "after_shutdown": fds1},
        shm_segments={"before_start": seg0, "after_warmup": seg_warm, "end": seg_end, "after_shutdown": seg1},
    )
