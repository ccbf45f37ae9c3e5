"""The stress run's report: outcome counts, latencies, resources, and the invariants it checks."""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from asyncexec.config import EngineConfig
from asyncexec.stress.run import KINDS, REFUSED_KINDS, StressResult

__all__ = ["build_report", "print_report"]


def _pct(xs: list[float], q: int) -> float | None:
    if len(xs) < 2:
        return xs[0] if xs else None
    return round(statistics.quantiles(xs, n=100, method="inclusive")[q - 1], 4)


def build_report(ns: argparse.Namespace, config: EngineConfig, result: StressResult) -> dict[str, Any]:
    """The report as JSON-ready data; `passed` is False and `failures` says why if an invariant broke."""
    run, timeline, stats = result.run, result.timeline, result.stats
    resources: dict[str, Any] = {
        "rss_mib": result.rss_mib,
        "fds": result.fds,
        "shm_segments": result.shm_segments,
    }
    outcomes = {
        k: sum(r.outcome == k for r in run.records)
        for k in ("finished", "aborted", "rejected", "errored", "accepted-bad")
    }
    lost = sum(r.outcome is None for r in run.records)
    ok = [
        r
        for r in run.records
        if r.outcome == "finished" and r.end is not None and r.kind not in REFUSED_KINDS
    ]
    lat = [r.end - r.start for r in ok if r.end is not None]
    ttft = [r.first_token - r.start for r in ok if r.first_token is not None]
    failures = _request_failures(result, outcomes, lost) + _resource_failures(ns, resources)
    return {
        "passed": not failures,
        "failures": failures,
        "config": {
            "executor": config.executor_kind,
            "tensor_parallel_size": config.world_size,
            "concurrency": ns.concurrency,
            "kill_worker_every": ns.kill_worker_every,
            "restart_on_worker_failure": config.restart_on_worker_failure,
        },
        "duration_s": round(result.elapsed, 1),
        "requests": dict(total=len(run.records), lost=lost, **outcomes),
        "kinds": {k: sum(r.kind == k for r in run.records) for k in KINDS},
        "greedy_check": run.greedy_skip or "on (float32)",
        "greedy_checks": run.greedy_checked,
        "greedy_mismatches": len(run.mismatches),
        "kills": run.kills,
        "restarts": int(stats["num_restarts"]),
        "restart_s": result.restart_s,
        "preemptions": int(stats["num_preemptions"]),
        "tokens": run.tokens,
        "tokens_per_s": round(sum(timeline) / max(len(timeline), 1), 1),
        "tokens_per_s_timeline": timeline,
        "latency_s": {"p50": _pct(lat, 50), "p99": _pct(lat, 99)},
        "ttft_s": {"p50": _pct(ttft, 50), "p99": _pct(ttft, 99)},
        **resources,
    }


def _request_failures(result: StressResult, outcomes: dict[str, int], lost: int) -> list[str]:
    """The broken invariants of the requests: lost, errored, a bad one accepted, a greedy mismatch, and
    a KV pool that did not return to full."""
    run, stats, unfinished = result.run, result.stats, result.unfinished
    failures = []
    if lost:
        failures.append(f"{lost} requests were lost (never finished, aborted or errored)")
    if outcomes["errored"]:
        errs = sorted({r.error or "" for r in run.records if r.outcome == "errored"})
        failures.append(f"{outcomes['errored']} requests errored: {errs[:3]}")
    if outcomes["accepted-bad"]:
        failures.append(f"{outcomes['accepted-bad']} invalid requests were accepted")
    if run.mismatches:
        failures.append(
            f"{len(run.mismatches)} greedy outputs disagreed with their reference: {run.mismatches[:2]}"
        )
    if unfinished or stats["num_free_blocks"] != stats["num_blocks"]:
        failures.append(
            f"the KV pool did not return to full: {stats['num_free_blocks']:.0f} of "
            f"{stats['num_blocks']:.0f} blocks free, unfinished requests: {unfinished}"
        )
    return failures


def _resource_failures(ns: argparse.Namespace, resources: dict[str, Any]) -> list[str]:
    """The broken invariants of the processes: RSS growth after warm-up, leaked fds or segments."""
    failures = []
    rss = resources["rss_mib"]
    for name, start in rss["start"].items():
        end = rss["end"].get(name, 0.0)
        if start and end > start * (1 + ns.max_rss_growth):
            failures.append(f"RSS of {name} grew from {start:.0f} to {end:.0f} MiB after warm-up")
    fds, segs = resources["fds"], resources["shm_segments"]
    if fds["after_shutdown"] > fds["before_start"] or fds["end"] > fds["after_warmup"]:
        failures.append(f"file descriptors leaked: {fds}")
    if segs["after_shutdown"] > segs["before_start"] or segs["end"] > segs["after_warmup"]:
        failures.append(f"shared-memory segments leaked: {segs}")
    return failures


def print_report(report: dict[str, Any]) -> None:
    for key, value in report.items():
        if key not in ("tokens_per_s_timeline", "failures", "passed"):
            print(f"{key:>22}: {value}")
    tl = report["tokens_per_s_timeline"]
    if tl:
        step = max(1, len(tl) // 12)
        windows = [round(sum(tl[i : i + step]) / len(tl[i : i + step])) for i in range(0, len(tl), step)]
        print(f"{'tokens/s over time':>22}: {windows} (windows of {step} s)")
    for f in report["failures"]:
        print(f"FAILED: {f}")
    print("stress: PASSED" if report["passed"] else "stress: FAILED")
