"""`GET /metrics` of `spec-jax serve`: Prometheus' text format, written by the official
`prometheus_client` (one registry per server, so several servers in one process never mix).

What a request reports is counted when the engine ends it (every finish reason; a request of n
choices counts n, one per engine request): requests by finish reason, prompt and generated
tokens, drafted and accepted tokens per drafter, time to first token and inter-token latency
(the gap between a request's handed-out tokens, shared among the tokens that came together).
What the engine holds is read at each scrape: requests waiting (the queue) and rejected past
`--max-queued-requests`, slots in use, decode steps and the seconds the chunks took (the decode
step as served), chunks run per K (adaptive K's choices), and drafts offered and accepted per
draft position, where a collapse of acceptance shows first.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]

PREFIX = "spec_jax"
# Seconds: from a few ms (a warm step on an accelerator) to a minute (a long queue on a CPU).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    """The server's metrics. `submitted(rid)` when a request enters the engine, `observe(event)`
    for each event the engine hands out (on the engine's thread), `rejected` when the queue is
    full; `exposition()` -> (the text, its content type) for GET /metrics."""

    def __init__(self, engine: Any, drafter_label: str):
        self.registry = CollectorRegistry()
        self.drafter = drafter_label
        reg = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "Requests the engine ended, by finish reason "
                                "(a stop string or a client gone ends as cancelled)", ["finish_reason"], registry=reg)
        self.rejected = Counter(f"{PREFIX}_requests_rejected", "Requests refused with 429: the queue was full "
                                "(--max-queued-requests)", registry=reg)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of ended requests", registry=reg)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens generated for ended requests",
                                         registry=reg)
        self.drafted = Counter(f"{PREFIX}_draft_tokens", "Draft tokens proposed for ended requests", ["drafter"],
                               registry=reg)
        self.accepted = Counter(f"{PREFIX}_accepted_draft_tokens", "Draft tokens accepted for ended requests",
                                ["drafter"], registry=reg)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "From a request entering the engine to its "
                              "first token", buckets=TTFT_BUCKETS, registry=reg)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "Between a request's successive tokens",
                             buckets=ITL_BUCKETS, registry=reg)
        reg.register(_EngineCollector(engine, drafter_label))
        self._lock = threading.Lock()
        self._last_token_at: dict[int, float | None] = {}  # by request id: None until its first token
        self._submitted_at: dict[int, float] = {}

    def submitted(self, rid: int, now: float | None = None) -> None:
        with self._lock:
            self._submitted_at[rid] = time.perf_counter() if now is None else now
            self._last_token_at[rid] = None

    def observe(self, event: Any, now: float | None = None) -> None:
        """One engine event: its tokens' latencies, and on the last event the request's counts."""
        now = time.perf_counter() if now is None else now
        with self._lock:
            last = self._last_token_at.get(event.request_id)
            submitted = self._submitted_at.get(event.request_id)
            if event.new_ids and submitted is not None:
                if last is None:
                    self.ttft.observe(now - submitted)
                    rest = len(event.new_ids) - 1  # tokens that came with the first one: no gap
                    gap = 0.0
                else:
                    rest, gap = len(event.new_ids), (now - last) / len(event.new_ids)
                for _ in range(rest):
                    self.itl.observe(gap)
                self._last_token_at[event.request_id] = now
            if event.finish_reason is None:
                return
            self._last_token_at.pop(event.request_id, None)
            self._submitted_at.pop(event.request_id, None)
        self.requests.labels(event.finish_reason).inc()
        stats = event.stats
        if stats is not None:
            self.prompt_tokens.inc(stats.prompt_tokens)
            self.generation_tokens.inc(stats.completion_tokens)
            self.drafted.labels(self.drafter).inc(stats.drafted)
            self.accepted.labels(self.drafter).inc(stats.accepted)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _EngineCollector:
    """What the engine holds, read at each scrape (its counters are plain ints and dicts the
    engine thread updates; a scrape may see one chunk's counts half-added, never wrong ones)."""

    def __init__(self, engine: Any, drafter_label: str):
        self.engine, self.drafter = engine, drafter_label

    def collect(self):
        engine = self.engine
        yield GaugeMetricFamily(f"{PREFIX}_queue_depth", "Requests waiting for a slot",
                                value=len(engine.scheduler.waiting))
        yield GaugeMetricFamily(f"{PREFIX}_slots_in_use", "Slots (rows) running a request", value=engine.num_live)
        yield GaugeMetricFamily(f"{PREFIX}_slots", "Slots (rows) decoded together (--slots)", value=engine.slots)
        pages = getattr(engine, "pages", None)  # the paged KV pool (--kv-pages), None for dense caches
        if pages is not None:
            yield GaugeMetricFamily(f"{PREFIX}_kv_pages_used", "KV pages held by requests (--kv-pages)",
                                    value=pages.used)
            yield GaugeMetricFamily(f"{PREFIX}_kv_pages_free", "KV pages free in the pool", value=pages.free)
            yield CounterMetricFamily(f"{PREFIX}_prefix_cached_tokens", "Prompt tokens read from shared pages "
                                      "instead of prefilled (--prefix-caching)", value=engine.prefill_tokens_saved)
        yield CounterMetricFamily(f"{PREFIX}_decode_steps", "Verify steps the engine's chunks ran (every "
                                  "slot together)", value=getattr(engine, "decode_steps", 0))
        yield CounterMetricFamily(f"{PREFIX}_chunk_seconds", "Wall seconds from each chunk's dispatch to its "
                                  "results on the host (per decode step: divide by decode_steps)",
                                  value=getattr(engine, "chunk_seconds", 0.0))
        chunks = CounterMetricFamily(f"{PREFIX}_chunks", "Chunks of verify steps run at each K (drafts per "
                                     "step; adaptive K's choices)", labels=["k"])
        for k, count in sorted(dict(getattr(engine, "k_chunks", {})).items()):  # a copy: the engine adds to it
            chunks.add_metric([str(k)], count)
        yield chunks
        positions = getattr(engine, "positions", None)
        drafted = CounterMetricFamily(f"{PREFIX}_position_drafted", "Verify steps that drafted a token at "
                                      "this position (1 = the first draft)", labels=["drafter", "position"])
        accepted = CounterMetricFamily(f"{PREFIX}_position_accepted", "Verify steps whose draft at this "
                                       "position was accepted", labels=["drafter", "position"])
        if positions is not None:
            offered, taken = dict(positions.drafted), dict(positions.accepted)
            for i in sorted(offered):
                drafted.add_metric([self.drafter, str(i + 1)], offered[i])
                accepted.add_metric([self.drafter, str(i + 1)], taken.get(i, 0))
        yield drafted
        yield accepted
