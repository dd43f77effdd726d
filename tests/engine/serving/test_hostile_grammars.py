"""Constrained output under attack, on a real server: compiled grammars cost the engine core at most the bytes
--xgrammar-cache-mb says, however many large schemas come."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers.server import Server

CACHE_MB = 64
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    s = Server(tiny_llama_dir, "--xgrammar-cache-mb", str(CACHE_MB))
    yield s
    s.stop()


def optional_properties(count: int, tag: str) -> dict:
    """An object of `count` optional string properties: the compiled grammar grows with them (200 hold ~14 MiB in
    the engine, 600 ~117 MiB from an 18 KB schema)."""
    return {"type": "object", "properties": {f"{tag}{i}": {"type": "string"} for i in range(count)}}


def constrained(server: Server, schema: dict) -> tuple[int, dict]:
    body = {
        "messages": HI,
        "max_tokens": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    status, raw = server.post("/v1/chat/completions", body)
    return status, json.loads(raw)


def resident_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def test_compiled_grammars_stay_within_the_cache_bound(server):
    engine = server.engine_pid()
    # xgrammar loaded, the tokenizer's info built and both compile processes started: the baseline
    with ThreadPoolExecutor(2) as pool:
        assert {s for s, _ in pool.map(lambda t: constrained(server, optional_properties(3, t)), "ab")} == {200}
    before = resident_bytes(engine)
    # twelve distinct schemas of ~14 MiB compiled grammars each: more than twice the bound, four at a time
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: constrained(server, optional_properties(200, f"k{i}_")), range(12)))
    assert [status for status, _ in answers] == [200] * 12, answers
    # one grammar past a quarter of the bound is refused (it is never read into the engine)
    status, body = constrained(server, optional_properties(600, "big"))
    assert status == 400 and body["error"]["param"] == "response_format" and "MiB" in body["error"]["message"]
    grown = resident_bytes(engine) - before
    assert grown <= CACHE_MB << 20, f"the engine core grew by {grown / 2**20:.0f} MiB"
    assert server.engine_pid() == engine
    assert server.post("/v1/chat/completions", {"messages": HI, "max_tokens": 2})[0] == 200
    assert constrained(server, optional_properties(3, "a"))[0] == 200  # a cached grammar still serves
