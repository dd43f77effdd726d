"""API keys with per-key limits (`--api-keys-file`) on their own: the token bucket and admission on a fake clock,
the key file (TOML and JSON, and every error it can hold), and the command line refusing a bad one."""

from __future__ import annotations

import dataclasses
import json
import math
import time

import pytest
from prometheus_client import CollectorRegistry

from kiln.backends import environment
from kiln.engine.cli import main as cli_main
from kiln.engine.serving.api_key_file import KeyFileError, load_key_file
from kiln.engine.serving.api_keys import KeyStore, RateLimited, TokenBucket, retry_after
from kiln.engine.serving.metrics import KeyMetrics
from kiln.engine.serving.openai_requests import APIError, parse_chat, parse_completion

from helpers.keys import ALICE, BOB, DAVE, ERIN, sha, toml_keys, write

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


def test_key_file_toml_and_json_agree(tmp_path):
    entries = [
        {"name": "alice", "sha256": sha(ALICE), "requests_per_minute": 4, "max_tokens": 8},
        {"name": "bob", "sha256": sha(BOB).upper(), "tokens_per_minute": 240},
    ]
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
    (
        "keys.toml",
        toml_keys({"name": "a", "sha256": sha(ALICE), "requests_per_minute": 0}),
        "'requests_per_minute' must be a positive integer, got 0",
    ),
    (
        "keys.json",
        json.dumps({"keys": [{"name": "a", "sha256": sha(ALICE), "max_tokens": True}]}),
        "'max_tokens' must be a positive integer, got True",
    ),
    (
        "keys.toml",
        toml_keys({"name": "a", "sha256": sha(ALICE), "tokens_per_minute": "100"}),
        "'tokens_per_minute' must be a positive integer",
    ),
    (
        "keys.toml",
        toml_keys({"name": "a", "sha256": sha(ALICE), "request_per_minute": 5}),
        "unknown field(s) request_per_minute",
    ),
    (
        "keys.toml",
        toml_keys({"name": "a", "sha256": sha(ALICE)}, {"name": "a", "sha256": sha(BOB)}),
        "keys[1] ('a'): the name is used by another key",
    ),
    (
        "keys.toml",
        toml_keys({"name": "a", "sha256": sha(ALICE)}, {"name": "b", "sha256": sha(ALICE)}),
        "keys[1] ('b'): the same key (sha256) is listed twice",
    ),
    # a name goes into logs and /metrics: a newline in it would write a forged line there
    (
        "keys.json",
        json.dumps({"keys": [{"name": "a\nINFO kiln: all good", "sha256": sha(ALICE)}]}),
        "holds a control character",
    ),
]


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


def test_cli_rejects_both_kinds_of_key_and_a_bad_file_before_starting(tmp_path, capsys, monkeypatch):
    write(tmp_path / "keys.toml", toml_keys({"name": "a", "sha256": sha(ALICE)}))
    assert cli_main(["serve", "--api-key", "x", "--api-keys-file", str(tmp_path / "keys.toml")]) == 2
    assert "not both" in capsys.readouterr().err
    write(tmp_path / "bad.toml", toml_keys({"name": "a", "sha256": sha(ALICE), "max_tokens": -1}))
    start = time.monotonic()
    assert cli_main(["serve", "--api-keys-file", str(tmp_path / "bad.toml")]) == 2
    assert "'max_tokens' must be a positive integer, got -1" in capsys.readouterr().err
    assert time.monotonic() - start < 5  # no engine was started
    # KILN_API_KEY is a key too
    monkeypatch.setattr(environment, "ENV", dataclasses.replace(environment.ENV, api_key="from-the-environment"))
    assert cli_main(["serve", "--api-keys-file", str(tmp_path / "keys.toml")]) == 2
    assert "not both" in capsys.readouterr().err
    # an empty key (an unset variable) is refused, not a server without auth
    assert cli_main(["serve", "--api-key", " ", "--api-keys-file", str(tmp_path / "keys.toml")]) == 2
    assert "--api-key is empty" in capsys.readouterr().err
    monkeypatch.setattr(environment, "ENV", dataclasses.replace(environment.ENV, api_key=""))
    start = time.monotonic()
    assert cli_main(["serve", "llama-3.2-1b"]) == 2
    assert "KILN_API_KEY is empty" in capsys.readouterr().err and time.monotonic() - start < 5


# ---- admission on a fake clock ---------------------------------------------------------------------------


def store(tmp_path, clock, *entries: dict) -> KeyStore:
    write(tmp_path / "keys.toml", toml_keys(*entries))
    return KeyStore(tmp_path / "keys.toml", clock=clock)


def test_admission_takes_from_every_limit_or_from_none(tmp_path):
    clock = FakeClock()
    keys = store(
        tmp_path,
        clock,
        {
            "name": "a",
            "sha256": sha(ALICE),
            "requests_per_minute": 3,
            "tokens_per_minute": 600,
            "max_concurrent_requests": 2,
        },
    )
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
    assert usage["usage"] == {
        "requests": 3,
        "prompt_tokens": 120,
        "completion_tokens": 500,
        "total_tokens": 620,
        "rejected_requests": {"max_concurrent_requests": 1, "tokens_per_minute": 2, "requests_per_minute": 1},
    }
    assert usage["in_flight_requests"] == 0 and usage["remaining"]["requests"] == pytest.approx(0.1)


def test_max_tokens_cap(tmp_path):
    keys = store(
        tmp_path,
        FakeClock(),
        {"name": "a", "sha256": sha(ALICE), "max_tokens": 8},
        {"name": "b", "sha256": sha(BOB), "max_tokens": 100},
    )
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
    keys = store(
        tmp_path,
        clock,
        {"name": "a", "sha256": sha(ALICE), "requests_per_minute": 2},
        {"name": "d", "sha256": sha(DAVE)},
    )
    alice = keys.authenticate(f"Bearer {ALICE}")
    alice.admit(5)
    alice.release()
    write(
        tmp_path / "keys.toml",
        toml_keys({"name": "a", "sha256": sha(ALICE), "requests_per_minute": 2}, {"name": "e", "sha256": sha(ERIN)}),
    )
    assert keys.reload() == (["e"], ["d"])
    assert keys.authenticate(f"Bearer {DAVE}") is None and keys.authenticate(f"Bearer {ERIN}") is not None
    assert keys.authenticate(f"Bearer {ALICE}") is alice and alice.requests_bucket.level == 1  # not refilled
    write(tmp_path / "keys.toml", "[[keys]]\nname = ")
    assert keys.reload_or_keep() is False
    assert keys.authenticate(f"Bearer {ERIN}") is not None and len(keys) == 2


def test_a_header_of_non_utf8_bytes_is_no_key(tmp_path):
    """aiohttp hands a header's non-UTF-8 bytes over as lone surrogates (surrogateescape): no key, no exception."""
    keys = store(tmp_path, FakeClock(), {"name": "a", "sha256": sha(ALICE)})
    for given in ("Bearer \udcff\udcfe", f"Bearer {ALICE}\udce9", "\udce9"):
        assert keys.authenticate(given) is None
    assert keys.authenticate(f"Bearer {ALICE}") is not None


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
    write(
        tmp_path / "keys.toml",
        toml_keys({"name": "a", "sha256": sha(ALICE)}, {"name": "d", "sha256": sha(DAVE), "requests_per_minute": 1}),
    )
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


def test_the_seat_is_checked_before_the_prompt_and_takes_nothing(tmp_path):
    """check_seat (before tokenizing) turns away a key at its concurrency or request-rate limit, as admit would,
    and leaves its buckets and seats as they were; admit then takes."""
    clock = FakeClock()
    keys = store(
        tmp_path, clock, {"name": "a", "sha256": sha(ALICE), "requests_per_minute": 2, "max_concurrent_requests": 1}
    )
    alice = keys.authenticate(f"Bearer {ALICE}")
    alice.check_seat()
    assert alice.in_flight == 0 and alice.requests_bucket.level == 2
    alice.admit(3)
    with pytest.raises(RateLimited) as seat:
        alice.check_seat()  # one request in flight: the one seat is taken
    assert seat.value.status == 429 and seat.value.type == "concurrent_requests"
    alice.release()
    alice.admit(3)
    alice.release()
    with pytest.raises(RateLimited) as rate:
        alice.check_seat()  # two requests this minute
    assert rate.value.type == "requests" and rate.value.headers["Retry-After"] == "30"
    assert alice.usage.requests == 2 and alice.usage.rejected == {
        "max_concurrent_requests": 1,
        "requests_per_minute": 1,
    }
    clock.advance(30)
    alice.check_seat()
