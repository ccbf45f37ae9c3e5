"""Prometheus metrics of one engine, on the engine's own registry (several engines may share a process).

Events (finished requests, tokens, latencies, step times, restarts) are counted as they happen by the
engine; state (queue sizes, KV-cache usage, prefix-cache hits) is read from `engine.stats()` at scrape
time. `render()` returns the text exposition format that `GET /metrics` serves.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from asyncexec.errors import ExecutorClosedError

if TYPE_CHECKING:
    from asyncexec.core.scheduler import Request

__all__ = ["FINISH_REASONS", "SPEC_POS_KEY", "EngineMetrics"]

FINISH_REASONS = ("stop", "length", "abort", "error")
_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)
_GAUGES = {
    "num_running": ("asyncexec_num_requests_running", "Requests in the running batch."),
    "num_waiting": ("asyncexec_num_requests_waiting", "Requests waiting to be scheduled."),
    "kv_cache_usage": ("asyncexec_kv_cache_usage_ratio", "Share of usable KV-cache blocks in use (0-1)."),
    "num_free_blocks": ("asyncexec_kv_cache_free_blocks", "Free KV-cache blocks."),
    "num_blocks": ("asyncexec_kv_cache_blocks", "Usable KV-cache blocks."),
    "prefix_cache_hit_rate": (
        "asyncexec_prefix_cache_hit_rate",
        "Prompt tokens found in the prefix cache per token looked up (0-1).",
    ),
}
_COUNTERS = {
    "prefix_cache_queries": (
        "asyncexec_prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
    ),
    "prefix_cache_hits": ("asyncexec_prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "num_preemptions": ("asyncexec_num_preemptions", "Requests preempted for recompute."),
}
# Speculative decoding (vLLM's `spec_decode` names), present where `speculative_config` is set.
_SPEC_GAUGES = {
    "spec_decode_acceptance_rate": (
        "asyncexec_spec_decode_acceptance_rate",
        "Accepted draft tokens per draft token proposed, since start (0-1).",
    ),
    "spec_decode_mean_acceptance_length": (
        "asyncexec_spec_decode_mean_acceptance_length",
        "Tokens a request's verify step produced on average, since start: 1 + accepted drafts.",
    ),
}
_SPEC_COUNTERS = {
    "spec_decode_num_drafts": ("asyncexec_spec_decode_num_drafts", "Verify steps of a request (drafts)."),
    "spec_decode_num_draft_tokens": ("asyncexec_spec_decode_num_draft_tokens", "Draft tokens proposed."),
    "spec_decode_num_accepted_tokens": (
        "asyncexec_spec_decode_num_accepted_tokens",
        "Draft tokens accepted.",
    ),
}
SPEC_POS_KEY = "spec_decode_num_accepted_tokens_pos_"  # + the draft position, in `stats()`


class EngineMetrics:
    """The engine's counters and histograms, plus a collector over its live state."""

    def __init__(self, stats: Callable[[], dict[str, float]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests_finished = Counter(
            "asyncexec_requests_finished",
            "Finished requests by finish reason.",
            ["finish_reason"],
            registry=r,
        )
        for reason in FINISH_REASONS:
            self.requests_finished.labels(reason)
        self.prompt_tokens = Counter(
            "asyncexec_prompt_tokens", "Prompt tokens of accepted requests.", registry=r
        )
        self.generation_tokens = Counter("asyncexec_generation_tokens", "Generated tokens.", registry=r)

        def seconds(name: str, doc: str) -> Histogram:
            return Histogram(f"asyncexec_{name}_seconds", doc, buckets=_LATENCY_BUCKETS, registry=r)

        self.time_to_first_token = seconds(
            "time_to_first_token", "From add_request to the first generated token."
        )
        self.inter_token_latency = seconds(
            "inter_token_latency", "Between consecutive generated tokens of a request."
        )
        self.step_time = seconds("step_time", "One engine step, schedule to outputs.")
        self.restart_time = seconds(
            "worker_restart", "From a worker's death to the replacement executor's readiness."
        )
        self.worker_restarts = Counter(
            "asyncexec_worker_restarts", "Executor restarts after a worker died.", registry=r
        )
        r.register(_StateCollector(stats))

    def on_finished(self, reason: str, count: int = 1) -> None:
        self.requests_finished.labels(reason).inc(count)

    def on_step(self, seconds: float, progressed: Iterable[tuple[Request, list[int]]]) -> None:
        """Record a step's duration, and the tokens, latencies and finishes of what progressed in it."""
        self.step_time.observe(seconds)
        now = time.monotonic()
        n = 0
        for req, toks in progressed:
            n += len(toks)
            if req.first_token_time is None:
                req.first_token_time = now
                self.time_to_first_token.observe(now - req.arrival_time)
            else:
                self.inter_token_latency.observe((now - req.last_token_time) / len(toks))
            req.last_token_time = now
            if req.finish_reason is not None:
                self.requests_finished.labels(req.finish_reason).inc()
        self.generation_tokens.inc(n)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class _StateCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, float]]) -> None:
        self._stats = stats

    def describe(self) -> Iterable[Metric]:
        return []  # unchecked: the state is only known once the engine runs

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._stats()
        except ExecutorClosedError:  # not started yet: nothing to report
            return
        for key, (name, doc) in _GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=stats[key])
        for key, (name, doc) in _COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=stats[key])
        if "spec_decode_num_drafts" not in stats:
            return
        for key, (name, doc) in _SPEC_GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=stats[key])
        for key, (name, doc) in _SPEC_COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=stats[key])
        per_pos = CounterMetricFamily(
            "asyncexec_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position in the draft (0 first).",
            labels=["position"],
        )
        for key, value in stats.items():
            if key.startswith(SPEC_POS_KEY):
                per_pos.add_metric([key[len(SPEC_POS_KEY) :]], value)
        yield per_pos
