"""Prometheus metrics with vLLM's names under a `jaxserve:` prefix.

Request-level histograms and counters are observed by the HTTP layer as tokens stream out; the
engine's own state (running/waiting requests, KV usage, prefix cache, preemptions) is read at scrape
time from the stats snapshot the engine loop publishes (`EngineLoop.stats`): the event loop never
calls into the engine, and the engine thread does no metrics work. Speculative decoding's counters
(drafts, draft tokens, accepted tokens, and accepted tokens by draft position, vLLM's `position` label
counting from 0) appear only on a server that speculates, vLLM's `lora_requests_info` only on a server
with --enable-lora.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "jaxserve:"
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class _EngineCollector:
    def __init__(self, engine_loop):
        self.engine_loop = engine_loop

    def collect(self):
        stats = self.engine_loop.stats
        gauges = {
            "num_requests_running": ("Requests in the running batch", stats["num_running"]),
            "num_requests_waiting": ("Requests waiting to be scheduled", stats["num_waiting"]),
            "kv_cache_usage_perc": ("Fraction of KV pages held by requests (0..1)", stats["kv_cache_usage"]),
            "tensor_parallel_size": ("Devices the model is split over", stats["tensor_parallel_size"]),
            "device_weight_bytes": ("Weight bytes on each device", stats["device_weight_bytes"]),
            "device_kv_cache_bytes": ("KV page bytes on each device", stats["device_kv_cache_bytes"]),
        }
        if stats.get("compilations_since_warmup") is not None:  # None: not warmed up
            gauges["compilations_since_warmup"] = ("XLA compilations since warm-up (0 when every shape hit a "
                                                   "declared bucket)", stats["compilations_since_warmup"])
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        if "quantization" in stats:  # as vLLM's *_info gauges: the value 1, the facts in the labels
            info = GaugeMetricFamily(PREFIX + "weights_info", "How the weights and KV pages are held",
                                     labels=["quantization", "kv_cache_dtype"])
            info.add_metric([stats["quantization"] or "none", stats["kv_cache_dtype"]], 1)
            yield info
        counters = {
            "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache", stats["prefix_cache_queries"]),
            "prefix_cache_hits": ("Prompt tokens found in the prefix cache", stats["prefix_cache_hits"]),
            "num_preemptions": ("Requests preempted for lack of KV pages", stats["num_preemptions"]),
            "engine_steps": ("Engine steps that ran the model", stats["num_steps"]),
            "engine_step_seconds": ("Wall time inside engine steps (busy time)", stats["step_seconds"]),
            "engine_model_seconds": ("Of the step time, building inputs, running the model and fetching "
                                     "the sampled tokens", stats["model_seconds"]),
            "engine_grammar_seconds": ("Of the step time, filling structured output's token masks",
                                       stats["phase_seconds"]["grammar"]),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        spec = stats.get("spec_decode")  # None (or, from an engine that predates it, absent): no speculation
        if spec is not None:
            yield from _spec_decode_counters(spec)
        if stats.get("lora") is not None:  # a server with --enable-lora
            yield _lora_info(stats["lora"])


def _lora_info(lora: dict) -> GaugeMetricFamily:
    """vLLM's lora_requests_info: the adapters of the running and of the waiting requests (names joined by
    commas) and max_lora in the labels; the value is the time of the snapshot, as vLLM sets it, so the
    newest series is the one with the largest value."""
    info = GaugeMetricFamily(PREFIX + "lora_requests_info", "Running stats on LoRA requests",
                             labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
    info.add_metric([",".join(lora["running_lora_adapters"]), ",".join(lora["waiting_lora_adapters"]),
                     str(lora["max_lora"])], lora["time"])
    return info


def _spec_decode_counters(spec: dict):
    """vLLM's spec_decode_* counters from `LLMEngine.get_stats()["spec_decode"]`."""
    counters = {
        "spec_decode_num_drafts": ("Sequence steps that proposed draft tokens", spec["num_drafts"]),
        "spec_decode_num_draft_tokens": ("Draft tokens proposed", spec["num_draft_tokens"]),
        "spec_decode_num_accepted_tokens": ("Draft tokens that verification accepted", spec["num_accepted_tokens"]),
    }
    for name, (doc, value) in counters.items():
        yield CounterMetricFamily(PREFIX + name, doc, value=value)
    per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted at each draft position (0: the first)", labels=["position"])
    for position, value in enumerate(spec["num_accepted_tokens_per_pos"]):
        per_pos.add_metric([str(position)], value)
    yield per_pos


class Metrics:
    def __init__(self, engine_loop):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine_loop))
        r = self.registry
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between output tokens", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request latency, arrival to finish",
                             registry=r, buckets=_LATENCY_BUCKETS)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated", registry=r)
        self.request_success = Counter(PREFIX + "request_success", "Finished requests by finish reason",
                                       ["finished_reason"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Observes one request's TTFT, inter-token latencies and end-to-end latency, timed from its arrival
    (`Request.arrival_time`, time.monotonic: the route's receipt, so tokenizing counts, as a client sees it)."""

    def __init__(self, metrics: Metrics, arrival_time: float):
        self.metrics = metrics
        self.start = self.last = arrival_time
        self.num_tokens = 0

    def tokens(self, count: int) -> None:
        if count <= 0:
            return
        now = time.monotonic()
        if self.num_tokens == 0:
            self.metrics.ttft.observe(now - self.start)
        else:
            for _ in range(count):
                self.metrics.itl.observe((now - self.last) / count)
        self.metrics.generation_tokens.inc(count)
        self.num_tokens += count
        self.last = now

    def finished(self, reason: str) -> None:
        self.metrics.e2e.observe(time.monotonic() - self.start)
        self.metrics.request_success.labels(finished_reason=reason).inc()
