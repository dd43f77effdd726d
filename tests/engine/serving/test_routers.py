"""Two `kiln serve` replicas behind vllm-router and behind SMG, each router a process of its own as a user would run
it (pip install vllm-router smg): the openai client through them (streams included) gets what a replica gives
directly; cache-aware routing keeps a shared long prefix on one replica (whose prefix-cache hits count it);
vllm-router's kv_aware policy routes by Kiln's KV-cache events; SMG takes a replica for a vLLM worker and reads its
load from /metrics; a replica killed mid-load is routed around, nothing hanging."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time

import pytest

from helpers.routers import Router, get_json, installed
from helpers.server import Server, free_port

ROUTER_KINDS = [
    pytest.param(kind, marks=pytest.mark.skipif(not installed(kind), reason=f"{kind} is not installed"))
    for kind in ("vllm-router", "smg")
]
BLOCK = 16


def replica(model_dir, events: bool = False) -> Server:
    """A replica as a router's worker: no API key (the router is the door), room for 256 tokens, a small KV cache;
    with `events`, KV-cache events on a port of its own (topic "": vllm-router subscribes to that alone)."""
    extra = ["--served-model-name", "tiny", "--max-model-len", "256", "--kv-cache-memory-bytes", "50000000"]
    if events:
        port, replay = free_port(), free_port()
        config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{replay}"}
        extra += ["--kv-events-config", json.dumps(config)]
    server = Server(model_dir, *extra, auth=())
    if events:
        server.events = (f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}")
    return server


@pytest.fixture(scope="module")
def replicas(tiny_llama_dir):
    servers = []
    try:
        servers += [replica(tiny_llama_dir, events=True), replica(tiny_llama_dir, events=True)]
        yield servers
    finally:
        for server in servers:
            server.stop()


def served(server: Server) -> float:
    """Requests the replica has finished (vLLM's counter, every finish reason)."""
    return server.metric("vllm:request_success_total")


def hits(server: Server) -> float:
    return server.metric("vllm:prefix_cache_hits_total")


def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa"]) for _ in range(n))


@pytest.mark.parametrize("kind", ROUTER_KINDS)
def test_the_openai_client_through_a_router_gets_what_a_replica_gives(replicas, kind):
    router = Router(kind, [r.url for r in replicas], "round_robin")
    try:
        client, direct = router.client(), replicas[0].client()
        assert [m.id for m in client.models.list()] == ["tiny"]
        greedy = dict(model="tiny", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
        for i in range(2):  # (round robin: each replica answers one)
            want = direct.completions.create(prompt=f"Once upon a time {i}", **greedy).choices[0].text
            got = client.completions.create(prompt=f"Once upon a time {i}", **greedy).choices[0].text
            streamed = "".join(
                chunk.choices[0].text
                for chunk in client.completions.create(prompt=f"Once upon a time {i}", stream=True, **greedy)
            )
            assert got == want == streamed
        messages = [{"role": "user", "content": "Say something."}]
        want = direct.chat.completions.create(messages=messages, **greedy).choices[0].message.content
        assert client.chat.completions.create(messages=messages, **greedy).choices[0].message.content == want
        chunks = list(client.chat.completions.create(messages=messages, stream=True, **greedy))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
        assert chunks[-1].choices[0].finish_reason == "length"
    finally:
        router.stop()


@pytest.mark.parametrize("kind", ROUTER_KINDS)
def test_cache_aware_routing_keeps_a_shared_prefix_on_one_replica(replicas, kind):
    """Eight requests that share a long system prompt: the router's prefix tree sends them all to one replica, whose
    prefix cache serves the shared part of every one after the first."""
    router = Router(kind, [r.url for r in replicas], "cache_aware")
    try:
        before = [(served(r), hits(r)) for r in replicas]
        shared = words(len(kind), 30)  # (a prefix of its own for each router: some 140 tokens)
        client = router.client()
        for i in range(8):
            client.completions.create(model="tiny", prompt=f"{shared} Question {i}: {words(i, 3)}?", max_tokens=2)
        time.sleep(1.2)  # (the engines' stats come each second)
        grew = [(served(r) - s, hits(r) - h) for r, (s, h) in zip(replicas, before)]
        counts = sorted(n for n, _ in grew)
        assert counts == [0, 8], grew
        took = next(h for n, h in grew if n == 8)
        shared_tokens = json.loads(replicas[0].post("/tokenize", {"prompt": shared})[1])["count"]
        assert took >= 7 * ((shared_tokens - 1) // BLOCK * BLOCK), (grew, shared_tokens)
    finally:
        router.stop()


@pytest.mark.skipif(not installed("vllm-router"), reason="vllm-router is not installed")
def test_vllm_router_kv_aware_routes_by_kilns_kv_events(replicas):
    """vllm-router's kv_aware policy subscribes to each replica's events: a prefix one replica holds (put there
    directly, not through the router) draws the requests that share it, whichever replica that is."""
    extra = ["--kv-event-block-size", str(BLOCK), "--kv-event-model", "tiny"]
    for r in replicas:
        extra += ["--kv-event-source", f"{r.url}={r.events[0]}", "--kv-event-replay-source", f"{r.url}={r.events[1]}"]
    router = Router("vllm-router", [r.url for r in replicas], "kv_aware", *extra)
    try:
        time.sleep(1.0)  # (its subscribers connect)
        client = router.client()
        for holder in (1, 0):
            prefix = [random.Random(holder).randrange(500) for _ in range(6 * BLOCK)]
            replicas[holder].client().completions.create(model="tiny", prompt=prefix, max_tokens=1)
            time.sleep(0.5)  # (the events reach the router)
            before = [served(r) for r in replicas]
            for i in range(4):
                client.completions.create(model="tiny", prompt=prefix + [i, i + 1, i + 2], max_tokens=2)
            time.sleep(1.2)
            grew = [served(r) - b for r, b in zip(replicas, before)]
            assert grew[holder] == 4 and grew[1 - holder] == 0, (holder, grew)
    finally:
        router.stop()


@pytest.mark.skipif(not installed("smg"), reason="smg is not installed")
def test_smg_takes_a_replica_for_a_vllm_worker_and_reads_its_load(replicas):
    """SMG finds GET /version and so reads the vllm:* gauges of /metrics as each worker's load."""
    router = Router("smg", [r.url for r in replicas], "power_of_two", "--load-monitor-interval", "1")
    try:
        workers = get_json(router.url + "/workers")["workers"]
        assert {w["runtime_type"] for w in workers} == {"vllm"}
        assert {w["labels"]["served_model_name"] for w in workers} == {"tiny"}
        client = router.client()
        streams = [
            threading.Thread(
                target=lambda i=i: list(
                    client.completions.create(
                        model="tiny", prompt=f"load {i}", max_tokens=230, stream=True, extra_body={"ignore_eos": True}
                    )
                )
            )
            for i in range(16)
        ]
        for t in streams:
            t.start()
        running = 0.0
        deadline = time.monotonic() + 30
        while running == 0 and time.monotonic() < deadline and any(t.is_alive() for t in streams):
            loads = get_json(router.url + "/get_loads")["loads"]
            running = max(load["num_running_reqs"] for load in loads)
            time.sleep(0.1)
        for t in streams:
            t.join()
        assert running > 0
    finally:
        router.stop()


@pytest.mark.parametrize("kind", ROUTER_KINDS)
def test_a_replica_killed_mid_load_is_routed_around(tiny_llama_dir, kind):
    """24 requests in flight over two replicas, half of them streams; one replica is killed (SIGKILL) while it runs
    some. The router retries the plain requests that replica had, so all of them complete; a stream it had begun
    cannot be replayed and ends with an error at once; nothing hangs; what comes after goes to the live replica."""
    servers = [replica(tiny_llama_dir), replica(tiny_llama_dir)]
    router = None
    try:
        router = Router(kind, [s.url for s in servers], "round_robin")
        client = router.client(timeout=30)
        results: dict[int, tuple[str, float]] = {}

        def run(i: int) -> None:
            start = time.monotonic()
            body = dict(model="tiny", prompt=f"hello {i}", max_tokens=230, extra_body={"ignore_eos": True})
            try:
                if i % 2:
                    assert client.completions.create(**body).usage.completion_tokens == 230
                else:
                    text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **body))
                    assert text
                results[i] = ("ok", time.monotonic() - start)
            except Exception as e:  # noqa: BLE001 (what each request came to is the result)
                results[i] = (type(e).__name__, time.monotonic() - start)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(24)]
        for t in threads:
            t.start()
        victim = servers[1]
        deadline = time.monotonic() + 20
        while (running := victim.metric("vllm:num_requests_running")) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert running > 0  # (it dies with requests in hand)
        engine = victim.engine_pid()
        os.kill(victim.proc.pid, signal.SIGKILL)
        os.kill(engine, signal.SIGKILL)
        for t in threads:
            t.join(60)
        assert not [t for t in threads if t.is_alive()], "a request hung"
        failed = {i: r for i, r in results.items() if r[0] != "ok"}
        assert all(i % 2 == 0 for i in failed), f"a plain request was lost: {failed}"  # (only cut streams fail)
        assert all(seconds < 10 for _, seconds in failed.values()), failed
        assert len(failed) <= 12
        # from now on the live replica serves everything
        after = [threading.Thread(target=run, args=(100 + i,)) for i in range(6)]
        for t in after:
            t.start()
        for t in after:
            t.join(60)
        assert all(results[100 + i][0] == "ok" for i in range(6)), results
    finally:
        if router is not None:
            router.stop()
        for server in servers:
            server.stop()
