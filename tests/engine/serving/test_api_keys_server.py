"""API keys with per-key limits (`--api-keys-file`) on a real server: bursts over and under a limit, tokens charged as
they stream, a concurrency cap under parallel streams, a live SIGHUP reload, and the engine's own counter showing
rejected requests never reach it. (The token bucket and the key file on their own: test_gateway_keys.py.)"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kiln.engine.serving.api_keys import retry_after

from helpers.keys import ALICE, BOB, CAROL, DAVE, ERIN, FRANK, sha, toml_keys, write
from helpers.server import Server

GRACE = "sk-test-grace-0123456789"

# ---- a real server ----------------------------------------------------------------------------------------


LIMITS = {
    "alice": {"sha256": sha(ALICE), "requests_per_minute": 4, "max_tokens": 8},
    "bob": {"sha256": sha(BOB), "tokens_per_minute": 120},
    "carol": {"sha256": sha(CAROL), "max_concurrent_requests": 2},
    "dave": {"sha256": sha(DAVE)},
    "frank": {"sha256": sha(FRANK), "max_tokens": 8},
    "grace": {"sha256": sha(GRACE), "requests_per_minute": 2},
}


def key_file_text(limits: dict[str, dict]) -> str:
    return toml_keys(*({"name": name, **entry} for name, entry in limits.items()))


@pytest.fixture(scope="module")
def gateway(tiny_llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    write(path, key_file_text(LIMITS))
    s = Server(tiny_llama_dir, "--max-model-len", "512", auth=("--api-keys-file", str(path)))
    s.keys_path = path
    yield s
    s.stop()


def client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def metric(server: Server, name: str, **labels: str) -> float:
    text = server.get("/metrics", key=None)[1].decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


def engine_prompt_tokens(server: Server) -> float:
    """Prompt tokens the engine core itself has looked up in its prefix cache (one lookup per new request)."""
    return metric(server, "kiln_prefix_cache_queries")


def usage(server: Server, key: str) -> dict:
    code, raw = server.get("/v1/usage", key=key)
    assert code == 200, raw
    return json.loads(raw)


def rejected(call) -> openai.RateLimitError:
    with pytest.raises(openai.RateLimitError) as e:
        call()
    error = e.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "rate_limit_exceeded"
    return e.value


def test_keys_authenticate_and_usage_is_private(gateway):
    for key in (None, "wrong", sha(ALICE)):  # no key, an unknown one, a hash instead of the key
        assert gateway.get("/v1/models", key=key)[0] == 401
        assert gateway.get("/v1/usage", key=key)[0] == 401
    assert gateway.get("/health", key=None)[0] == 200 and gateway.get("/metrics", key=None)[0] == 200
    assert client(gateway, DAVE).models.list().data[0].id == gateway.model
    mine = usage(gateway, ALICE)
    assert mine["key_name"] == "alice"
    assert mine["limits"] == {
        "requests_per_minute": 4,
        "tokens_per_minute": None,
        "max_concurrent_requests": None,
        "max_tokens": 8,
    }
    assert "bob" not in json.dumps(mine)
    assert metric(gateway, "kiln_api_key_requests_total", key_name="bob") == 0  # listed by name before any use
    assert sha(ALICE) not in gateway.get("/metrics", key=None)[1].decode()


def test_requests_per_minute_burst(gateway):
    alice = client(gateway, ALICE)
    engine_before = engine_prompt_tokens(gateway)
    start = time.monotonic()
    # Over the max_tokens cap: a 400 that costs nothing; without max_tokens, chat gets the cap.
    code, raw = gateway.post("/v1/completions", {"prompt": "hi", "max_tokens": 9}, key=ALICE)
    assert code == 400 and json.loads(raw)["error"]["param"] == "max_tokens"
    chat = alice.chat.completions.create(
        model=gateway.model, messages=[{"role": "user", "content": "hi"}], extra_body={"ignore_eos": True}
    )
    assert chat.usage.completion_tokens == 8
    admitted_prompt_tokens = chat.usage.prompt_tokens
    for _ in range(3):  # the rest of the burst of 4: never a 429
        out = alice.completions.create(model=gateway.model, prompt="hello", max_tokens=2)
        admitted_prompt_tokens += out.usage.prompt_tokens
    error = rejected(lambda: alice.completions.create(model=gateway.model, prompt="hello", max_tokens=2))
    elapsed = time.monotonic() - start
    # The bucket held 4 and lost 4 since `start`; one request refills every 60/4 = 15 s.
    assert math.ceil(15 - elapsed) <= int(error.response.headers["Retry-After"]) <= 15
    assert error.response.json()["error"]["type"] == "requests"
    # Another key is not affected; its request also shows the engine has seen everything sent before it.
    out = client(gateway, DAVE).completions.create(model=gateway.model, prompt="hello there", max_tokens=2)
    assert engine_prompt_tokens(gateway) - engine_before == admitted_prompt_tokens + out.usage.prompt_tokens
    assert metric(gateway, "kiln_api_key_requests_total", key_name="alice") == 4
    assert metric(gateway, "kiln_api_key_rejected_requests_total", key_name="alice", reason="requests_per_minute") == 1
    assert metric(gateway, "kiln_api_key_rejected_requests_total", key_name="alice", reason="max_tokens") == 1
    assert metric(gateway, "kiln_api_key_prompt_tokens_total", key_name="alice") == admitted_prompt_tokens
    assert metric(gateway, "kiln_api_key_generation_tokens_total", key_name="alice") == 8 + 3 * 2
    mine = usage(gateway, ALICE)["usage"]
    assert mine["requests"] == 4 and mine["rejected_requests"] == {"max_tokens": 1, "requests_per_minute": 1}


def test_capped_chat_with_a_long_prompt_gets_what_the_context_leaves(gateway):
    """frank: max_tokens 8. A chat naming no max_tokens gets the cap, or what the 512-token context leaves
    after the prompt when that is less: the cap never turns it into a context-length error."""

    def messages(num_words: int) -> list[dict]:
        return [{"role": "user", "content": " ".join(["hello"] * num_words)}]

    def num_tokens(num_words: int) -> int:
        return json.loads(gateway.post("/tokenize", {"messages": messages(num_words)}, key=FRANK)[1])["count"]

    base, per_100 = num_tokens(100), num_tokens(200) - num_tokens(100)
    words = 100 + (508 - base) * 100 // per_100
    while num_tokens(words) > 511:
        words -= 1
    while num_tokens(words + 1) <= 511 and 512 - num_tokens(words) >= 8:
        words += 1
    room = 512 - num_tokens(words)
    assert 1 <= room < 8
    code, raw = gateway.post("/v1/chat/completions", {"messages": messages(words), "ignore_eos": True}, key=FRANK)
    assert code == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] == room
    code, raw = gateway.post("/v1/chat/completions", {"messages": messages(words), "max_tokens": 8}, key=FRANK)
    assert code == 400 and json.loads(raw)["error"]["code"] == "context_length_exceeded"  # asked: as without a key


def test_tokens_per_minute_charged_as_they_stream(gateway):
    """bob: 120 tokens a minute (2 a second, a minute's worth at once). Its level is bracketed by the
    usage the server reports: at least 120 - charged, at most that plus 2 a second since the start."""
    bob = client(gateway, BOB)
    prompt = "count with me"
    num_prompt = json.loads(gateway.post("/tokenize", {"prompt": prompt}, key=BOB)[1])["count"]
    engine_before = engine_prompt_tokens(gateway)
    start = time.monotonic()
    stream = bob.completions.create(
        model=gateway.model, prompt=prompt, max_tokens=100, stream=True, extra_body={"ignore_eos": True}
    )
    seen = sum(1 for _ in zip(range(5), stream))
    during = usage(gateway, BOB)  # mid-stream: its tokens so far are charged already
    assert during["in_flight_requests"] == 1 and during["usage"]["completion_tokens"] >= seen
    charged = during["usage"]["total_tokens"]
    assert 120 - charged <= during["remaining"]["tokens"] <= 120 - charged + 2 * (time.monotonic() - start)
    stream.close()  # the rest is aborted; what was generated stays charged
    while usage(gateway, BOB)["in_flight_requests"]:
        time.sleep(0.05)
    charged = usage(gateway, BOB)["usage"]["total_tokens"]
    admitted = [num_prompt]
    need = num_prompt + 50  # admission waits for the prompt and max_tokens, as OpenAI counts a request
    for _ in range(8):
        lowest = 120 - charged
        try:
            out = bob.completions.create(
                model=gateway.model, prompt=prompt, max_tokens=50, extra_body={"ignore_eos": True}
            )
        except openai.RateLimitError as e:
            highest = lowest + 2 * (time.monotonic() - start)
            assert lowest < need, "rejected under the limit"
            retry = int(e.response.headers["Retry-After"])  # the wait for `need` tokens, rounded up
            assert retry_after((need - highest) / 2) <= retry <= retry_after((need - lowest) / 2)
            assert e.response.json()["error"]["type"] == "tokens"
            break
        assert lowest + 2 * (time.monotonic() - start) >= need, "admitted over the limit"
        charged += out.usage.total_tokens
        admitted.append(out.usage.prompt_tokens)
    else:
        pytest.fail("never limited")
    assert len(admitted) >= 2  # admitted while the bucket held a request's worth, then it waited
    out = client(gateway, DAVE).completions.create(model=gateway.model, prompt="hello there", max_tokens=2)
    assert engine_prompt_tokens(gateway) - engine_before == sum(admitted) + out.usage.prompt_tokens
    assert metric(gateway, "kiln_api_key_prompt_tokens_total", key_name="bob") == sum(admitted)
    assert metric(gateway, "kiln_api_key_generation_tokens_total", key_name="bob") == charged - sum(admitted)
    assert usage(gateway, BOB)["usage"]["rejected_requests"] == {"tokens_per_minute": 1}


def test_every_sequence_counts_against_the_key(gateway):
    """A prompt list times n is that many sequences: a request whose sequences' max_tokens alone pass the key's
    tokens_per_minute is refused whole (it had got 12,800 tokens past a limit of 2,000), and prompt tokens are
    charged for each of the n copies."""
    bob = client(gateway, BOB)  # 120 tokens a minute
    for prompt, n in ((["a b"] * 20, 1), ("a b", 16)):  # 20 x 8 and 16 x 8 completion tokens: past 120 either way
        with pytest.raises(openai.BadRequestError) as e:
            bob.completions.create(model=gateway.model, prompt=prompt, n=n, max_tokens=8)
        error = e.value.response.json()["error"]
        assert error["code"] == "request_too_large" and error["param"] == "max_tokens", error
    dave = client(gateway, DAVE)
    num_prompt = json.loads(gateway.post("/tokenize", {"prompt": "a b c"}, key=DAVE)[1])["count"]
    before = usage(gateway, DAVE)["usage"]
    out = dave.completions.create(model=gateway.model, prompt=["a b c", "a b c"], n=3, max_tokens=2)
    after = usage(gateway, DAVE)["usage"]
    # (the response's usage counts each prompt once, as OpenAI's does; the key pays for every sequence's)
    assert after["prompt_tokens"] - before["prompt_tokens"] == 6 * num_prompt == 3 * out.usage.prompt_tokens
    assert after["completion_tokens"] - before["completion_tokens"] == out.usage.completion_tokens


def test_tokenizer_routes_obey_the_keys_request_limits(gateway):
    """/tokenize and /detokenize drive the tokenizer pool every request shares: grace's 2 requests a minute
    cover them too."""
    assert gateway.post("/tokenize", {"prompt": "one"}, key=GRACE)[0] == 200
    assert gateway.post("/detokenize", {"tokens": [5, 6]}, key=GRACE)[0] == 200
    for path, body in (("/tokenize", {"prompt": "two"}), ("/detokenize", {"tokens": [5]})):
        code, raw = gateway.post(path, body, key=GRACE)
        assert code == 429 and json.loads(raw)["error"]["code"] == "rate_limit_exceeded", raw
    assert usage(gateway, GRACE)["usage"]["rejected_requests"] == {"requests_per_minute": 2}


def test_concurrency_cap_under_parallel_streams(gateway):
    carol = client(gateway, CAROL)

    def open_stream():
        try:
            return carol.completions.create(
                model=gateway.model, prompt="go", max_tokens=400, stream=True, extra_body={"ignore_eos": True}
            )
        except openai.RateLimitError as e:
            return e

    barrier = threading.Barrier(5)
    with ThreadPoolExecutor(5) as pool:
        results = list(pool.map(lambda _: (barrier.wait(), open_stream())[1], range(5)))
    streams = [r for r in results if not isinstance(r, Exception)]
    refused = [r for r in results if isinstance(r, Exception)]
    assert len(streams) == 2 and len(refused) == 3
    assert all(e.response.headers["Retry-After"] == "1" for e in refused)
    assert usage(gateway, CAROL)["in_flight_requests"] == 2
    streams[0].close()  # a client that goes away releases its seat
    deadline = time.time() + 30
    while usage(gateway, CAROL)["in_flight_requests"] != 1 and time.time() < deadline:
        time.sleep(0.05)
    assert usage(gateway, CAROL)["in_flight_requests"] == 1
    third = open_stream()
    assert not isinstance(third, Exception)
    assert isinstance(open_stream(), openai.RateLimitError)
    for s in (streams[1], third):
        s.close()
    deadline = time.time() + 30
    while usage(gateway, CAROL)["in_flight_requests"] and time.time() < deadline:
        time.sleep(0.05)
    assert usage(gateway, CAROL)["in_flight_requests"] == 0
    assert (
        metric(gateway, "kiln_api_key_rejected_requests_total", key_name="carol", reason="max_concurrent_requests") == 4
    )


def test_sighup_reload_adds_and_revokes_keys_live(gateway):
    dave = client(gateway, DAVE)
    options = dict(stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, logprobs=0)
    stream = dave.completions.create(model=gateway.model, prompt="keep going", max_tokens=150, stream=True, **options)
    chunks = iter(stream)
    next(chunks)
    assert usage(gateway, DAVE)["in_flight_requests"] == 1
    alice_before = usage(gateway, ALICE)["usage"]
    new_limits = {**{k: v for k, v in LIMITS.items() if k != "dave"}, "erin": {"sha256": sha(ERIN)}}
    write(gateway.keys_path, key_file_text(new_limits))
    os.kill(gateway.proc.pid, signal.SIGHUP)
    deadline = time.time() + 10
    while gateway.get("/v1/usage", key=ERIN)[0] != 200 and time.time() < deadline:
        time.sleep(0.05)
    assert gateway.get("/v1/usage", key=ERIN)[0] == 200  # added
    engine_before = engine_prompt_tokens(gateway)
    assert gateway.post("/v1/completions", {"prompt": "hi", "max_tokens": 2}, key=DAVE)[0] == 401  # revoked at once
    assert usage(gateway, ALICE)["usage"] == alice_before  # kept keys keep their usage and buckets
    # dave's stream, admitted before the reload, goes on to its end: the reload drops no connection
    rest = list(chunks)
    after_reload = sum(len(c.choices[0].logprobs.tokens) for c in rest if c.choices and c.choices[0].logprobs)
    assert after_reload > 0 and rest[-1].usage.completion_tokens == 150
    assert engine_prompt_tokens(gateway) == engine_before  # the revoked request never reached the engine
    assert metric(gateway, "kiln_api_key_file_reloads_total", outcome="ok") == 1
    # A bad file on SIGHUP is logged and the old keys stay.
    write(gateway.keys_path, key_file_text(new_limits) + "[[keys]]\nname = 'x'\n")
    os.kill(gateway.proc.pid, signal.SIGHUP)
    deadline = time.time() + 10
    while metric(gateway, "kiln_api_key_file_reloads_total", outcome="error") != 1 and time.time() < deadline:
        time.sleep(0.05)
    assert metric(gateway, "kiln_api_key_file_reloads_total", outcome="error") == 1
    assert gateway.get("/v1/models", key=ERIN)[0] == 200 and gateway.get("/v1/models", key=DAVE)[0] == 401
    assert gateway.proc.poll() is None


def test_the_log_names_keys_and_never_shows_one(gateway):
    gateway.stop()  # last in this module: the log is complete once the server exits
    assert gateway.proc.returncode == 0
    log = gateway.proc.stdout.read()
    assert "added: erin; removed: dave" in log and "API keys not reloaded" in log
    assert not any(secret in log for key in (ALICE, BOB, CAROL, DAVE, ERIN) for secret in (key, sha(key)))
