"""Per-key limits against requests shaped to slip past them: many choices with no max_tokens (the bucket's
admission holds for what they may generate), and a key at its limits sending work that is slow to check (refused
before any of it is done)."""

from __future__ import annotations

import json
import time

import pytest

from helpers.keys import ALICE, BOB, sha, toml_keys, write
from helpers.server import Server

TOKENS_PER_MINUTE = 1000
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def gateway(tiny_llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    entries = [
        {"name": "alice", "sha256": sha(ALICE), "tokens_per_minute": TOKENS_PER_MINUTE},
        {"name": "bob", "sha256": sha(BOB), "requests_per_minute": 1},
    ]
    write(path, toml_keys(*entries))
    s = Server(tiny_llama_dir, "--max-model-len", "512", auth=("--api-keys-file", str(path)))
    yield s
    s.stop()


def test_many_choices_without_max_tokens_stay_within_the_token_bucket(gateway):
    """16 choices that name no max_tokens could each fill the context (16 x ~500 tokens, eight times the key's
    1,000 a minute): each gets what the bucket can pay for, so the request stays within it, and the next waits."""
    body = {"messages": HI, "n": 16, "ignore_eos": True}
    code, raw = gateway.post("/v1/chat/completions", body, key=ALICE)
    assert code == 200, raw[:300]
    reply = json.loads(raw)
    assert all(c["finish_reason"] == "length" for c in reply["choices"]) and len(reply["choices"]) == 16
    usage = json.loads(gateway.get("/v1/usage", key=ALICE)[1])["usage"]  # (the key pays each sequence's prompt)
    assert usage["completion_tokens"] == reply["usage"]["completion_tokens"]
    assert usage["prompt_tokens"] == 16 * reply["usage"]["prompt_tokens"]
    assert usage["total_tokens"] <= TOKENS_PER_MINUTE, usage
    code, raw = gateway.post("/v1/chat/completions", body, key=ALICE)
    assert code == 429 and json.loads(raw)["error"]["code"] == "rate_limit_exceeded", raw[:300]


def test_a_key_at_its_limit_is_refused_before_its_schemas_are_checked(gateway):
    """bob's one request a minute is spent; his next carries tools and a response format, whose checks would start a
    check process (a second or more): the 429 comes first, at once."""
    assert gateway.post("/v1/chat/completions", {"messages": HI, "max_tokens": 2}, key=BOB)[0] == 200
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(300)}}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    body = {
        "messages": HI,
        "tools": [tool],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        "max_tokens": 2,
    }
    for path, payload in (("/v1/chat/completions", body), ("/v1/responses", {"input": "hi", "tools": [tool]})):
        if path == "/v1/responses":
            payload["tools"] = [{"type": "function", **tool["function"]}]
        start = time.monotonic()
        code, raw = gateway.post(path, payload, key=BOB)
        assert code == 429 and time.monotonic() - start < 0.5, (code, raw[:300], time.monotonic() - start)
