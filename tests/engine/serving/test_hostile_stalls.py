"""Work that grows with hostile input never stalls the API server's event loop, and a stall of the server's own is
never blamed on the engine: after each attack the engine core is the same process, /health is 200 and a normal
request is answered."""

from __future__ import annotations

import gzip
import json
import os
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers.server import API_KEY, Server

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    s = Server(tiny_llama_dir)
    yield s
    s.stop()


def post_gzip(server, path: str, payload) -> tuple[int, bytes]:
    """`payload` (or the bytes of one gzipped already) sent gzipped."""
    data = payload if isinstance(payload, bytes) else gzip.compress(json.dumps(payload).encode())
    request = urllib.request.Request(server.url + path, data=data, method="POST")
    for header, value in [
        ("Content-Type", "application/json"),
        ("Authorization", f"Bearer {API_KEY}"),
        ("Content-Encoding", "gzip"),
    ]:
        request.add_header(header, value)
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class HealthProbe:
    """GET /health over and over in a thread while an attack runs: the slowest answer it got."""

    def __init__(self, server) -> None:
        self.server, self.slowest, self.done = server, 0.0, threading.Event()
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self.done.is_set():
            start = time.monotonic()
            self.server.get("/health")
            self.slowest = max(self.slowest, time.monotonic() - start)
            time.sleep(0.05)

    def __enter__(self) -> HealthProbe:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()


def assert_serving(server, engine_pid: int) -> None:
    assert server.engine_pid() == engine_pid
    assert server.get("/health")[0] == 200
    assert server.post("/v1/chat/completions", {"messages": HI, "max_tokens": 2})[0] == 200


def special_flood(eos: str) -> list[tuple[str, dict, str]]:
    """300,000 copies of the end-of-text token's text (4 MB; 8 KB gzipped) wherever a chat's text goes."""
    flood = eos * 300_000
    return [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": flood}], "max_tokens": 2}, "messages"),
        ("/tokenize", {"messages": [{"role": "user", "content": flood}]}, "messages"),
        ("/v1/responses", {"input": flood, "max_output_tokens": 2}, "input"),
        ("/v1/responses", {"instructions": flood, "input": "hi", "max_output_tokens": 2}, "input"),
    ]


@pytest.mark.parametrize("case", range(4), ids=["chat", "tokenize", "responses-input", "responses-instructions"])
def test_a_flood_of_special_token_texts_is_refused_at_once(server, tiny_llama_dir, case):
    """Every special token's text in a request is kept as plain characters: hiding 300,000 of them is linear work
    off the event loop (it once built one regular expression over them all, froze the loop for minutes, and the
    watchdog then killed a healthy engine). The prompt is far past the context: a 400 in seconds."""
    from transformers import AutoTokenizer

    path, payload, param = special_flood(AutoTokenizer.from_pretrained(tiny_llama_dir).eos_token)[case]
    engine = server.engine_pid()
    with HealthProbe(server) as probe:
        start = time.monotonic()
        code, raw = post_gzip(server, path, payload)
        took = time.monotonic() - start
    assert code == 400, raw[:300]
    error = json.loads(raw)["error"]
    assert error["param"] == param and error["code"] == "context_length_exceeded", error
    assert took < 10 and probe.slowest < 2, (took, probe.slowest)
    assert_serving(server, engine)


def test_a_stall_of_the_servers_own_loop_is_not_blamed_on_the_engine(tiny_llama_dir):
    """The event loop blocked 5 s (a test hook) against a 2 s --engine-timeout: the engine's heartbeats waited in
    the socket meanwhile, so the watchdog forgives the stall instead of killing a healthy engine."""
    server = Server(tiny_llama_dir, "--engine-timeout", "2", stall_seconds=5)
    try:
        engine = server.engine_pid()
        request = urllib.request.Request(server.url + "/tokenize", data=b'{"prompt": "hi"}', method="POST")
        request.add_header("Authorization", f"Bearer {API_KEY}")
        request.add_header("X-Test-Stall", "1")
        start = time.monotonic()
        with urllib.request.urlopen(request, timeout=60) as r:
            assert r.status == 200
        assert time.monotonic() - start >= 5  # the stall happened
        time.sleep(3)  # past the engine timeout once more: the watchdog has looked again
        assert_serving(server, engine)
    finally:
        server.stop()


BIG_BODIES = [
    ("/v1/completions", {"prompt": [1] * 5_000_000, "max_tokens": 1}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}] * 300_000, "max_tokens": 1}, "messages"),
    ("/detokenize", {"tokens": [1] * 5_000_000}, "tokens"),
]


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.parametrize("path,payload,param", BIG_BODIES, ids=["token-ids", "messages", "detokenize"])
def test_a_body_of_millions_of_items_is_parsed_and_refused_off_the_server(server, path, payload, param):
    """A 15 KB gzip body of 5 million token ids (or 300,000 messages): decoded, parsed and refused by its counts in a
    worker process (body_parsers), so the API server's interpreter never holds the millions of items (their parse
    alone took it ~0.8 s); /detokenize takes at most --max-model-len ids. Other requests wait no more than a fraction
    of a second meanwhile."""
    engine = server.engine_pid()
    payload = gzip.compress(json.dumps(payload).encode())  # (a second of this test's interpreter, the probe's too)
    post_gzip(server, path, payload)  # (the workers started)
    used = cpu_seconds(server.proc.pid)
    code, raw = post_gzip(server, path, payload)
    assert code == 400 and json.loads(raw)["error"]["param"] == param, raw[:300]
    spent = cpu_seconds(server.proc.pid) - used
    assert spent < 0.15, f"the API server spent {spent:.2f} s of CPU on the body"
    with HealthProbe(server) as probe:
        code, raw = post_gzip(server, path, payload)
    assert code == 400 and json.loads(raw)["error"]["param"] == param, raw[:300]
    assert probe.slowest < 0.3, probe.slowest
    assert_serving(server, engine)


def test_a_flood_of_large_bodies_is_a_429_past_the_parsers_queue(server):
    """Large bodies wait their turn for the parse workers; past 16 waiting, another is told to come back (429 with
    Retry-After), never a 5xx, and the server goes on serving."""
    payload = gzip.compress(json.dumps({"prompt": [1] * 5_000_000, "max_tokens": 1}).encode())
    with ThreadPoolExecutor(24) as pool:
        codes = sorted(pool.map(lambda _: post_gzip(server, "/v1/completions", payload)[0], range(24)))
    assert set(codes) <= {400, 429} and 429 in codes, codes
    assert_serving(server, server.engine_pid())


def test_prompt_logprobs_are_bounded_by_rows(tiny_llama_dir):
    """Prompts x n x prompt tokens with log-probabilities past --max-prompt-logprob-rows (here 1,000) is a 400 naming
    what asked for them (echo or prompt_logprobs), before the engine computes any; at the bound, a 200 with every
    row (255 prompts x 511 tokens at k=20 once turned 0.5 MB into 64 MB of JSON and stalled every stream 4 s)."""
    server = Server(tiny_llama_dir, "--max-prompt-logprob-rows", "1000")
    try:
        prompt = list(range(1, 101))
        for extra, param in (({"echo": True, "logprobs": 20}, "echo"), ({"prompt_logprobs": 20}, "prompt_logprobs")):
            body = {"prompt": [prompt] * 11, "max_tokens": 1, **extra}
            code, raw = server.post("/v1/completions", body)
            assert code == 400 and json.loads(raw)["error"]["param"] == param, raw[:300]
            code, raw = server.post("/v1/completions", {**body, "prompt": [prompt] * 5, "n": 2})
            assert code == 200, raw[:300]
            choices = json.loads(raw)["choices"]
            rows = [c["logprobs"]["tokens"] if param == "echo" else c["prompt_logprobs"] for c in choices]
            assert len(choices) == 10 and all(len(r) >= 100 for r in rows)
        assert server.post("/v1/chat/completions", {"messages": HI, "max_tokens": 2, "prompt_logprobs": 1})[0] == 200
    finally:
        server.stop()
