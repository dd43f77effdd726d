"""Anthropic's Messages API through the official `anthropic` client against a real server on a tiny random-weight
model whose chat template renders tools, tool calls, tool results and reasoning (`helpers.templated`). References: the
same conversation through the chat endpoint (the same greedy text, the same prompt tokens), transformers' own
rendering of the chat messages a Messages request stands for (count_tokens, the two-step tool use), jsonschema for
tool inputs; scripted replies (a regex the model is held to) for calls, thinking and stop sequences. Every bad request
is the client's exception class with Anthropic's error object."""

from __future__ import annotations

import http.client
import json
import re
import time
import urllib.error
import urllib.request

import anthropic
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from helpers.keys import DAVE, sha, toml_keys, write
from helpers.server import API_KEY, LEAK, Server
from helpers.templated import templated_model_dir

# (small: the tiny model's context is 512 tokens, and its tokenizer spends ~270 on this tool rendered)
WEATHER = {
    "name": "get_weather",
    "description": "The weather",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"enum": [1, 2, 3]}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}
TIME = {
    "name": "get_time",
    "input_schema": {
        "type": "object",
        "properties": {"tz": {"enum": ["UTC", "CET"]}},
        "required": ["tz"],
        "additionalProperties": False,
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0, "ignore_eos": True}  # (the client takes sampling fields as extra body)
HERMES_CALL = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [123]\}\}\n</tool_call>'
)
THOUGHT = r"<think>\nhmm, (rain|sun)\n</think>\n\n(yes|no)"


@pytest.fixture(scope="module")
def templated_dir(tiny_llama_dir, tmp_path_factory):
    return templated_model_dir(tiny_llama_dir, tmp_path_factory.mktemp("templated"))


FLAGS = ("--max-model-len", "512", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def server(templated_dir):
    s = Server(templated_dir, *FLAGS, "--reasoning-parser", "qwen3")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def plain_server(tiny_llama_dir):
    """The tiny model's own template (no tools rendered): room in its context for both tools' calls."""
    s = Server(tiny_llama_dir, *FLAGS)
    yield s
    s.stop()


def client(server: Server, **kw) -> anthropic.Anthropic:
    """The official client: its key goes as `x-api-key` (as `Authorization: Bearer` with `auth_token`)."""
    kw.setdefault("api_key", API_KEY)
    return anthropic.Anthropic(base_url=server.url, max_retries=0, timeout=60, **kw)


def raw_events(server: Server, body: dict) -> list[tuple[str, dict]]:
    """A streamed request's SSE frames as (event name, data), read off the wire."""
    status, raw = server.post("/v1/messages", {**body, "stream": True})
    assert status == 200, raw[:300]
    frames = []
    for frame in raw.decode().split("\n\n"):
        if frame:
            event, data = frame.split("\n")
            frames.append((event.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return frames


def plain(content) -> list[dict]:
    """Content blocks as plain data (the stream helper's parsed blocks compare equal to the whole message's)."""
    return [{k: v for k, v in b.model_dump().items() if v is not None and k != "parsed_output"} for b in content]


def stream_shape(types: list[str]) -> list[str]:
    """The event names with each block's run of deltas as one."""
    return [t for i, t in enumerate(types) if t != "content_block_delta" or types[i - 1] != t]


# ---- text ------------------------------------------------------------------------------------------------


def test_a_message_is_the_chat_reply_of_the_same_conversation(server):
    message = client(server).messages.create(
        model=server.model, max_tokens=12, system="Be brief.", messages=ASK, extra_body=GREEDY
    )
    chat = server.client().chat.completions.create(
        model=server.model,
        messages=[{"role": "system", "content": "Be brief."}, *ASK],
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    (block,) = message.content
    assert block.type == "text" and block.text == chat.choices[0].message.content
    assert message.id.startswith("msg_") and (message.type, message.role) == ("message", "assistant")
    assert message.model == server.model
    assert (message.stop_reason, message.stop_sequence) == ("max_tokens", None)
    assert (message.usage.input_tokens, message.usage.output_tokens) == (chat.usage.prompt_tokens, 12)
    # the key as a bearer token, and the system prompt as text blocks, give the same
    blocks = [{"type": "text", "text": "Be brief."}]
    again = client(server, api_key=None, auth_token=API_KEY).messages.create(
        model=server.model, max_tokens=12, system=blocks, messages=ASK, extra_body=GREEDY
    )
    assert again.content == message.content and again.usage == message.usage


def test_a_stream_is_anthropics_event_sequence_and_the_same_text(server):
    kw = dict(model=server.model, max_tokens=12, messages=ASK, extra_body=GREEDY)
    whole = client(server).messages.create(**kw)
    frames = raw_events(server, {"model": server.model, "max_tokens": 12, "messages": ASK, **GREEDY})
    assert all(name == data["type"] for name, data in frames)
    types = [name for name, _ in frames]
    assert stream_shape(types) == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start, delta = frames[0][1]["message"], frames[-2][1]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    assert start["usage"]["input_tokens"] == whole.usage.input_tokens
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"] == {"input_tokens": whole.usage.input_tokens, "output_tokens": 12}
    assert frames[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    text = "".join(data["delta"]["text"] for name, data in frames if name == "content_block_delta")
    assert text == whole.content[0].text
    with client(server).messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert plain(final.content) == plain(whole.content)
    assert (final.stop_reason, final.usage) == (whole.stop_reason, whole.usage)


def test_a_stop_sequence_ends_the_reply_streamed_and_whole(server):
    kw = dict(model=server.model, max_tokens=60, messages=ASK, stop_sequences=["END", "never"])
    kw["extra_body"] = {"guided_regex": r"The answer is 42\. END of it\.", "seed": 0}
    message = client(server).messages.create(**kw)
    assert message.content[0].text == "The answer is 42. "
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "END")
    with client(server).messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert plain(final.content) == plain(message.content)
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "END")


# ---- thinking ----------------------------------------------------------------------------------------------


def test_thinking_comes_as_a_thinking_block_streamed_and_whole(server):
    """A regex makes the model think and answer; the server's --reasoning-parser qwen3 parts them."""
    kw = dict(model=server.model, max_tokens=60, messages=[{"role": "user", "content": "Rain?"}])
    kw["extra_body"] = {"guided_regex": THOUGHT, "seed": 2}
    message = client(server).messages.create(**kw, thinking={"type": "enabled", "budget_tokens": 1024})
    thinking, text = message.content
    assert thinking.type == "thinking" and re.fullmatch(r"hmm, (rain|sun)\n", thinking.thinking)
    assert thinking.signature == ""
    assert text.type == "text" and text.text in ("yes", "no") and message.stop_reason == "end_turn"
    frames = raw_events(server, {**{k: v for k, v in kw.items() if k != "extra_body"}, **kw["extra_body"]})
    assert stream_shape([name for name, _ in frames]) == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    deltas = [data for name, data in frames if name == "content_block_delta"]
    thought = "".join(d["delta"].get("thinking", "") for d in deltas if d["index"] == 0)
    answer = "".join(d["delta"]["text"] for d in deltas if d["index"] == 1)
    assert (thought, answer) == (thinking.thinking, text.text)
    assert [d["delta"]["type"] for d in deltas if d["index"] == 0][-1] == "signature_delta"
    with client(server).messages.stream(**kw) as stream:
        assert plain(stream.get_final_message().content) == plain(message.content)


# ---- tools -------------------------------------------------------------------------------------------------


def assert_valid_tool_use(block, names=SCHEMAS):
    assert block.type == "tool_use" and block.id.startswith("toolu_") and block.name in names
    jsonschema.validate(block.input, names[block.name])


def reference_ids(templated_dir, messages: list[dict], tools: list[dict]) -> list[int]:
    """transformers' rendering of chat messages (as chat templates take them) with `tools` as function tools."""
    functions = [{"type": "function", "function": {**t, "parameters": t["input_schema"]}} for t in tools]
    for f in functions:
        del f["function"]["input_schema"]
    tokenizer = AutoTokenizer.from_pretrained(templated_dir)
    return tokenizer.apply_chat_template(messages, tools=functions, add_generation_prompt=True)["input_ids"]


def test_a_two_step_tool_use(server, templated_dir):
    """A forced call, its result sent back, an answer: the second prompt renders the call and the result as the
    chat template's assistant tool call and tool message."""
    c = client(server)
    first = c.messages.create(
        model=server.model,
        max_tokens=100,
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"temperature": 1.0, "seed": 4},
    )
    (call,) = first.content
    assert_valid_tool_use(call, {"get_weather": WEATHER["input_schema"]})
    assert first.stop_reason == "tool_use"
    result = {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "sunny, 21 C"}]}
    conversation = [*ASK, {"role": "assistant", "content": first.content}, {"role": "user", "content": [result]}]
    answer = c.messages.create(
        model=server.model,
        max_tokens=40,
        messages=conversation,
        tools=[WEATHER],
        extra_body={"guided_regex": r"It is sunny in (Paris|Rome|Oslo)\.", "seed": 0},
    )
    (text,) = answer.content
    assert re.fullmatch(r"It is sunny in (Paris|Rome|Oslo)\.", text.text) and answer.stop_reason == "end_turn"
    chat_messages = [
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.input}}
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    expected = reference_ids(templated_dir, chat_messages, [WEATHER])
    assert answer.usage.input_tokens == len(expected)
    counted = c.messages.count_tokens(model=server.model, messages=conversation, tools=[WEATHER])
    assert counted.input_tokens == len(expected)


def test_auto_reads_the_calls_the_model_writes_streamed_and_whole(plain_server):
    kw = dict(model=plain_server.model, max_tokens=100, messages=ASK, tools=TOOLS)
    kw["extra_body"] = {"guided_regex": HERMES_CALL, "seed": 1}
    message = client(plain_server).messages.create(**kw)
    (call,) = message.content
    assert_valid_tool_use(call)
    assert message.stop_reason == "tool_use"
    body = {**{k: v for k, v in kw.items() if k != "extra_body"}, **kw["extra_body"]}
    frames = raw_events(plain_server, body)
    assert stream_shape([name for name, _ in frames])[1:4] == [
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
    ]
    start = frames[1][1]["content_block"]
    assert start["type"] == "tool_use" and start["name"] == "get_weather" and start["input"] == {}
    fragments = [data["delta"]["partial_json"] for name, data in frames if name == "content_block_delta"]
    assert json.loads("".join(fragments)) == call.input
    assert frames[-2][1]["delta"]["stop_reason"] == "tool_use"
    with client(plain_server).messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", call.name, call.input)]


@pytest.mark.parametrize("seed", range(3))
def test_tool_choice_any_gives_a_valid_call_to_an_offered_tool(plain_server, seed):
    message = client(plain_server).messages.create(
        model=plain_server.model,
        max_tokens=150,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body={"temperature": 1.0, "seed": seed},
    )
    (call,) = message.content
    assert_valid_tool_use(call)
    assert message.stop_reason == "tool_use"


def test_tool_choice_none_leaves_a_written_call_as_text(plain_server):
    message = client(plain_server).messages.create(
        model=plain_server.model,
        max_tokens=100,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "none"},
        extra_body={"guided_regex": HERMES_CALL, "seed": 1},
    )
    (block,) = message.content
    assert block.type == "text" and block.text.startswith("<tool_call>") and message.stop_reason == "end_turn"


# ---- count_tokens ------------------------------------------------------------------------------------------


def test_count_tokens_is_the_rendered_prompt(server, templated_dir):
    conversation = [
        {"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Paris?"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "I should look.", "signature": "x"},
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "days": 1}},
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
    ]
    system = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}]
    counted = client(server).messages.count_tokens(
        model=server.model, system=system, messages=conversation, tools=[WEATHER]
    )
    function = {"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}
    call = {"id": "toolu_1", "type": "function", "function": function}
    chat_messages = [
        {"role": "system", "content": "Be brief.\nUse tools."},
        {"role": "user", "content": "Weather\nin Paris?"},
        {"role": "assistant", "content": "Looking.", "reasoning_content": "I should look.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
    ]
    assert counted.input_tokens == len(reference_ids(templated_dir, chat_messages, [WEATHER]))
    message = client(server).messages.create(
        model=server.model,
        max_tokens=1,
        system=system,
        messages=conversation,
        tools=[WEATHER],
        tool_choice={"type": "none"},
    )
    assert message.usage.input_tokens == counted.input_tokens


# ---- errors ------------------------------------------------------------------------------------------------


def expect_error(exception: type, call, kind: str, words: str = "") -> None:
    with pytest.raises(exception) as caught:
        call()
    body = caught.value.body
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    assert words in body["error"]["message"], body


def test_bad_requests_are_the_clients_exceptions(server):
    c = client(server)
    base = {"model": server.model, "max_tokens": 8, "messages": ASK}

    def post(**changes):
        body = {k: v for k, v in {**base, **changes}.items() if v is not None}
        return lambda: c.post("/v1/messages", body=body, cast_to=anthropic.types.Message)

    bad = anthropic.BadRequestError
    expect_error(bad, post(max_tokens=None), "invalid_request_error", "max_tokens")
    expect_error(bad, post(max_tokens=0), "invalid_request_error", "max_tokens")
    expect_error(bad, post(messages=[{"role": "system", "content": "hi"}]), "invalid_request_error", "'role'")
    expect_error(bad, post(messages=[{"role": "robot", "content": "hi"}]), "invalid_request_error", "'role'")
    unknown = {"type": "tool", "name": "get_stock_price"}
    expect_error(bad, post(tools=TOOLS, tool_choice=unknown), "invalid_request_error", "get_stock_price")
    expect_error(bad, post(tool_choice={"type": "required"}), "invalid_request_error", "tool_choice")
    expect_error(bad, post(tools=[{"name": "x"}]), "invalid_request_error", "input_schema")
    expect_error(bad, post(tools=[{"type": "bash_20250124", "name": "bash"}]), "invalid_request_error", "custom")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    expect_error(bad, post(messages=[{"role": "user", "content": [image]}]), "invalid_request_error", "'image'")
    prefill = [*ASK, {"role": "assistant", "content": "The weather"}]
    expect_error(bad, post(messages=prefill), "invalid_request_error", "prefill")
    expect_error(bad, post(stop_sequences="END"), "invalid_request_error", "stop_sequences")
    expect_error(bad, post(metadata={"user_id": 5}), "invalid_request_error", "user_id")
    expect_error(bad, post(thinking={"type": "enabled", "budget_tokens": 10}), "invalid_request_error", "budget")
    expect_error(bad, post(max_tokens=500), "invalid_request_error", "input length and `max_tokens` exceed context")
    long = [{"role": "user", "content": "hello " * 600}]
    expect_error(bad, post(messages=long), "invalid_request_error", "prompt is too long")
    expect_error(anthropic.NotFoundError, post(model="claude-opus-4"), "not_found_error", "claude-opus-4")
    wrong = client(server, api_key="sk-wrong")
    expect_error(
        anthropic.AuthenticationError,
        lambda: wrong.messages.create(model=server.model, max_tokens=8, messages=ASK),
        "authentication_error",
    )
    expect_error(
        anthropic.AuthenticationError,
        lambda: wrong.messages.count_tokens(model=server.model, messages=ASK),
        "authentication_error",
    )
    two_keys = urllib.request.Request(server.url + "/v1/messages", data=json.dumps(base).encode(), method="POST")
    two_keys.add_header("x-api-key", API_KEY)
    two_keys.add_header("Authorization", "Bearer sk-other")
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(two_keys, timeout=60)
    assert caught.value.code == 400 and "x-api-key" in json.loads(caught.value.read())["error"]["message"]
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    connection.putrequest("POST", "/v1/messages")
    for key in (API_KEY, "sk-other"):
        connection.putheader("x-api-key", key)
    payload = json.dumps(base).encode()
    connection.putheader("Content-Length", str(len(payload)))
    connection.endheaders(payload)
    response = connection.getresponse()
    assert response.status == 400 and "more than one x-api-key" in json.loads(response.read())["error"]["message"]
    connection.close()
    # what aiohttp answers itself, under these paths, is Anthropic's object too
    status, raw = server.request("GET", "/v1/messages")
    assert status == 405 and json.loads(raw)["error"]["type"] == "invalid_request_error"
    status, raw = server.post("/v1/messages", b"{not json")
    assert status == 400 and json.loads(raw)["type"] == "error"
    status, raw = server.post("/v1/messages/batches", base)
    assert status == 404 and json.loads(raw)["error"]["type"] == "not_found_error"
    assert c.messages.create(**base).usage.output_tokens >= 1  # still serving


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=30),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=15,
)
BLOCK = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "tool_use", "tool_result", "thinking", "image", "document"])},
    optional={k: json_values for k in ("text", "id", "name", "input", "tool_use_id", "content", "thinking")},
)
FIELDS = {
    "model": json_values,
    "max_tokens": json_values | st.integers(-2, 600),
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "assistant", "system"])},
            optional={"content": st.text(max_size=8) | st.lists(BLOCK, max_size=3)},
        ),
        max_size=3,
    )
    | json_values,
    "system": json_values | st.lists(BLOCK, max_size=2),
    "tools": json_values | st.just([WEATHER]) | st.lists(st.fixed_dictionaries({}, optional={"name": json_values})),
    "tool_choice": json_values | st.sampled_from([{"type": t} for t in ("auto", "any", "none", "tool")]),
    **{name: json_values for name in ("stop_sequences", "temperature", "top_p", "top_k", "metadata", "thinking")},
    "stream": st.booleans() | json_values,
}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.fixed_dictionaries({}, optional=FIELDS))
def test_fuzzed_bodies_are_answered_or_a_4xx_in_anthropics_shape(plain_server, changes):
    body = {"model": plain_server.model, "max_tokens": 2, "messages": ASK, **changes}
    status, raw = plain_server.post("/v1/messages", json.dumps(body, allow_nan=True).encode())
    assert status < 500, (body, raw[:300])
    if status >= 400:
        error = json.loads(raw)
        kind = "not_found_error" if status == 404 else "invalid_request_error"  # (404: a model not served)
        assert error["type"] == "error" and error["error"]["type"] == kind, error
        assert error["error"]["message"] and not LEAK.search(error["error"]["message"]), error


def test_a_client_that_hangs_up_mid_stream_aborts_its_request(server):
    baseline = server.metric("kiln_kv_cache_free_blocks")
    body = {"model": server.model, "max_tokens": 300, "messages": ASK, "stream": True, "ignore_eos": True}
    request = urllib.request.Request(server.url + "/v1/messages", data=json.dumps(body).encode(), method="POST")
    request.add_header("x-api-key", API_KEY)
    response = urllib.request.urlopen(request, timeout=60)
    while b"content_block_delta" not in response.readline():
        pass
    response.close()  # the client goes away mid-decode
    deadline = time.time() + 60
    while time.time() < deadline:
        if server.metric("kiln_num_requests_running") == 0 and server.metric("kiln_kv_cache_free_blocks") == baseline:
            break
        time.sleep(0.2)
    assert server.metric("kiln_num_requests_running") == 0
    assert server.metric("kiln_kv_cache_free_blocks") == baseline


# ---- API keys, quotas, metrics, failures ---------------------------------------------------------------------

FAULT_TOKEN = 300  # the gateway's API process fails on a request handed this token id (a test hook)
LIMITED = "sk-test-limited-0123456789"
KEYS = {
    "limited": {"sha256": sha(LIMITED), "requests_per_minute": 2, "max_tokens": 8},
    "dave": {"sha256": sha(DAVE)},
}


@pytest.fixture(scope="module")
def gateway(tiny_llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    write(path, toml_keys(*({"name": name, **entry} for name, entry in KEYS.items())))
    s = Server(
        tiny_llama_dir, "--max-model-len", "512", auth=("--api-keys-file", str(path)), server_fault_token=FAULT_TOKEN
    )
    yield s
    s.stop()


def test_keys_and_their_limits_hold_for_messages(gateway):
    """x-api-key (and a bearer token) name the key; its max_tokens cap and requests per minute hold; /v1/usage and
    /metrics count the requests as chat ones."""
    requests_before = gateway.metric("kiln_requests_total")
    limited = client(gateway, api_key=LIMITED)
    kw = dict(model=gateway.model, messages=ASK, extra_body=GREEDY)
    expect_error(
        anthropic.BadRequestError,
        lambda: limited.messages.create(max_tokens=9, **kw),
        "invalid_request_error",
        "more than this API key allows (8)",
    )
    first = limited.messages.create(max_tokens=8, **kw)
    counted = limited.messages.count_tokens(model=gateway.model, messages=ASK)
    assert counted.input_tokens == first.usage.input_tokens
    with pytest.raises(anthropic.RateLimitError) as caught:
        limited.messages.create(max_tokens=8, **kw)  # the third request this minute (count_tokens is one)
    assert caught.value.body["error"]["type"] == "rate_limit_error"
    assert int(caught.value.response.headers["retry-after"]) >= 1
    usage = json.loads(gateway.get("/v1/usage", key=LIMITED)[1])
    assert usage["usage"]["requests"] == 2  # the message and the count (the refused ones took nothing)
    assert usage["usage"]["prompt_tokens"] == first.usage.input_tokens
    assert usage["usage"]["completion_tokens"] == first.usage.output_tokens == 8
    dave = client(gateway, api_key=None, auth_token=DAVE)
    assert dave.messages.create(max_tokens=3, **kw).usage.output_tokens == 3
    assert gateway.metric("kiln_requests_total") == requests_before + 2  # the two messages served
    assert gateway.metric("kiln_api_key_requests_total") >= 3


def test_a_failure_midway_is_an_error_event_and_a_whole_failure_an_api_error(gateway):
    """The API server raises (a test hook) on the first token, forced by logit_bias: streamed, the one response ends
    with Anthropic's error event after message_start; whole, a 500 api_error; and the server serves on."""
    body = {"model": gateway.model, "max_tokens": 4, "messages": ASK, "logit_bias": {str(FAULT_TOKEN): 100}}
    status, raw = gateway.post("/v1/messages", {**body, "stream": True}, key=DAVE)
    assert status == 200
    frames = [frame.split("\n") for frame in raw.decode().split("\n\n") if frame]
    assert [event for event, _ in frames] == ["event: message_start", "event: error"]
    assert json.loads(frames[-1][1].removeprefix("data: "))["error"]["type"] == "api_error"
    expect_error(
        anthropic.InternalServerError,
        lambda: client(gateway, api_key=DAVE).post("/v1/messages", body=body, cast_to=anthropic.types.Message),
        "api_error",
    )
    assert client(gateway, api_key=DAVE).messages.create(model=gateway.model, max_tokens=2, messages=ASK).content
