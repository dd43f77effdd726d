"""Fuzzed and hostile request bodies against a real server process: never a 5xx, every error a clean OpenAI error
object that leaks nothing, and the server healthy afterwards. (Load, pressure, admission and disconnects:
test_reliability.py.)"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.server import LEAK, Server

# ---- fuzzing -------------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(st.characters(exclude_categories=()), max_size=50),  # lone surrogates included
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=20,
)
FIELDS = [
    "prompt",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "echo",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "stop_token_ids",
    "ignore_eos",
    "model",
    "user",
]
bodies = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6).map(
    lambda d: {"prompt": "hi", "max_tokens": 2, **d}
)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama_dir):
    s = Server(tiny_llama_dir)
    s.post("/v1/completions", {"prompt": "warm up", "max_tokens": 2})
    s.rss_before_fuzz = rss_bytes(s.proc.pid)
    yield s
    s.stop()


def assert_clean_error(status: int, out: bytes, what) -> None:
    assert status < 500, (what, out[:300])
    if status >= 400:
        message = json.loads(out)["error"]["message"]
        assert message and not LEAK.search(message), (what, message)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies, chat=st.booleans(), raw=st.binary(max_size=40))
def test_fuzzed_bodies_never_5xx(fuzz_server, body, chat, raw):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if chat:
        body = {"messages": [{"role": "user", "content": "hi"}], **{k: v for k, v in body.items() if k != "prompt"}}
    payload = json.dumps(body, allow_nan=True).encode() if raw[:1] != b"\x00" else raw  # some raw garbage too
    status, out = fuzz_server.post(path, payload)
    assert_clean_error(status, out, body)


# every route's fields, with values at the edges of their ranges mixed in with arbitrary JSON
EDGES = st.sampled_from([-1, 0, 1, 2, 20, 21, 2**31 - 1, 2**31, 2**63, 2**64, -(2**63), 1e-300, 1e300, -0.0, 0.5])
values = json_values | EDGES | st.lists(EDGES, max_size=4)
ROUTES = {
    "/v1/completions": (
        {"prompt": "hi", "max_tokens": 2},
        FIELDS
        + ["suffix", "best_of", "prompt_logprobs", "include_stop_str_in_output", "skip_special_tokens"]
        + ["guided_json", "guided_regex", "guided_choice", "guided_grammar", "response_format"],
    ),
    "/v1/chat/completions": (
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        [f for f in FIELDS if f not in ("prompt", "echo")]
        + ["max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls", "response_format"]
        + ["guided_json", "guided_choice", "prompt_logprobs", "chat_template_kwargs", "reasoning_effort"],
    ),
    "/v1/responses": (
        {"input": "hi", "max_output_tokens": 2},
        ["input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "text", "tools"]
        + ["tool_choice", "parallel_tool_calls", "store", "previous_response_id", "background", "reasoning"]
        + ["metadata", "model", "user", "truncation", "include"],
    ),
    "/tokenize": ({"prompt": "hi"}, ["prompt", "messages", "add_special_tokens", "tools", "model"]),
    "/detokenize": ({"tokens": [5, 6]}, ["tokens", "model"]),
}


@st.composite
def route_bodies(draw):
    path = draw(st.sampled_from(sorted(ROUTES)))
    base, fields = ROUTES[path]
    extra = draw(st.dictionaries(st.sampled_from(fields), values, max_size=4))
    return path, {**base, **extra}


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=route_bodies())
def test_every_routes_fields_fuzzed_never_5xx(fuzz_server, case):
    """Each field of /v1/completions, /v1/chat/completions, /v1/responses, /tokenize and /detokenize, of any type
    and at the edges of its range: an answer within the client's time limit, never a 5xx, every error an OpenAI
    error object (a stream's: its error event)."""
    path, body = case
    status, out = fuzz_server.post(path, json.dumps(body, allow_nan=True).encode())
    assert_clean_error(status, out, (path, body))


CHAT_HI = [{"role": "user", "content": "hi"}]
NASTY = [
    b'{"prompt": "\xff\xfe\xfd", "max_tokens": 2}',  # invalid UTF-8
    b'{"prompt": "a\\ud800b", "max_tokens": 2}',  # a lone surrogate, escaped
    b'{"prompt": "hi \xed\xa0\x80", "max_tokens": 2}',  # ... and encoded as UTF-8 would (not valid UTF-8)
    b'{"messages": [{"role": "user", "content": "\xed\xb3\xbf"}], "max_tokens": 2}',
    b'{"prompt": "hi", "max_tokens": 2, "stop": ["\xed\xa0\x80"]}',
    b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}',
    b'{"prompt": "hi", "max_tokens": 2, "stop": ["\\ud800"]}',
    b"[" * 200_000,  # deep nesting
    b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    b'{"prompt": "hi", "max_tokens": NaN}',
    b'{"prompt": "hi", "temperature": Infinity}',
    b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}",  # a 5001-digit integer
    {"prompt": "hi", "n": 10**6},
    {"prompt": "hi", "n": 2**63, "max_tokens": 1},
    {"prompt": ["hi"] * 256, "n": 10**4, "max_tokens": 1},
    {"prompt": "hi", "max_tokens": 2**63},
    {"prompt": "hi", "max_tokens": -1},
    {"prompt": "hi", "seed": 2**64},
    {"prompt": "hi", "logit_bias": {str(i): 100 for i in range(100_000)}},
    {"prompt": "hi", "logit_bias": {"1": 1e308}},
    {"prompt": "hi", "stop": ["x"] * 100_000},
    {"prompt": "hi", "stop_token_ids": list(range(100_000))},
    {"prompt": "a" * 8_000_000},  # a giant string
    {"prompt": ""},
    {"messages": CHAT_HI * 20_000},
    {"messages": [{"role": "x" * 100_000, "content": "hi"}]},
    {"messages": CHAT_HI, "top_logprobs": 10**9, "logprobs": True},
    {"prompt": "hi", "guided_regex": "(a*)*" * 1000},
]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("payload", NASTY, ids=range(len(NASTY)))
def test_nasty_bodies_never_5xx(fuzz_server, payload, chat):
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    status, out = fuzz_server.post("/v1/chat/completions" if chat else "/v1/completions", body)
    assert_clean_error(status, out, payload if isinstance(payload, bytes) else list(payload))


def test_a_lone_surrogate_encoded_in_the_body_is_a_400_on_tokenize(fuzz_server):
    for body in (b'{"prompt": "hi \xed\xa0\x80"}', b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}'):
        status, out = fuzz_server.post("/tokenize", body)
        assert status == 400 and "UTF-8" in json.loads(out)["error"]["message"], out[:300]


def test_a_byte_order_mark_before_the_json_is_taken(fuzz_server):
    status, out = fuzz_server.post("/v1/completions", b'\xef\xbb\xbf{"prompt": "hi", "max_tokens": 2}')
    assert status == 200, out[:300]


def test_fuzz_left_the_server_healthy(fuzz_server):
    assert fuzz_server.get("/health")[0] == 200
    assert fuzz_server.post("/v1/completions", {"prompt": "ok", "max_tokens": 2})[0] == 200
    grown = rss_bytes(fuzz_server.proc.pid) - fuzz_server.rss_before_fuzz
    assert grown < 256 << 20, f"the API server grew by {grown >> 20} MiB"
