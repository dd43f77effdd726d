"""API keys with per-key limits (`--api-keys-file`): the token bucket and the key file on their own, then
a real server: bursts over and under a limit, tokens charged as they stream, a concurrency cap under
parallel streams, a live SIGHUP reload, and the engine's own counter showing rejected requests never reach it."""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from test_server import Server

from kiln.engine.cli import main as cli_main
from kiln.engine.gateway import KeyFileError, KeyStore, RateLimited, TokenBucket, load_key_file, retry_after
from kiln.engine.metrics import KeyMetrics
from kiln.engine.openai_requests import APIError, parse_chat, parse_completion

# ---- the token bucket, on a fake clock ----------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_token_bucket_refills_continuously_up_to_capacity():
    clock = FakeClock()
    bucket = TokenBucket.per_minute(60, clock)  # one token a second, a minute's worth at most
    assert bucket.level == 60 and bucket.wait_for(60) == 0.0
    bucket.take(60)
    assert bucket.level == 0 and bucket.wait_for(1) == pytest.approx(1.0)
    clock.advance(0.25)
    assert bucket.level == pytest.approx(0.25) and bucket.wait_for(1) == pytest.approx(0.75)
    clock.advance(1000)
    assert bucket.level == 60  # never above capacity
    assert bucket.wait_for(61) == math.inf  # more than it ever holds


def test_token_bucket_goes_negative_and_the_next_request_waits():
    clock = FakeClock()
    bucket = TokenBucket.per_minute(600, clock)  # 10 tokens a second
    bucket.take(100)  # prompt, at admission
    bucket.take(700)  # generated, charged as it streamed
    assert bucket.level == -200
    # a 50-token prompt needs 250 tokens refilled: 25 s
    assert bucket.wait_for(50) == pytest.approx(25.0) and retry_after(bucket.wait_for(50)) == 25
    clock.advance(0.5)
    assert retry_after(bucket.wait_for(50)) == 25  # 24.5 s rounds up
    clock.advance(24.0)
    assert retry_after(bucket.wait_for(50)) == 1  # 0.5 s
    clock.advance(0.5)
    assert bucket.wait_for(50) == 0.0


def test_retry_after_rounds_up_to_whole_seconds():
    assert [retry_after(s) for s in (0.001, 1.0, 1.0000000001, 1.01, 14.2, 20.0)] == [1, 1, 1, 2, 15, 20]


def test_token_bucket_resize_keeps_the_level_within_the_new_capacity():
    clock = FakeClock()
    bucket = TokenBucket.per_minute(600, clock)
    bucket.take(100)
    bucket.resize(300, 5.0)
    assert bucket.level == 300
    bucket.take(310)
    clock.advance(2)
    assert bucket.level == pytest.approx(0.0)


# ---- the key file ---------------------------------------------------------------------------------------

ALICE, BOB, CAROL, DAVE, ERIN, FRANK = (f"sk-test-{n}-0123456789"
                                        for n in ("alice", "bob", "carol", "dave", "erin", "frank"))  # fmt: skip


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def toml_keys(*entries: dict) -> str:
    def value(v):
        return json.dumps(v)  # JSON strings and integers are valid TOML

    return "".join("[[keys]]\n" + "".join(f"{k} = {value(v)}\n" for k, v in e.items()) + "\n" for e in entries)


def write(path, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)  # a reload never reads half a file


def test_key_file_toml_and_json_agree(tmp_path):
    entries = [{"name": "alice", "sha256": sha(ALICE), "requests_per_minute": 4, "max_tokens": 8},
               {"name": "bob", "sha256": sha(BOB).upper(), "tokens_per_minute": 240}]  # fmt: skip
    write(tmp_path / "keys.toml", toml_keys(*entries))
    write(tmp_path / "keys.json", json.dumps({"keys": entries}))
    from_toml, from_json = load_key_file(tmp_path / "keys.toml"), load_key_file(tmp_path / "keys.json")
    assert from_toml == from_json
    assert [(k.name, k.sha256) for k in from_toml] == [("alice", sha(ALICE)), ("bob", sha(BOB))]
    assert from_toml[0].limits.requests_per_minute == 4 and from_toml[0].limits.tokens_per_minute is None


BAD_FILES = [
    ("keys.toml", "[[keys]\nname = 1", "not valid TOML"),
    ("keys.json", "{'keys': []}", "not valid JSON"),
    ("keys.toml", 'name = "alice"\n', "expected a list 'keys'"),
    ("keys.toml", toml_keys({"sha256": sha(ALICE)}), "keys[0] needs a non-empty string 'name'"),
    ("keys.toml", toml_keys({"name": "alice", "sha256": ALICE}), "'sha256' must be 64 hex digits"),
    ("keys.toml", toml_keys({"name": "alice"}), "'sha256' must be 64 hex digits"),
    ("keys.toml", toml_keys({"name": "a", "sha256": sha(ALICE), "requests_per_minute": 0}),
     "'requests_per_minute' must be a positive integer, got 0"),
    ("keys.json", json.dumps({"keys": [{"name": "a", "sha256": sha(ALICE), "max_tokens": True}]}),
     "'max_tokens' must be a positive integer, got True"),
    ("keys.toml", toml_keys({"name": "a", "sha256": sha(ALICE), "tokens_per_minute": "100"}),
     "'tokens_per_minute' must be a positive integer"),
    ("keys.toml", toml_keys({"name": "a", "sha256": sha(ALICE), "request_per_minute": 5}),
     "unknown field(s) request_per_minute"),
    ("keys.toml", toml_keys({"name": "a", "sha256": sha(ALICE)}, {"name": "a", "sha256": sha(BOB)}),
     "keys[1] ('a'): the name is used by another key"),
    ("keys.toml", toml_keys({"name": "a", "sha256": sha(ALICE)}, {"name": "b", "sha256": sha(ALICE)}),
     "keys[1] ('b'): the same key (sha256) is listed twice"),
]  # fmt: skip


@pytest.mark.parametrize("filename,text,problem", BAD_FILES)
def test_key_file_errors_name_the_problem(tmp_path, filename, text, problem):
    path = tmp_path / filename
    write(path, text)
    with pytest.raises(KeyFileError) as e:
        load_key_file(path)
    assert problem in str(e.value) and str(path) in str(e.value)
    assert ALICE not in str(e.value)  # a key pasted where its hash belongs is never echoed
    with pytest.raises(KeyFileError, match="cannot read"):
        load_key_file(tmp_path / "missing.toml")


def test_cli_rejects_both_kinds_of_key_and_a_bad_file_before_starting(tmp_path, capsys):
    write(tmp_path / "keys.toml", toml_keys({"name": "a", "sha256": sha(ALICE)}))
    assert cli_main(["serve", "--api-key", "x", "--api-keys-file", str(tmp_path / "keys.toml")]) == 2
    assert "not both" in capsys.readouterr().err
    write(tmp_path / "bad.toml", toml_keys({"name": "a", "sha256": sha(ALICE), "max_tokens": -1}))
    start = time.monotonic()
    assert cli_main(["serve", "--api-keys-file", str(tmp_path / "bad.toml")]) == 2
    assert "'max_tokens' must be a positive integer, got -1" in capsys.readouterr().err
    assert time.monotonic() - start < 5  # no engine was started


# ---- admission on a fake clock ---------------------------------------------------------------------------


def store(tmp_path, clock, *entries: dict) -> KeyStore:
    write(tmp_path / "keys.toml", toml_keys(*entries))
    return KeyStore(tmp_path / "keys.toml", clock=clock)


def test_admission_takes_from_every_limit_or_from_none(tmp_path):
    clock = FakeClock()
    keys = store(tmp_path, clock, {"name": "a", "sha256": sha(ALICE), "requests_per_minute": 3,
                                   "tokens_per_minute": 600, "max_concurrent_requests": 2})  # fmt: skip
    key = keys.authenticate(f"Bearer {ALICE}")
    assert keys.authenticate(f"Bearer {BOB}") is None and keys.authenticate(ALICE) is None
    assert keys.authenticate(f"Bearer {sha(ALICE)}") is None  # the hash is not the key
    key.admit(10)
    key.admit(10)  # requests: 1 left (one refills every 20 s); tokens: 580 (10 a second)
    with pytest.raises(RateLimited) as e:  # two in flight
        key.admit(10)
    assert e.value.status == 429 and e.value.type == "concurrent_requests"
    key.release()
    key.charge(500)  # generated tokens: 80 left
    with pytest.raises(RateLimited) as e:  # 20 tokens short: 2 s; the request limit alone would admit it
        key.admit(100)
    assert e.value.headers == {"Retry-After": "2"} and e.value.type == "tokens"
    clock.advance(2)
    key.admit(100)  # nothing was taken by the two rejections: 1.1 requests and exactly 100 tokens are there
    key.release()
    key.release()
    with pytest.raises(RateLimited) as e:  # 0.1 requests left: 18 s to the next; tokens need only 0.1 s
        key.admit(1)
    assert e.value.headers == {"Retry-After": "18"} and e.value.type == "requests"
    with pytest.raises(APIError) as e:  # more than a minute's tokens can never be admitted
        key.admit(601)
    assert e.value.status == 400 and e.value.code == "request_too_large"
    usage = key.usage_body()
    assert usage["usage"] == {"requests": 3, "prompt_tokens": 120, "completion_tokens": 500, "total_tokens": 620,
                              "rejected_requests": {"max_concurrent_requests": 1, "tokens_per_minute": 2,
                                                    "requests_per_minute": 1}}  # fmt: skip
    assert usage["in_flight_requests"] == 0 and usage["remaining"]["requests"] == pytest.approx(0.1)


def test_max_tokens_cap(tmp_path):
    keys = store(tmp_path, FakeClock(), {"name": "a", "sha256": sha(ALICE), "max_tokens": 8},
                 {"name": "b", "sha256": sha(BOB), "max_tokens": 100})  # fmt: skip
    capped, roomy = keys.authenticate(f"Bearer {ALICE}"), keys.authenticate(f"Bearer {BOB}")

    def max_tokens(key, body, chat=False):
        parsed = (parse_chat if chat else parse_completion)(body)
        key.apply_max_tokens(parsed, body)
        return parsed.params.max_tokens

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert max_tokens(capped, chat, chat=True) == 8  # chat's default is the whole context: the cap
    assert max_tokens(capped, {"prompt": "hi"}) == 8  # completions' default (16) lowered to the cap
    assert max_tokens(roomy, {"prompt": "hi"}) == 16  # ... or kept when under it
    assert max_tokens(capped, {"prompt": "hi", "max_tokens": 8}) == 8
    for body, chat_ in (({"prompt": "hi", "max_tokens": 9}, False), ({**chat, "max_completion_tokens": 9}, True)):
        with pytest.raises(APIError) as e:  # asking for more than the cap is an error, as at OpenAI
            max_tokens(capped, body, chat_)
        assert e.value.status == 400 and e.value.param == "max_tokens" and "8" in e.value.message
    with pytest.raises(APIError) as e:
        max_tokens(capped, {"prompt": "hi", "min_tokens": 10})
    assert e.value.status == 400 and e.value.param == "min_tokens"
    assert capped.usage.rejected == {"max_tokens": 3}
    # Chat's default is what the context leaves after the prompt (`room`): lowered to the cap, never above the room.
    for room, expected in ((5, 5), (8, 8), (300, 8)):
        parsed = parse_chat(chat)
        capped.apply_max_tokens(parsed, chat, room=room)
        assert parsed.params.max_tokens == expected
    parsed = parse_completion({"prompt": "hi"})
    capped.apply_max_tokens(parsed, {"prompt": "hi"}, room=5)
    assert parsed.params.max_tokens == 8  # completions' default is 16 whatever the room, as without a key


def test_reload_keeps_state_by_name_and_a_bad_file_keeps_the_old_keys(tmp_path):
    clock = FakeClock()
    keys = store(tmp_path, clock, {"name": "a", "sha256": sha(ALICE), "requests_per_minute": 2},
                 {"name": "d", "sha256": sha(DAVE)})  # fmt: skip
    alice = keys.authenticate(f"Bearer {ALICE}")
    alice.admit(5)
    alice.release()
    write(tmp_path / "keys.toml", toml_keys({"name": "a", "sha256": sha(ALICE), "requests_per_minute": 2},
                                            {"name": "e", "sha256": sha(ERIN)}))  # fmt: skip
    assert keys.reload() == (["e"], ["d"])
    assert keys.authenticate(f"Bearer {DAVE}") is None and keys.authenticate(f"Bearer {ERIN}") is not None
    assert keys.authenticate(f"Bearer {ALICE}") is alice and alice.requests_bucket.level == 1  # not refilled
    write(tmp_path / "keys.toml", "[[keys]]\nname = ")
    assert keys.reload_or_keep() is False
    assert keys.authenticate(f"Bearer {ERIN}") is not None and len(keys) == 2


def test_a_key_revoked_while_its_request_is_being_prepared_is_not_admitted(tmp_path):
    keys = store(tmp_path, FakeClock(), {"name": "a", "sha256": sha(ALICE)}, {"name": "d", "sha256": sha(DAVE)})
    dave = keys.authenticate(f"Bearer {DAVE}")  # past the auth middleware, still tokenizing ...
    write(tmp_path / "keys.toml", toml_keys({"name": "a", "sha256": sha(ALICE)}))
    keys.reload()  # ... when a SIGHUP revokes the key
    with pytest.raises(APIError) as e:
        dave.admit(5)
    assert e.value.status == 401 and e.value.code == "invalid_api_key"
    assert dave.in_flight == 0 and dave.usage.requests == 0


def test_metrics_list_only_the_current_keys(tmp_path):
    registry = CollectorRegistry()
    write(tmp_path / "keys.toml", toml_keys({"name": "a", "sha256": sha(ALICE)},
                                            {"name": "d", "sha256": sha(DAVE), "requests_per_minute": 1}))
    keys = KeyStore(tmp_path / "keys.toml", KeyMetrics(registry), clock=FakeClock())
    dave = keys.authenticate(f"Bearer {DAVE}")
    dave.admit(5)
    with pytest.raises(RateLimited):
        dave.admit(5)

    def key_names() -> set[str]:
        return {s.labels["key_name"] for family in registry.collect() for s in family.samples if "key_name" in s.labels}

    assert key_names() == {"a", "d"}
    write(tmp_path / "keys.toml", toml_keys({"name": "a", "sha256": sha(ALICE)}))
    keys.reload()
    dave.charge(3)  # its open stream goes on after the reload
    dave.release()
    assert key_names() == {"a"}  # however many keys come and go, /metrics holds the current ones


# ---- a real server ----------------------------------------------------------------------------------------


LIMITS = {
    "alice": {"sha256": sha(ALICE), "requests_per_minute": 4, "max_tokens": 8},
    "bob": {"sha256": sha(BOB), "tokens_per_minute": 120},
    "carol": {"sha256": sha(CAROL), "max_concurrent_requests": 2},
    "dave": {"sha256": sha(DAVE)},
    "frank": {"sha256": sha(FRANK), "max_tokens": 8},
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
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())  # fmt: skip


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
    assert mine["limits"] == {"requests_per_minute": 4, "tokens_per_minute": None, "max_concurrent_requests": None,
                              "max_tokens": 8}  # fmt: skip
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
    chat = alice.chat.completions.create(model=gateway.model, messages=[{"role": "user", "content": "hi"}],
                                         extra_body={"ignore_eos": True})  # fmt: skip
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
    stream = bob.completions.create(model=gateway.model, prompt=prompt, max_tokens=450, stream=True,
                                    extra_body={"ignore_eos": True})  # fmt: skip
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
    for _ in range(8):
        lowest = 120 - charged
        try:
            out = bob.completions.create(model=gateway.model, prompt=prompt, max_tokens=50,
                                         extra_body={"ignore_eos": True})  # fmt: skip
        except openai.RateLimitError as e:
            highest = lowest + 2 * (time.monotonic() - start)
            assert lowest < num_prompt, "rejected under the limit"
            retry = int(e.response.headers["Retry-After"])  # the wait for num_prompt tokens, rounded up
            assert retry_after((num_prompt - highest) / 2) <= retry <= retry_after((num_prompt - lowest) / 2)
            assert e.response.json()["error"]["type"] == "tokens"
            break
        assert lowest + 2 * (time.monotonic() - start) >= num_prompt, "admitted over the limit"
        charged += out.usage.total_tokens
        admitted.append(out.usage.prompt_tokens)
    else:
        pytest.fail("never limited")
    assert len(admitted) >= 2  # the bucket went below zero after admitting a request, then it waited
    out = client(gateway, DAVE).completions.create(model=gateway.model, prompt="hello there", max_tokens=2)
    assert engine_prompt_tokens(gateway) - engine_before == sum(admitted) + out.usage.prompt_tokens
    assert metric(gateway, "kiln_api_key_prompt_tokens_total", key_name="bob") == sum(admitted)
    assert metric(gateway, "kiln_api_key_generation_tokens_total", key_name="bob") == charged - sum(admitted)
    assert usage(gateway, BOB)["usage"]["rejected_requests"] == {"tokens_per_minute": 1}


def test_concurrency_cap_under_parallel_streams(gateway):
    carol = client(gateway, CAROL)

    def open_stream():
        try:
            return carol.completions.create(model=gateway.model, prompt="go", max_tokens=400, stream=True,
                                            extra_body={"ignore_eos": True})  # fmt: skip
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
    assert metric(gateway, "kiln_api_key_rejected_requests_total", key_name="carol",
                  reason="max_concurrent_requests") == 4  # fmt: skip


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
