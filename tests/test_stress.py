"""A CI-sized stress run: mp with 2 ranks, random aborts and bad requests, and one worker SIGKILLed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(300)
def test_a_ci_sized_stress_run_keeps_every_invariant(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    report_path = tmp_path / "stress.json"
    argv = [
        sys.executable,
        "-m",
        "asyncexec",
        "stress",
        "--model",
        str(tiny_models["llama"]),
        "--duration",
        "30",
        "--kill-worker-every",
        "20",
        "--json",
        str(report_path),
        "--no-progress",
    ]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["passed"] and report["failures"] == []
    req = report["requests"]
    assert req["lost"] == 0 and req["errored"] == 0 and req["accepted-bad"] == 0
    assert req["finished"] > 100 and req["aborted"] > 0 and req["rejected"] > 0
    assert report["kills"] == 1 and report["restarts"] == 1 and len(report["restart_s"]) == 1
    assert report["preemptions"] > 0  # the small default KV cache makes recompute part of the run
    assert report["greedy_checks"] > 0 and report["greedy_mismatches"] == 0
    assert report["fds"]["after_shutdown"] == report["fds"]["before_start"]
    assert report["shm_segments"]["after_shutdown"] == report["shm_segments"]["before_start"]
    assert "stress: PASSED" in r.stdout


def _result(**changes: object) -> object:
    import random

    from asyncexec.stress.run import Record, StressResult, StressRun

    run = StressRun(random.Random(0))
    run.records = [Record("normal", 0.0, "finished", 0.1, 0.5), Record("bad", 0.0, "rejected", None, 0.1)]
    base = {
        "run": run,
        "timeline": [10.0, 12.0],
        "elapsed": 2.0,
        "unfinished": False,
        "restart_s": [],
        "stats": {"num_free_blocks": 10, "num_blocks": 10, "num_restarts": 0, "num_preemptions": 0},
        "rss_mib": {"start": {"engine": 100.0, "rank0": 100.0}, "end": {"engine": 105.0, "rank0": 90.0}},
        "fds": {"before_start": 5, "after_warmup": 9, "end": 9, "after_shutdown": 5},
        "shm_segments": {"before_start": 0, "after_warmup": 2, "end": 2, "after_shutdown": 0},
    }
    base.update(changes)
    return StressResult(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({}, None),
        ({"unfinished": True}, "KV pool did not return to full"),
        (
            {"stats": {"num_free_blocks": 9, "num_blocks": 10, "num_restarts": 0, "num_preemptions": 0}},
            "KV pool",
        ),
        ({"rss_mib": {"start": {"engine": 100.0}, "end": {"engine": 111.0}}}, "RSS of engine grew"),
        (
            {"fds": {"before_start": 5, "after_warmup": 9, "end": 9, "after_shutdown": 6}},
            "file descriptors leaked",
        ),
        (
            {"fds": {"before_start": 5, "after_warmup": 9, "end": 10, "after_shutdown": 5}},
            "file descriptors leaked",
        ),
        (
            {"shm_segments": {"before_start": 0, "after_warmup": 2, "end": 2, "after_shutdown": 1}},
            "segments leaked",
        ),
    ],
)
def test_the_report_fails_each_broken_invariant(change: dict[str, object], needle: str | None) -> None:
    import argparse

    from asyncexec import EngineConfig
    from asyncexec.stress.report import build_report

    ns = argparse.Namespace(max_rss_growth=0.10, concurrency=4, kill_worker_every=None)
    report = build_report(ns, EngineConfig(), _result(**change))  # type: ignore[arg-type]
    if needle is None:
        assert (
            report["passed"] and report["requests"]["finished"] == 1 and report["requests"]["rejected"] == 1
        )
    else:
        assert not report["passed"] and any(needle in f for f in report["failures"]), report["failures"]


@pytest.mark.parametrize(
    ("outcome", "needle"),
    [(None, "were lost"), ("errored", "errored"), ("accepted-bad", "invalid requests were accepted")],
)
def test_the_report_fails_lost_errored_and_accepted_bad_requests(outcome: str | None, needle: str) -> None:
    import argparse

    from asyncexec import EngineConfig
    from asyncexec.stress.report import build_report
    from asyncexec.stress.run import Record

    result = _result()
    result.run.records.append(Record("bad" if outcome == "accepted-bad" else "normal", 0.0, outcome))  # type: ignore[attr-defined]
    result.run.mismatches.append("prompt [1]: got [2], reference [3]")  # type: ignore[attr-defined]
    ns = argparse.Namespace(max_rss_growth=0.10, concurrency=4, kill_worker_every=None)
    report = build_report(ns, EngineConfig(), result)  # type: ignore[arg-type]
    assert not report["passed"]
    assert any(needle in f for f in report["failures"]) and any("disagreed" in f for f in report["failures"])
