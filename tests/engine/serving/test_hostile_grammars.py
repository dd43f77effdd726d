"""Constrained output under attack, on a real server: compiled grammars cost the engine core at most the bytes
--xgrammar-cache-mb says, however many large schemas come, and slow schemas neither make another user's small one
wait nor keep compiling once their requests are gone."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers.server import API_KEY, Server

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
    # the cache's bound, and what its three grammar threads may hold while reading grammars back (each at most a
    # quarter of the bound): the allocator keeps some of that (without the bound: 1,158 MiB)
    assert grown <= (CACHE_MB + 3 * CACHE_MB // 4) << 20, f"the engine core grew by {grown / 2**20:.0f} MiB"
    assert server.engine_pid() == engine
    assert server.post("/v1/chat/completions", {"messages": HI, "max_tokens": 2})[0] == 200
    assert constrained(server, optional_properties(3, "a"))[0] == 200  # a cached grammar still serves


def slow_to_compile(tag: int) -> dict:
    """25 KB that the API server's check parses in milliseconds and the engine's compile process takes 20 s or more
    over (compiling and writing out a grammar of several hundred MiB), with the tiny tokenizer."""
    item = {"type": "string", "pattern": "^[a-z]{3,9}$"}
    return {"type": "object", "properties": {f"t{tag}_{i}": {"type": "array", "items": item} for i in range(300)}}


def helpers_cpu_seconds(server: Server) -> float:
    """CPU time of the server's helper processes alive now (constraint checks, grammar compiles), all but the
    engine core."""
    total = 0.0
    for pid in set(server.descendants()) - {server.engine_pid()}:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def attack(server: Server, schemas: list[dict], give_up_s: float) -> list[threading.Thread]:
    """One request a schema, each giving up after `give_up_s` (its connection closes and its request is aborted)."""

    def send(schema: dict) -> None:
        payload = json.dumps({"messages": HI, "max_tokens": 2, "response_format": json_schema(schema)}).encode()
        request = urllib.request.Request(server.url + "/v1/chat/completions", payload, method="POST")
        request.add_header("Content-Type", "application/json")
        request.add_header("Authorization", f"Bearer {API_KEY}")
        with contextlib.suppress(OSError):
            urllib.request.urlopen(request, timeout=give_up_s).read()

    threads = [threading.Thread(target=send, args=(schema,)) for schema in schemas]
    for thread in threads:
        thread.start()
    return threads


def assert_quick_schema_served_beside(server: Server, attackers: list[threading.Thread]) -> None:
    """A one-property schema sent while the attack runs is answered within seconds; once the attackers are gone,
    no helper process goes on working for them, and the engine serves."""
    engine = server.engine_pid()
    time.sleep(1)
    start = time.monotonic()
    status, answer = constrained(
        server, {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    )
    waited = time.monotonic() - start
    assert status == 200, answer
    assert waited < 10, f"the one-property schema waited {waited:.1f} s behind the slow ones"
    for thread in attackers:
        thread.join()
    # the aborts reach the engine, each compile's process is killed within 0.05 s of its request's going, and the
    # check workers started in place of killed ones finish starting: then the helpers sit idle
    settled_by = time.monotonic() + 6
    while True:
        used = helpers_cpu_seconds(server)
        time.sleep(1)
        if helpers_cpu_seconds(server) - used < 0.15:
            break
        assert time.monotonic() < settled_by, "checks or compiles went on after their requests had gone"
    assert server.engine_pid() == engine
    assert server.post("/v1/chat/completions", {"messages": HI, "max_tokens": 2})[0] == 200


def warm_up(server: Server) -> None:
    """Three quick constraints at once: both general check workers and the first-try one started (a start takes
    seconds on two busy cores), and the engine's compile processes."""
    with ThreadPoolExecutor(3) as pool:
        schemas = [{"type": "object", "properties": {f"w{i}": {"type": "integer"}}} for i in range(3)]
        assert {status for status, _ in pool.map(lambda schema: constrained(server, schema), schemas)} == {200}


def slow_to_parse(tag: int) -> dict:
    """Under 300 bytes, and a minute or more of xgrammar's parse (strings of bounded length inside an object grow
    its work with the bound; the API server's check runs it)."""
    return {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "maxLength": 8000 + 10 * tag + i} for i in range(3)},
    }


def test_slow_checks_neither_hold_up_a_small_one_nor_outlive_their_requests(server):
    warm_up(server)
    assert_quick_schema_served_beside(server, attack(server, [slow_to_parse(tag) for tag in range(6)], 4))


def test_slow_compiles_neither_hold_up_a_small_one_nor_outlive_their_requests(server):
    warm_up(server)
    assert_quick_schema_served_beside(server, attack(server, [slow_to_compile(tag) for tag in range(6)], 4))


def test_checks_past_the_shared_capacity_are_a_429_not_a_5xx(server):
    """Six minute-long parses at once hold the two general check workers and the first-try one through the 10 s a
    check may wait: those that find no worker are told to come back later (429, Retry-After, an OpenAI error
    object), the others time out (400); the server itself is well, so nothing is a 5xx."""
    warm_up(server)

    def send(schema: dict) -> tuple[int, str | None, dict]:
        payload = json.dumps({"messages": HI, "max_tokens": 2, "response_format": json_schema(schema)}).encode()
        request = urllib.request.Request(server.url + "/v1/chat/completions", payload, method="POST")
        request.add_header("Content-Type", "application/json")
        request.add_header("Authorization", f"Bearer {API_KEY}")
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return r.status, r.headers.get("Retry-After"), json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, e.headers.get("Retry-After"), json.loads(e.read())

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(send, [slow_to_parse(100 + tag) for tag in range(6)]))
    statuses = sorted(status for status, _, _ in answers)
    assert set(statuses) <= {400, 429} and 429 in statuses, answers
    for status, retry_after, body in answers:
        if status == 429:
            assert int(retry_after) > 0 and body["error"]["code"] == "rate_limit_exceeded", body
            assert "busy" in body["error"]["message"]
    assert server.post("/v1/chat/completions", {"messages": HI, "max_tokens": 2})[0] == 200


def test_helper_processes_yield_the_cpu(server):
    """Every constraint check and grammar compile process runs at nice 10, a compile process from its first line (its
    imports take ~4 s of CPU, and one replaces each cancelled compile), and so do the engine core's threads that
    read compiled grammars back: their floods slow each other, not the server or the engine's loop."""
    with ThreadPoolExecutor(3) as pool:  # (constraints not seen before: checked and compiled anew)
        schemas = [{"type": "object", "properties": {f"y{i}": {"type": "integer"}}} for i in range(3)]
        assert {status for status, _ in pool.map(lambda schema: constrained(server, schema), schemas)} == {200}
    deadline = time.monotonic() + 20
    while True:  # (a check worker just started, the first-try lane's spare, sets its nice once it has imported)
        helpers = {}
        for pid in set(server.descendants()) - {server.engine_pid()}:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
                with open(f"/proc/{pid}/stat") as f:
                    nice = int(f.read().rsplit(")", 1)[1].split()[16])
            except OSError:
                continue
            if b"compile_worker" in cmdline or b"spawn_main" in cmdline:
                helpers[pid] = (nice, b"compile_worker" in cmdline)
        kinds = {compiles for _, compiles in helpers.values()}
        if kinds == {True, False} and all(nice == 10 for nice, _ in helpers.values()):
            break
        assert time.monotonic() < deadline, helpers
        time.sleep(0.5)
    # in the engine core, the threads that read compiled grammars back (seconds of CPU for a large one) run at nice
    # 10 too, its loop at 0
    engine = server.engine_pid()
    nices = {}
    for tid in os.listdir(f"/proc/{engine}/task"):
        with open(f"/proc/{engine}/task/{tid}/stat") as f:
            nices[int(tid)] = int(f.read().rsplit(")", 1)[1].split()[16])
    assert nices[engine] == 0 and sum(nice == 10 for nice in nices.values()) == 3, nices
