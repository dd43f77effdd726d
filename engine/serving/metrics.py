"""Prometheus metrics of the API server: engine gauges (read from the engine's latest stats at scrape
time), token counters, latency histograms, and per-API-key usage (`--api-keys-file`). Kiln's names (kiln_*) and,
beside them, vLLM's (`vllm_metrics`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kiln.engine.config import EngineConfig
from kiln.engine.messages import Ready
from kiln.engine.serving.vllm_metrics import VllmMetrics

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)


class ServerMetrics:
    def __init__(self, model_name: str, num_engines: int = 1) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"kiln_{name}", doc, labels, registry=r)

        self.engine_alive = gauge("engine_alive", "1 while the engine core runs; 0 once it has died")
        self.running = gauge("num_requests_running", "Requests in the running batch")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1)")
        self.free_blocks = gauge("kv_cache_free_blocks", "Free KV-cache blocks (cached-but-unused included)")
        self.hit_rate = gauge("prefix_cache_hit_rate", "Prefix-cache hit rate over all lookups, in tokens")
        self.preemptions = gauge("num_preemptions", "Requests preempted since start")
        # Counted by the engine itself: a request the API server rejects never moves them.
        self.prefix_queries = gauge("prefix_cache_queries", "Prompt tokens the engine looked up in the prefix cache")
        self.prefix_hits = gauge("prefix_cache_hits", "Prompt tokens the engine found in the prefix cache")
        self.prompt_tokens = Counter("kiln_prompt_tokens", "Prompt tokens received", labels, registry=r)
        # speculative decoding, under Kiln's names (totals since start) and vLLM's (counters a router reads)
        self.spec = {
            key: (gauge(name, doc), Counter(f"vllm:{name}", doc, labels, registry=r))
            for key, name, doc in (
                ("spec_drafts", "spec_decode_num_drafts", "Request-steps that verified draft tokens"),
                ("spec_draft_tokens", "spec_decode_num_draft_tokens", "Draft tokens verified"),
                ("spec_accepted_tokens", "spec_decode_num_accepted_tokens", "Draft tokens the model kept"),
            )
        }
        self.spec_acceptance = gauge("spec_decode_acceptance_rate", "Draft tokens kept over those verified (0-1)")
        self.spec_mean_length = gauge(
            "spec_decode_mean_accepted_length", "Tokens a verifying request-step yields on average (1 + kept drafts)"
        )
        self._spec_counted = dict.fromkeys(self.spec, 0)
        self.generation_tokens = Counter("kiln_generation_tokens", "Tokens generated", labels, registry=r)
        self.requests = Counter("kiln_requests", "Requests finished", labels, registry=r)
        self.ttft = Histogram(
            "kiln_time_to_first_token_seconds", "Time to first token", labels, buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "kiln_inter_token_latency_seconds",
            "Time between output tokens",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "kiln_e2e_request_latency_seconds",
            "Request latency, end to end",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.model_info = Gauge(
            "kiln_model_config_info",
            "1, labelled with how the engine runs the model (its quantization: 'none', or FP8 and its format)",
            [*labels, "quantization"],
            registry=r,
        )
        self.model = model_name
        self._itl = self.itl.labels(model_name)  # observed for every token: look its child up once
        self.vllm = VllmMetrics(r, model_name, range(num_engines))

    def engine_started(self, ready: Ready, config: EngineConfig) -> None:
        self.model_info.labels(self.model, ready.startup_stats.get("quantization") or "none").set(1)
        # vLLM's CacheConfig labels that Kiln has, its values as vLLM writes them (str of the Python value)
        cache_info = {
            "block_size": config.block_size,
            "cache_dtype": config.kv_cache_dtype,
            "enable_prefix_caching": config.enable_prefix_caching,
            "gpu_memory_utilization": config.gpu_memory_utilization,
            "kv_cache_memory_bytes": config.kv_cache_memory_bytes,
            "kv_cache_size_tokens": ready.startup_stats.get("kv_cache_tokens"),
            "num_cpu_blocks": None,
            "num_gpu_blocks": ready.num_kv_blocks,
            "prefix_caching_hash_algo": "sha256",
        }
        self.vllm.engine_started(cache_info, ready.max_model_len)

    def request_started(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.labels(self.model).inc(num_prompt_tokens)

    def inter_token(self, seconds: float, num_tokens: int, engine: int = 0) -> None:
        # Merged outputs (several tokens in one message) share the gap evenly.
        for _ in range(num_tokens):
            self._itl.observe(seconds / num_tokens)
        self.vllm.inter_token(seconds, num_tokens, engine)

    def request_finished(self, seconds: float, choices: Iterable[Any]) -> None:
        self.requests.labels(self.model).inc()
        self.e2e.labels(self.model).observe(seconds)
        for choice in choices:
            self.generation_tokens.labels(self.model).inc(len(choice.token_ids))
            if choice.first_token_time is not None:
                self.ttft.labels(self.model).observe(max(0.0, choice.first_token_time - choice.start_time))
        self.vllm.request_finished(seconds, choices)

    def render(
        self, stats: dict[str, float], engine_alive: bool = True, engine_stats: dict[int, dict] | None = None
    ) -> tuple[bytes, str]:
        """`stats`: all engine cores' in one; `engine_stats`: each core's (vLLM's series are per core)."""
        m = self.model
        self.engine_alive.labels(m).set(int(engine_alive))
        self.running.labels(m).set(stats.get("running", 0))
        self.waiting.labels(m).set(stats.get("waiting", 0))
        self.kv_usage.labels(m).set(stats.get("kv_usage", 0.0))
        self.free_blocks.labels(m).set(stats.get("free_blocks", 0))
        queries = stats.get("prefix_queries", 0)
        self.hit_rate.labels(m).set(stats.get("prefix_hits", 0) / queries if queries else 0.0)
        self.preemptions.labels(m).set(stats.get("preemptions", 0))
        self.prefix_queries.labels(m).set(queries)
        self.prefix_hits.labels(m).set(stats.get("prefix_hits", 0))
        for key, (total, counter) in self.spec.items():
            value = stats.get(key, 0)
            total.labels(m).set(value)
            if value > self._spec_counted[key]:  # (the counter moves by what the engine counted since)
                counter.labels(m).inc(value - self._spec_counted[key])
                self._spec_counted[key] = value
        drafts, drafted = stats.get("spec_drafts", 0), stats.get("spec_draft_tokens", 0)
        accepted = stats.get("spec_accepted_tokens", 0)
        self.spec_acceptance.labels(m).set(accepted / drafted if drafted else 0.0)
        self.spec_mean_length.labels(m).set(1.0 + accepted / drafts if drafts else 0.0)
        self.vllm.render(engine_stats if engine_stats is not None else {0: stats})
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class KeyMetrics:
    """Usage per API key, labelled by the key's name (never the key)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.requests = Counter("kiln_api_key_requests", "Requests admitted", ["key_name"], registry=r)
        self.rejected_requests = Counter(
            "kiln_api_key_rejected_requests",
            "Requests rejected by a limit of the key",
            ["key_name", "reason"],
            registry=r,
        )
        self.prompt_tokens = Counter("kiln_api_key_prompt_tokens", "Prompt tokens admitted", ["key_name"], registry=r)
        self.generation_tokens = Counter("kiln_api_key_generation_tokens", "Tokens generated", ["key_name"], registry=r)
        self.reloads = Counter(
            "kiln_api_key_file_reloads", "Reloads of the API keys file (SIGHUP)", ["outcome"], registry=r
        )
        self._reasons: set[str] = set()  # the rejection reasons seen (a limit's name each)

    def keys_loaded(self, names: Iterable[str], removed: Iterable[str] = ()) -> None:
        """A loaded key shows up at 0 before its first request; a removed key's series go, so the
        label sets stay those of the current keys however often the file changes."""
        for name in names:
            for counter in (self.requests, self.prompt_tokens, self.generation_tokens):
                counter.labels(name)
        for name in removed:
            for counter in (self.requests, self.prompt_tokens, self.generation_tokens):
                counter.remove(name)
            for reason in self._reasons:
                with contextlib.suppress(KeyError):  # only the reasons this key was rejected for exist
                    self.rejected_requests.remove(name, reason)

    def admitted(self, name: str) -> None:
        self.requests.labels(name).inc()

    def rejected(self, name: str, reason: str) -> None:
        self._reasons.add(reason)
        self.rejected_requests.labels(name, reason).inc()

    def tokens(self, name: str, num_tokens: int, prompt: bool) -> None:
        (self.prompt_tokens if prompt else self.generation_tokens).labels(name).inc(num_tokens)

    def reloaded(self, ok: bool) -> None:
        self.reloads.labels("ok" if ok else "error").inc()
