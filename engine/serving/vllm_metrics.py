"""/metrics under vLLM's names, types, labels and buckets, beside Kiln's own: what llm-d's inference scheduler, SMG
and vllm-router read of a vLLM worker, and what vLLM's dashboards plot.

Names, help, labels and buckets follow vLLM v0.34.0's `PrometheusStatLogger` (vllm/v1/metrics/loggers.py, buckets
in vllm/v1/metrics/buckets.py; PyPI wheel vllm-0.34.0). Every series is labelled `model_name` (the served name) and
`engine` (the engine core's index, "0" without data parallelism), as vLLM's are. Counters are declared without
`_total`: the exposition adds it (`vllm:prompt_tokens_total`), as it does for vLLM's.

What reads them:
    llm-d's scheduler    vllm:num_requests_waiting, vllm:num_requests_running, vllm:kv_cache_usage_perc,
                         vllm:cache_config_info{block_size, num_gpu_blocks}
    SMG's load poll      vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc
vLLM's older vllm:time_per_output_token_seconds (gone from vLLM since vllm:inter_token_latency_seconds and
vllm:request_time_per_output_token_seconds replaced it) is read by none of them and is not exposed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# vllm/v1/metrics/buckets.py (v0.34.0)
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
INTER_TOKEN_LATENCY_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's FinishReason, each series made at 0


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's `build_1_2_5_buckets`, for token counts)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class VllmMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, engines: Iterable[int] = (0,)) -> None:
        self.registry = registry
        self.model = model_name
        self.engines = [str(e) for e in engines]
        labels = ["model_name", "engine"]
        r = registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"vllm:{name}", doc, labels, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"vllm:{name}", doc, [*labels, *extra], registry=r)

        def histogram(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(f"vllm:{name}", doc, labels, buckets=tuple(buckets), registry=r)

        self.running = gauge("num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter(
            "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = counter("num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self.request_success = counter(
            "request_success", "Count of successfully processed requests.", ("finished_reason",)
        )
        self.ttft = histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", TIME_TO_FIRST_TOKEN_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", INTER_TOKEN_LATENCY_BUCKETS
        )
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            INTER_TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS
        )
        self.cache_config = None  # vllm:cache_config_info, once the engine has said its blocks
        self.prompt_tokens_request = None  # the token-count histograms: their buckets go up to max_model_len
        self.generation_tokens_request = None
        per_engine = (self.running, self.waiting, self.kv_usage, self.prefix_queries, self.prefix_hits)
        per_engine += (self.preemptions, self.prompt_tokens, self.generation_tokens, self.ttft, self.itl)
        per_engine += (self.tpot, self.e2e)
        for engine in self.engines:  # every series shows (at 0) before the first request, as vLLM's do
            for metric in per_engine:
                metric.labels(self.model, engine)
            for reason in FINISH_REASONS:
                self.request_success.labels(self.model, engine, reason)
        self._itl = {engine: self.itl.labels(self.model, engine) for engine in self.engines}  # one a token
        self._counted: dict[tuple[str, str], float] = {}  # the engine totals counters have been moved up to

    def engine_started(self, cache_info: Mapping[str, Any], max_model_len: int) -> None:
        """`cache_info`: vLLM's CacheConfig labels that Kiln has (block_size, num_gpu_blocks, ...)."""
        info = {key: str(value) for key, value in cache_info.items()}
        self.cache_config = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            [*info, "engine"],
            registry=self.registry,
        )
        buckets = buckets_1_2_5(max_model_len)
        self.prompt_tokens_request = Histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            ["model_name", "engine"],
            buckets=buckets,
            registry=self.registry,
        )
        self.generation_tokens_request = Histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            ["model_name", "engine"],
            buckets=buckets,
            registry=self.registry,
        )
        for engine in self.engines:
            self.cache_config.labels(**info, engine=engine).set(1)
            self.prompt_tokens_request.labels(self.model, engine)
            self.generation_tokens_request.labels(self.model, engine)

    def inter_token(self, seconds: float, num_tokens: int, engine: int = 0) -> None:
        itl = self._itl[str(engine)]
        for _ in range(num_tokens):
            itl.observe(seconds / num_tokens)

    def request_finished(self, seconds: float, choices: Iterable[Any]) -> None:
        """Each choice is an engine request of its own, as vLLM counts them, under the core it ran on."""
        for choice in choices:
            labels = (self.model, str(choice.engine))
            self.request_success.labels(*labels, choice.finish_reason or "abort").inc()
            self.e2e.labels(*labels).observe(seconds)
            num_generated = len(choice.token_ids)
            self.generation_tokens.labels(*labels).inc(num_generated)
            if choice.first_token_time is None:  # never prefilled: aborted while waiting
                continue
            self.prompt_tokens.labels(*labels).inc(len(choice.prompt_ids))
            self.ttft.labels(*labels).observe(max(0.0, choice.first_token_time - choice.start_time))
            if self.prompt_tokens_request is not None:
                self.prompt_tokens_request.labels(*labels).observe(len(choice.prompt_ids))
                self.generation_tokens_request.labels(*labels).observe(num_generated)
            if num_generated > 1:  # the decode time over the tokens after the first (vLLM's mean TPOT)
                decode = choice.last_token_time - choice.first_token_time
                self.tpot.labels(*labels).observe(decode / (num_generated - 1))

    def render(self, engine_stats: Mapping[int, Mapping[str, float]]) -> None:
        """Gauges from each engine's latest stats; counters moved up to the engine's totals."""
        for index, stats in engine_stats.items():
            engine = str(index)
            labels = (self.model, engine)
            self.running.labels(*labels).set(stats.get("running", 0))
            self.waiting.labels(*labels).set(stats.get("waiting", 0))
            self.kv_usage.labels(*labels).set(stats.get("kv_usage", 0.0))
            for key, counter in (
                ("prefix_queries", self.prefix_queries),
                ("prefix_hits", self.prefix_hits),
                ("preemptions", self.preemptions),
            ):
                total, counted = stats.get(key, 0), self._counted.get((engine, key), 0)
                if total > counted:  # (a dead engine's stats are empty: its counters stay where they got to)
                    counter.labels(*labels).inc(total - counted)
                    self._counted[engine, key] = total
