"""What llm-d's scheduler and the KV-aware routers read of a vLLM worker, read off a real `kiln serve`: /metrics under
vLLM's names, types, labels and buckets (parsed with prometheus_client's own parser, checked against vLLM v0.34.0's
list in data/), values that move with load, and KV-cache events that a subscriber written from vLLM's schema can
follow: every block stored once, removals on eviction, a replay after a gap, and the same prefix hits as the
engine's."""

from __future__ import annotations

import json
import math
import random
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.kv_subscriber import KVEventSubscriber
from helpers.server import Server, free_port

EXPECTED = json.loads((Path(__file__).parent / "data" / "vllm_metrics_v0.34.0.json").read_text())
BLOCK = 16


def families(server: Server) -> dict:
    status, body = server.get("/metrics", key=None)
    assert status == 200
    return {family.name: family for family in text_string_to_metric_families(body.decode())}


def value(found: dict, name: str, sample: str | None = None, **labels: str) -> float:
    """The sum of `name`'s samples (`sample`: e.g. its _count) whose labels include `labels`."""
    sample = sample or name
    return sum(
        s.value
        for s in found[name].samples
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    )


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    server = Server(tiny_llama_dir, "--served-model-name", "tiny")
    yield server
    server.stop()


def test_every_vllm_metric_has_its_type_labels_and_buckets(server):
    found = families(server)
    for name, spec in EXPECTED["metrics"].items():
        assert name in found, name
        family = found[name]
        assert family.type == spec["type"], name
        assert family.samples, name
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            if "only_labels" in spec:
                assert set(sample.labels) == set(spec["only_labels"]), name
            else:
                wanted = {
                    *EXPECTED["labels"],
                    *spec.get("extra_labels", ()),
                    *(("le",) if "_bucket" in sample.name else ()),
                }
                assert set(sample.labels) == wanted, (name, sample)
                assert (sample.labels["model_name"], sample.labels["engine"]) == ("tiny", "0")
        if spec["type"] == "histogram":
            edges = sorted({float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")})
            buckets = spec.get("buckets") or [1, 2, 5, 10, 20, 50, 100]  # (1-2-5 up to --max-model-len 128)
            assert edges == [*buckets, math.inf], name
        if "finished_reason" in spec:
            reasons = {s.labels["finished_reason"] for s in family.samples if s.name == name + "_total"}
            assert reasons == set(spec["finished_reason"])
    info = next(s for s in found["vllm:cache_config_info"].samples)
    assert info.value == 1
    assert (info.labels["block_size"], info.labels["enable_prefix_caching"], info.labels["engine"]) == (
        "16",
        "True",
        "0",
    )
    assert int(info.labels["num_gpu_blocks"]) > 0 and info.labels["num_cpu_blocks"] == "None"


def test_the_values_move_with_load_and_come_back(server):
    before = families(server)
    client = server.client()
    num_requests, max_tokens = 6, 48
    prompts = [[random.Random(i).randrange(512) for _ in range(20)] for i in range(num_requests)]
    seen = {"running": 0.0, "kv": 0.0}

    def scrape() -> None:
        while not done.is_set():
            found = families(server)
            seen["running"] = max(seen["running"], value(found, "vllm:num_requests_running"))
            seen["kv"] = max(seen["kv"], value(found, "vllm:kv_cache_usage_perc"))
            time.sleep(0.02)

    def stream(prompt: list[int]) -> None:
        for _ in client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            pass

    done = threading.Event()
    scraper = threading.Thread(target=scrape)
    scraper.start()
    workers = [threading.Thread(target=stream, args=(p,)) for p in prompts]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    done.set()
    scraper.join()
    assert seen["running"] >= 2 and seen["kv"] > 0  # (requests ran side by side and held blocks)

    time.sleep(1.5)  # the engine's stats come at least each second
    after = families(server)
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert value(after, gauge) == 0, gauge

    def grew(name: str, sample: str | None = None, **labels: str) -> float:
        return value(after, name, sample, **labels) - value(before, name, sample, **labels)

    assert grew("vllm:prompt_tokens", "vllm:prompt_tokens_total") == 20 * num_requests
    assert grew("vllm:generation_tokens", "vllm:generation_tokens_total") == max_tokens * num_requests
    assert grew("vllm:request_success", "vllm:request_success_total", finished_reason="length") == num_requests
    assert grew("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == 20 * num_requests
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_time_per_output_token_seconds"):
        assert grew(f"vllm:{name}", f"vllm:{name}_count") == num_requests, name
    assert grew("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") == num_requests * (
        max_tokens - 1
    )
    assert grew("vllm:request_prompt_tokens", "vllm:request_prompt_tokens_sum") == 20 * num_requests
    # the same prompt again: its first block comes from the prefix cache
    client.completions.create(model="tiny", prompt=prompts[0], max_tokens=1)
    time.sleep(1.5)
    assert (
        value(families(server), "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")
        - value(after, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")
        == BLOCK
    )


@pytest.mark.parametrize("layout", ["map", "array"])
def test_kv_events_follow_the_prefix_cache(tiny_llama_dir, layout):
    """Twelve blocks (eleven usable): prompts of three blocks' worth evict each other. A subscriber from the start and
    one that joins late (replaying what it missed) agree, every stored block is stored once until removed, and what
    they say is cached is what the engine hits."""
    port, replay = free_port(), free_port()
    topic = "kv@127.0.0.1@tiny"
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://*:{replay}",
        "topic": topic,
        "layout": layout,
    }
    server = Server(
        tiny_llama_dir, "--served-model-name", "tiny", "--num-kv-blocks", "12", "--kv-events-config", json.dumps(events)
    )
    early = KVEventSubscriber(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}", topic)
    late = None
    try:
        early.poll(0.5)  # (subscribed before the first batch)
        client = server.client()
        prompts = [[random.Random(100 + i).randrange(512) for _ in range(40)] for i in range(8)]
        for i, prompt in enumerate(prompts):
            client.completions.create(model="tiny", prompt=prompt, max_tokens=8, extra_body={"ignore_eos": True})
            early.poll(0.3)
            if i == 3:
                late = KVEventSubscriber(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}", topic)
                late.poll(0.3)
        early.poll(0.5)
        late.poll(0.5)
        assert late.replayed and late.replayed[0] == 0  # it missed the first batches and asked for them
        assert late.live == early.live and late.next_seq == early.next_seq
        assert early.layouts == {layout}
        assert early.removed, "eleven blocks cannot hold 8 prompts of three blocks: some were evicted"
        assert all(count >= 1 for count in early.stored_count.values())
        # what the subscriber says is cached is what the engine hits, prompt by prompt (oldest evicted first)
        for prompt in (prompts[-1], prompts[0]):
            expected = early.cached_prefix_tokens(prompt, BLOCK)
            hits = server.metric("vllm:prefix_cache_hits_total")
            client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
            time.sleep(1.2)
            assert server.metric("vllm:prefix_cache_hits_total") - hits == expected
            early.poll(0.3)
        assert early.cached_prefix_tokens(prompts[-1], BLOCK) == 32
    finally:
        early.close()
        if late is not None:
            late.close()
        server.stop()


def test_a_taken_event_port_fails_the_start_in_a_line(tiny_llama_dir):
    port = free_port()
    events = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})
    first = Server(tiny_llama_dir, "--kv-events-config", events)
    try:
        with pytest.raises(RuntimeError, match="cannot open"):
            Server(tiny_llama_dir, "--kv-events-config", events)
    finally:
        first.stop()


def test_a_wrong_kv_events_config_is_refused_before_start(tiny_llama_dir):
    with pytest.raises(RuntimeError, match="unknown keys"):
        Server(tiny_llama_dir, "--kv-events-config", '{"enable_kv_cache_events": true, "port": 1}')
