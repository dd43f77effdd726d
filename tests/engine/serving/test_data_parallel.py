"""`kiln serve --data-parallel-size 2` on the CPU: both engine cores serve, the outputs are one engine's, a long
shared prefix stays on one core, and a core that is killed is reported while the other serves on. The placement
itself is checked without processes first."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time

import pytest

from kiln.engine import LLM, SamplingParams
from kiln.engine.serving.data_parallel import AFFINITY_SLACK, DataParallelClient, PrefixAffinity

from helpers.server import GREEDY, Server

# ---- placement, without processes --------------------------------------------------------------------------


class FakeCore:
    def __init__(self) -> None:
        self.alive, self.death, self.stats, self.added = True, None, {}, []

    def add_request(self, request_id, prompt_token_ids, params, q=None):
        self.added.append(request_id)
        return q

    def release(self, request_id):
        pass


def cores(n: int, block_size: int = 4) -> DataParallelClient:
    client = DataParallelClient.__new__(DataParallelClient)
    client.size, client.engines = n, [FakeCore() for _ in range(n)]
    client.affinity, client.engine_of, client.in_hand = PrefixAffinity(block_size), {}, [0] * n
    return client


def test_new_prompts_go_to_the_least_loaded_core():
    client = cores(3)
    for i in range(9):
        client.add_request(f"r{i}", [100 * i + t for t in range(10)], {})
    assert client.in_hand == [3, 3, 3]
    for i in range(3):
        client.release(f"r{i}")  # r0, r1, r2: one from each core
    client.add_request("next", [7, 7, 7, 7, 7], {})
    assert sum(client.in_hand) == 7


def test_a_shared_prefix_stays_on_its_core_until_that_core_is_too_busy():
    client = cores(2)
    shared = list(range(40))
    client.add_request("first", shared + [1], {})
    home = client.engine_index("first")
    for i in range(AFFINITY_SLACK):
        client.add_request(f"same{i}", shared + [2, i], {})
        assert client.engine_index(f"same{i}") == home
    client.add_request("overflow", shared + [3], {})  # home has AFFINITY_SLACK + 1 more than the other
    assert client.engine_index("overflow") == 1 - home
    # a prompt shorter than a block has no prefix to follow: least loaded
    client.add_request("short", [1, 2], {})
    assert client.engine_index("short") == 1 - home


def test_a_dead_core_gets_nothing_and_is_named():
    client = cores(2)
    client.engines[1].alive, client.engines[1].death = False, "the engine core process was killed by signal 9"
    for i in range(4):
        client.add_request(f"r{i}", [i] * 8, {})
    assert client.engines[1].added == [] and client.alive
    assert client.death == "engine core 1 of 2: the engine core process was killed by signal 9"
    client.engines[0].alive = False
    assert not client.alive


def test_each_core_gets_its_own_gpus(monkeypatch):
    from kiln.engine.serving.data_parallel import visible_devices

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [visible_devices(r, 2) for r in range(2)] == ["0,1", "2,3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    assert visible_devices(1, 1) == "5"
    with pytest.raises(ValueError, match="too few"):
        visible_devices(1, 2)


def test_offline_llm_refuses_data_parallelism(tiny_llama_dir):
    with pytest.raises(ValueError, match="kiln serve"):
        LLM(str(tiny_llama_dir), data_parallel_size=2)


# ---- a real server ---------------------------------------------------------------------------------------------


def engine_cores(server: Server) -> list[int]:
    """The server's engine-core processes, in the order they were started (rank 0 first)."""
    out = subprocess.run(
        ["pgrep", "-P", str(server.proc.pid), "-f", "kiln.engine.core"], capture_output=True, text=True
    )
    return sorted(int(pid) for pid in out.stdout.split())


def per_engine(server: Server, name: str) -> dict[str, float]:
    text = server.get("/metrics")[1].decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            engine = re.search(r'engine="(\d+)"', line).group(1)
            found[engine] = found.get(engine, 0.0) + float(line.split()[-1])
    return found


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    server = Server(tiny_llama_dir, "--data-parallel-size", "2", "--kv-cache-memory-bytes", "50000000")
    yield server
    server.stop()


def test_both_cores_serve_and_the_outputs_are_one_engines(server, tiny_llama_dir):
    prompts = [[(17 * i + 3 * t) % 500 for t in range(12 + i)] for i in range(8)]
    llm = LLM(str(tiny_llama_dir), enforce_eager=True, max_model_len=128)
    want = [
        o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    ]
    assert len(engine_cores(server)) == 2
    client, got = server.client(), [None] * len(prompts)

    def run(i: int) -> None:
        got[i] = client.completions.create(model=server.model, prompt=prompts[i], **GREEDY).choices[0].text

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want
    served = per_engine(server, "vllm:request_success_total")
    assert served["0"] > 0 and served["1"] > 0 and served["0"] + served["1"] >= len(prompts)


def test_a_long_shared_prefix_stays_on_one_core(server):
    shared = [(7 * t) % 500 for t in range(64)]  # four blocks
    before = per_engine(server, "vllm:request_success_total")
    hits_before = per_engine(server, "vllm:prefix_cache_hits_total")
    client = server.client()
    for i in range(5):
        client.completions.create(model=server.model, prompt=shared + [i, i + 1], max_tokens=2)
    time.sleep(1.2)  # (the cores' stats come each second)
    grew = {e: per_engine(server, "vllm:request_success_total")[e] - before[e] for e in ("0", "1")}
    assert sorted(grew.values()) == [0, 5], grew
    home = next(e for e, n in grew.items() if n == 5)
    assert per_engine(server, "vllm:prefix_cache_hits_total")[home] - hits_before[home] >= 4 * 64


def test_a_killed_core_is_reported_and_the_other_serves_on(tiny_llama_dir):
    server = Server(tiny_llama_dir, "--data-parallel-size", "2", "--kv-cache-memory-bytes", "50000000")
    try:
        client = server.client()
        results: dict[int, str] = {}

        def stream(i: int) -> None:
            body = dict(model=server.model, prompt=f"story {i}", max_tokens=110, extra_body={"ignore_eos": True})
            try:
                assert len(list(client.completions.create(stream=True, **body))) > 1
                results[i] = "ok"
            except Exception as e:  # noqa: BLE001 (what each request came to is the result)
                results[i] = type(e).__name__

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while per_engine(server, "vllm:num_requests_running").get("1", 0) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(engine_cores(server)[1], signal.SIGKILL)  # (while it runs requests)
        for t in threads:
            t.join(30)
        assert not [t for t in threads if t.is_alive()], "a request hung"
        assert 0 < list(results.values()).count("ok") < 6, results  # the live core's finished, the dead one's ended
        status, body = server.get("/health", key=None)
        assert status == 503
        reason = json.loads(body)["reason"]
        assert re.fullmatch(r"engine core [01] of 2: the engine core process was killed by signal 9", reason), reason
        for i in range(3):  # new requests go to the live core
            assert client.completions.create(model=server.model, prompt=f"after {i}", max_tokens=4).choices[0].text
    finally:
        server.stop()
