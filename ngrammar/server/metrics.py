"""Prometheus metrics for one server: a private registry, so several apps in a process stay apart.

Counters and histograms are fed as events happen (HTTP middleware, the engine loop thread);
gauges are set from the engine snapshot the loop publishes after every step. prometheus-client
objects are thread-safe, so both threads may update them.

With ``--api-server-count`` > 1 each API server process writes its values to files in
``PROMETHEUS_MULTIPROC_DIR`` (prometheus-client's multiprocess mode) and /metrics, whichever
process answers, reads them all: counters and histograms summed, the engine's gauges (the same
in every process) as the latest value, the in-flight count summed over live processes.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.multiprocess import MultiProcessCollector

if TYPE_CHECKING:
    from ngrammar.outputs import RequestOutput
    from ngrammar.server.engine_loop import EngineSnapshot

CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_ACCEPT_BUCKETS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0)


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.http_requests = Counter(
            "ngrammar_http_requests",
            "HTTP requests answered, by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.requests_finished = Counter(
            "ngrammar_requests_finished",
            "Engine requests finished, by finish reason",
            ["finish_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "ngrammar_prompt_tokens", "Prompt tokens of admitted requests", registry=r
        )
        self.generation_tokens = Counter("ngrammar_generation_tokens", "Tokens generated", registry=r)
        self.queue_depth = engine_gauge(
            "ngrammar_queue_depth", "Requests waiting for admission to the running batch", r
        )
        self.running = engine_gauge("ngrammar_num_running", "Sequences in the running batch", r)
        self.inflight = Gauge(
            "ngrammar_num_inflight",
            "Sequences accepted and not finished (bounded by max_queue)",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.kv_usage = engine_gauge("ngrammar_kv_cache_usage", "Fraction of KV cache pages in use", r)
        self.compiles = engine_gauge(
            "ngrammar_kernel_compiles",
            "Kernel compilations in the engine core since it started (its warm-up's included)",
            r,
        )
        self.prefix_queries = Counter(
            "ngrammar_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (first admissions)",
            registry=r,
        )
        self.prefix_hits = Counter(
            "ngrammar_prefix_cache_hits", "Prompt tokens whose KV the prefix cache held", registry=r
        )
        self.prefix_hit_rate = engine_gauge(
            "ngrammar_prefix_cache_hit_rate", "Prefix cache hit tokens / query tokens since start", r
        )
        self._prefix_seen = (0, 0)  # (queries, hits) already counted: the snapshot's are cumulative
        self.accept_length = Histogram(
            "ngrammar_spec_accept_length",
            "Mean tokens per verify step, per finished request",
            buckets=_ACCEPT_BUCKETS,
            registry=r,
        )
        self.step_time = Histogram(
            "ngrammar_step_seconds", "Engine step time", buckets=_STEP_BUCKETS, registry=r
        )
        self.ttft = Histogram(
            "ngrammar_time_to_first_token_seconds",
            "Time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e_latency = Histogram(
            "ngrammar_e2e_request_latency_seconds",
            "Request latency in the engine",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def observe_http(self, endpoint: str, status: int) -> None:
        self.http_requests.labels(endpoint, str(status)).inc()

    def observe_admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def observe_step(self, seconds: float | None, new_tokens: int) -> None:
        """One engine step (``seconds``: None where another API server process times it) and the
        tokens it gave this process's requests."""
        if seconds is not None:
            self.step_time.observe(seconds)
        if new_tokens:
            self.generation_tokens.inc(new_tokens)

    def observe_finished(self, out: RequestOutput) -> None:
        for completion in out.outputs:
            self.requests_finished.labels(completion.finish_reason or "unknown").inc()
        m = out.metrics
        if "ttft_s" in m:
            self.ttft.observe(m["ttft_s"])
        if "e2e_latency_s" in m:
            self.e2e_latency.observe(m["e2e_latency_s"])
        if "spec_accept_length" in m:
            self.accept_length.observe(m["spec_accept_length"])

    def set_compiles(self, count: int) -> None:
        self.compiles.set(count)

    def set_gauges(self, snap: EngineSnapshot, inflight: int, engine_counters: bool = True) -> None:
        """The engine's gauges from ``snap``; ``inflight``: this process's sequences in flight.
        ``engine_counters``: count the engine's own cumulative figures (prefix cache) here, which
        only one of several API server processes does (every one sees the same engine)."""
        self.queue_depth.set(snap.num_waiting)
        self.running.set(snap.num_running)
        self.inflight.set(inflight)
        self.kv_usage.set(snap.kv_usage)
        st = snap.stats
        if engine_counters:
            queries, hits = st.prefix_cache_query_tokens, st.prefix_cache_hit_tokens
            self.prefix_queries.inc(max(queries - self._prefix_seen[0], 0))
            self.prefix_hits.inc(max(hits - self._prefix_seen[1], 0))
            self._prefix_seen = (queries, hits)
        self.prefix_hit_rate.set(st.prefix_cache_hit_rate)

    def render(self) -> bytes:
        folder = os.environ.get(MULTIPROC_ENV)
        if not folder:
            return generate_latest(self.registry)
        every = CollectorRegistry()
        MultiProcessCollector(every, folder)
        return generate_latest(every)


MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # set by the supervisor of several API server processes


def engine_gauge(name: str, doc: str, registry: CollectorRegistry) -> Gauge:
    """A gauge of the engine's state: every API server process sets the same value."""
    return Gauge(name, doc, registry=registry, multiprocess_mode="mostrecent")
