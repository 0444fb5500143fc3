"""Prometheus metrics of one server: what the engine holds now, and what it has served.

Each app has its own CollectorRegistry (no process-global state), so two servers in one process, or
one per test, count separately. Gauges of the engine's state are read when scraped; counters and
histograms are fed by the stepping thread as outputs come out.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

FINISH_REASONS = ("stop", "length", "abort", "error")
# Seconds: from a few milliseconds per token on an accelerator to seconds for a long queue.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine, window: float = 10.0):
        self.registry = r = CollectorRegistry()
        self.window = window  # seconds of recent steps behind the tokens/s gauge
        blocks = engine.blocks
        Gauge("fivefold_requests_running", "Requests in the running batch", registry=r).set_function(
            lambda: engine.num_running)
        Gauge("fivefold_requests_waiting", "Requests queued for admission", registry=r).set_function(
            lambda: engine.num_waiting)
        Gauge("fivefold_kv_blocks_used", "KV cache blocks held by requests", registry=r).set_function(
            lambda: blocks.num_used)
        Gauge("fivefold_kv_cache_usage_ratio", "Fraction of the KV cache blocks held by requests",
              registry=r).set_function(lambda: blocks.num_used / blocks.num_blocks)
        Gauge("fivefold_prefix_cache_hit_rate", "Fraction of looked-up prompt tokens found in the prefix cache",
              registry=r).set_function(lambda: blocks.hit_rate)
        Gauge("fivefold_generation_tokens_per_second", f"Tokens generated per second over the last {window:g} s",
              registry=r).set_function(self.tokens_per_second)
        self.prompt_tokens = Counter("fivefold_prompt_tokens", "Prompt tokens of requests that started generating",
                                     registry=r)
        self.generation_tokens = Counter("fivefold_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("fivefold_requests_finished", "Requests ended, by reason", ["reason"], registry=r)
        for reason in FINISH_REASONS:  # present at 0 from the start, so rates work from the first scrape
            self.finished.labels(reason)
        self.ttft = Histogram("fivefold_time_to_first_token_seconds", "From arrival to the first output token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("fivefold_time_per_output_token_seconds", "Mean time per output token after the first",
                              buckets=TPOT_BUCKETS, registry=r)
        self.recent: deque[tuple[float, int]] = deque()  # (time, tokens) per step
        self.lock = threading.Lock()  # the stepping thread appends while a scrape reads

    def record_step(self, outputs) -> None:
        """The outputs of one engine step: each carries exactly one new token."""
        now = time.monotonic()
        for out in outputs:
            if len(out.token_ids) == 1:
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                if out.ttft is not None:
                    self.ttft.observe(out.ttft)
            if out.finished:
                self.finished.labels(out.finish_reason).inc()
                if out.tpot is not None:
                    self.tpot.observe(out.tpot)
        self.generation_tokens.inc(len(outputs))
        with self.lock:
            self.recent.append((now, len(outputs)))
            while self.recent and self.recent[0][0] < now - self.window:
                self.recent.popleft()

    def record_end(self, reason: str) -> None:
        """A request that ended without a final output: aborted by its client, or failed by an error."""
        self.finished.labels(reason).inc()

    def tokens_per_second(self) -> float:
        since = time.monotonic() - self.window
        with self.lock:
            return sum(n for t, n in self.recent if t >= since) / self.window

    def render(self) -> bytes:
        return generate_latest(self.registry)
