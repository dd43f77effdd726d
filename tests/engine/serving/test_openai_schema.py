"""Kiln's replies held to OpenAI's own schemas: completions, chat completions (tools, logprobs, reasoning) and the
Responses API, whole and every streamed chunk and event, and the error bodies of 4xx answers, validated against the
component schemas of OpenAI's OpenAPI document (vendored with their source and commit: data/openai_schemas.json).

An object may hold only the properties the spec names for it: each field Kiln adds is allowed below by name, with
its reason (the README's compatibility notes list them)."""

from __future__ import annotations

import functools
import json

import httpx
import pytest
from transformers import AutoTokenizer

from helpers.keys import sha, toml_keys, write
from helpers.openai_schemas import load, problems, validator
from helpers.server import Server

# ---- what Kiln adds to OpenAI's objects, on purpose (the README's compatibility notes) ---------------------------

REF = "#/components/schemas/"
STOP_REASON = {"stop_reason": {"type": ["integer", "string", "null"]}}  # vLLM's: the stop token id or string
PROMPT_LOGPROBS = {"prompt_logprobs": {"type": ["array", "null"]}}  # vLLM's, asked for by `prompt_logprobs`
REASONING = {"reasoning_content": {"type": ["string", "null"]}}  # vLLM's, with --reasoning-parser
CHOICE = "/properties/choices/items"
EXTRAS = {
    ("CreateCompletionResponse", CHOICE): STOP_REASON | PROMPT_LOGPROBS,
    # an echoed prompt's first token has no log-probability: null, as OpenAI's legacy API and vLLM send it (the
    # spec's items are numbers and objects only)
    ("CreateCompletionResponse", CHOICE + "/properties/logprobs/anyOf/0"): {
        "token_logprobs": {"type": "array", "items": {"type": ["number", "null"]}},
        "top_logprobs": {
            "type": "array",
            "items": {"anyOf": [{"type": "object", "additionalProperties": {"type": "number"}}, {"type": "null"}]},
        },
    },
    ("CreateChatCompletionResponse", CHOICE): STOP_REASON,
    ("CreateChatCompletionResponse", ""): PROMPT_LOGPROBS,
    ("ChatCompletionResponseMessage", ""): REASONING,
    ("CreateChatCompletionStreamResponse", CHOICE): STOP_REASON,
    ("ChatCompletionStreamResponseDelta", ""): REASONING,
    # OpenAI's responses carry it (the spec's own example of the object does) though its schema leaves it out;
    # always false: Kiln keeps no responses
    ("Response", "/allOf/2"): {"store": {"const": False}},
    ("Model", ""): {"max_model_len": {"type": "integer"}},  # vLLM's: the context the model is served with
}
# A completion's stream sends the whole-response schema chunk by chunk (the spec's choice for it): as OpenAI's own
# streams, a chunk before the last has a null finish_reason, and with include_usage a null usage
COMPLETION_CHUNK = EXTRAS | {
    ("CreateCompletionResponse", CHOICE): STOP_REASON
    | {"finish_reason": {"enum": ["stop", "length", "content_filter", None]}},
    ("CreateCompletionResponse", ""): {"usage": {"anyOf": [{"$ref": REF + "CompletionUsage"}, {"type": "null"}]}},
}
EVENTS = load()["events"]  # a Responses stream's event type -> its schema


@functools.cache
def check(name: str):
    if name == "completion chunk":
        return validator("CreateCompletionResponse", COMPLETION_CHUNK)
    return validator(name, EXTRAS)


def assert_valid(name: str, instance) -> None:
    found = problems(check(name), instance)
    assert not found, f"{name}: {json.dumps(instance)[:1500]}\n" + "\n".join(found)


def test_the_validators_hold_replies_to_the_spec_and_no_further():
    """As the tests read the vendored schemas: a reply in the spec's shape passes, and so does an extra allowed
    above; a field the spec names nowhere for its object, a required one left out or a value off its type or enum
    does not, at any depth; the spec's `nullable` admits null."""
    chat = check("CreateChatCompletionResponse")

    def reply(**message_fields):
        message = {"role": "assistant", "content": "hi", "refusal": None, **message_fields}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}
        return {"id": "c", "object": "chat.completion", "created": 1, "model": "m", "choices": [choice]}

    assert problems(chat, reply()) == [] and problems(chat, reply(reasoning_content="hmm")) == []
    wrong = [
        ({**reply(), "surprise": 1}, "at /: Unevaluated properties are not allowed ('surprise' was unexpected)"),
        (reply(refusal=1), "at /choices/0/message/refusal: 1 is not valid under any of the given schemas"),
        (reply(tool_calls=[{"id": "x", "type": "function", "function": {"name": "f"}}]), "'arguments' is a required"),
        (
            reply(tool_calls=[{"id": "x", "type": "function", "function": {"name": "f", "arguments": "", "n": 1}}]),
            "at /choices/0/message/tool_calls/0/function: Unevaluated properties are not allowed ('n' was unexpected)",
        ),
    ]
    left_out = reply()
    del left_out["choices"][0]["message"]["refusal"]
    wrong.append((left_out, "at /choices/0/message: 'refusal' is a required property"))
    off_enum = reply()
    off_enum["choices"][0]["finish_reason"] = "done"
    wrong.append((off_enum, "at /choices/0/finish_reason: 'done' is not one of"))
    for instance, expected in wrong:
        (found,) = problems(chat, instance)
        assert expected in found, found
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "usage": None}
    chunk["choices"] = [{"index": 0, "delta": {"content": "x"}, "logprobs": None, "finish_reason": None}]
    assert problems(check("CreateChatCompletionStreamResponse"), chunk) == []


# ---- servers and raw requests ----------------------------------------------------------------------------------

KEY, LIMITED = "sk-test-schema-0123456789", "sk-test-limited-0123456789"
FAULT = "§"  # the plain server's engine fails a request whose prompt holds this text's first token (a test hook)
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}, "days": {"type": "integer"}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}
TOOLS = [{"type": "function", "function": WEATHER}]
HERMES_CALL = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [12]\}\}\n</tool_call>'
)
THOUGHT = r"<think>\nhmm, (rain|sun)\n</think>\n\n"


@pytest.fixture(scope="module")
def plain(tiny_llama_dir, tmp_path_factory):
    """No parsers; keys from a file (one allowed a request a minute), and a hook that fails a request midway."""
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    limited = {"name": "limited", "sha256": sha(LIMITED), "requests_per_minute": 1}
    write(path, toml_keys({"name": "user", "sha256": sha(KEY)}, limited))
    fault_token = AutoTokenizer.from_pretrained(tiny_llama_dir).encode(FAULT, add_special_tokens=False)[0]
    s = Server(tiny_llama_dir, "--max-model-len", "512", auth=("--api-keys-file", str(path)), fault_token=fault_token)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def agent(tiny_llama_dir):
    """Tool calls read from the text (hermes) and a reply thinking from its start until </think> (deepseek_r1)."""
    flags = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "deepseek_r1")
    s = Server(tiny_llama_dir, "--max-model-len", "512", *flags, auth=("--api-key", KEY))
    yield s
    s.stop()


def headers(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def post(server: Server, path: str, body: dict, key: str = KEY) -> tuple[int, dict]:
    reply = httpx.post(server.url + path, json=body, headers=headers(key), timeout=60)
    return reply.status_code, reply.json()


def stream(server: Server, path: str, body: dict) -> list[tuple[str | None, str]]:
    """A stream's events as (event name, data), after checking its status and Content-Type."""
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, headers=headers(), timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
        text = r.read().decode()
    assert text.endswith("\n\n")
    events = []
    for block in text[:-2].split("\n\n"):
        name, data = None, []
        for line in block.split("\n"):
            field, _, value = line.partition(": ")
            if field == "event":
                name = value
            else:
                assert field == "data", block
                data.append(value)
        events.append((name, "\n".join(data)))
    return events


def data_stream(server: Server, path: str, body: dict) -> list[dict]:
    """A completions or chat stream's chunks (its `data:` lines, which end with [DONE])."""
    events = stream(server, path, body)
    assert events[-1] == (None, "[DONE]") and all(name is None for name, _ in events)
    return [json.loads(data) for _, data in events[:-1]]


# ---- completions -------------------------------------------------------------------------------------------------

COMPLETIONS = {
    "n=2 with logprobs": dict(prompt="hi there", max_tokens=6, n=2, temperature=1.0, seed=1, logprobs=2),
    "echo with logprobs": dict(prompt="hi there", max_tokens=4, echo=True, logprobs=2),
    "the prompt alone": dict(prompt="hi there", max_tokens=0, echo=True, logprobs=1),
    "two prompts": dict(prompt=["one", [5, 6, 7]], max_tokens=3),
    "a stop string": dict(prompt="hi", max_tokens=20, guided_regex="one two three", stop=["two"]),
}


@pytest.mark.parametrize("case", COMPLETIONS)
def test_completions_whole_and_streamed(plain, case):
    body = {"model": plain.model, "temperature": 0, **COMPLETIONS[case]}
    status, whole = post(plain, "/v1/completions", body)
    assert status == 200, whole
    assert_valid("CreateCompletionResponse", whole)
    chunks = data_stream(plain, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    for chunk in chunks:
        assert_valid("completion chunk", chunk)
    assert chunks[-1]["usage"] == whole["usage"]


def test_prompt_logprobs_on_a_completion(plain):
    body = {"model": plain.model, "prompt": "hi there", "max_tokens": 2, "prompt_logprobs": 1}
    status, whole = post(plain, "/v1/completions", body)
    assert status == 200 and whole["choices"][0]["prompt_logprobs"][0] is None
    assert_valid("CreateCompletionResponse", whole)


# ---- chat completions --------------------------------------------------------------------------------------------

FORCED = dict(tools=TOOLS, tool_choice="required", max_tokens=80, temperature=1.0, seed=3)
CHATS = {
    "n=2": ("plain", dict(n=2, temperature=1.0, seed=1)),
    "logprobs": ("plain", dict(logprobs=True, top_logprobs=3)),
    "a stop string": ("plain", dict(guided_regex="one two three", stop=["two"], max_tokens=20)),
    "required tool calls with logprobs": ("plain", dict(FORCED, logprobs=True, top_logprobs=1)),
    "a named tool": (
        "plain",
        dict(FORCED, tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False),
    ),
    "reasoning only": ("agent", dict()),
    "reasoning, content and a call": (
        "agent",
        dict(tools=TOOLS, guided_regex=THOUGHT + r"It is (rain|sun)\. " + HERMES_CALL, max_tokens=120),
    ),
    "a call alone, read by the parser": ("agent", dict(tools=TOOLS, guided_regex=HERMES_CALL, max_tokens=80)),
}


@pytest.mark.parametrize("case", CHATS)
def test_chat_whole_and_streamed(request, case):
    fixture, extra = CHATS[case]
    server = request.getfixturevalue(fixture)
    body = {"model": server.model, "messages": ASK, "max_tokens": 10, "temperature": 0, **extra}
    status, whole = post(server, "/v1/chat/completions", body)
    assert status == 200, whole
    assert_valid("CreateChatCompletionResponse", whole)
    chunks = data_stream(server, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    for chunk in chunks:
        assert_valid("CreateChatCompletionStreamResponse", chunk)
    assert chunks[-1]["usage"] == whole["usage"]
    for chunk in data_stream(server, "/v1/chat/completions", body):  # (no usage asked for: none sent)
        assert "usage" not in chunk
        assert_valid("CreateChatCompletionStreamResponse", chunk)


def test_a_reply_that_only_thought_has_null_content(agent):
    body = {"model": agent.model, "messages": ASK, "max_tokens": 8, "temperature": 0}
    message = post(agent, "/v1/chat/completions", body)[1]["choices"][0]["message"]
    assert message["content"] is None and message["reasoning_content"] and message["refusal"] is None


def test_prompt_logprobs_on_a_chat_reply(agent):
    body = {"model": agent.model, "messages": ASK, "max_tokens": 2, "prompt_logprobs": 1}
    status, whole = post(agent, "/v1/chat/completions", body)
    assert status == 200 and whole["prompt_logprobs"][0] is None
    assert_valid("CreateChatCompletionResponse", whole)


# ---- the Responses API -------------------------------------------------------------------------------------------

ONE_OF_TWO = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"], "additionalProperties": False}
RESPONSES = {
    "cut short by max_output_tokens": ("plain", dict(instructions="Be brief.", metadata={"user": "u1"})),
    "a JSON reply, completed": (
        "plain",
        dict(text={"format": {"type": "json_schema", "name": "pick", "schema": ONE_OF_TWO}}, max_output_tokens=40),
    ),
    "function calls": (
        "plain",
        dict(
            tools=[{"type": "function", **WEATHER}],
            tool_choice="required",
            temperature=1.0,
            seed=3,
            max_output_tokens=120,
        ),
    ),
    "a named call cut short": (
        "plain",
        dict(tools=[{"type": "function", **WEATHER}], tool_choice={"type": "function", "name": "get_weather"}),
    ),
    "a conversation with a call and its output": (
        "agent",
        dict(
            input=[
                {"role": "user", "content": [{"type": "input_text", "text": "Weather in Rome?"}]},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Rome"}'},
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            ],
            tools=[{"type": "function", "strict": True, **WEATHER}],
        ),
    ),
    "reasoning": ("agent", dict()),
    "reasoning, a message and a call": (
        "agent",
        dict(
            tools=[{"type": "function", **WEATHER}],
            guided_regex=THOUGHT + r"It is (rain|sun)\. " + HERMES_CALL,
            max_output_tokens=120,
        ),
    ),
}


@pytest.mark.parametrize("case", RESPONSES)
def test_responses_whole_and_streamed(request, case):
    fixture, extra = RESPONSES[case]
    server = request.getfixturevalue(fixture)
    body = {"model": server.model, "input": "Hello there", "max_output_tokens": 10, "temperature": 0, **extra}
    status, whole = post(server, "/v1/responses", body)
    assert status == 200, whole
    assert_valid("Response", whole)
    events = stream(server, "/v1/responses", body)
    for number, (name, data) in enumerate(events):
        event = json.loads(data)
        assert name == event["type"] and event["sequence_number"] == number
        assert event["type"] in EVENTS, f"{event['type']} is not an event of the spec's ResponseStreamEvent vendored"
        assert_valid(EVENTS[event["type"]], event)
    assert json.loads(events[-1][1])["response"]["status"] == whole["status"]


def test_reasoning_a_message_and_a_call_are_three_items_in_turn(agent):
    body = {"model": agent.model, "input": "Weather?", "max_output_tokens": 120, "temperature": 0}
    body.update(RESPONSES["reasoning, a message and a call"][1])
    status, whole = post(agent, "/v1/responses", body)
    assert [item["type"] for item in whole["output"]] == ["reasoning", "message", "function_call"]
    events = [json.loads(data) for _, data in stream(agent, "/v1/responses", body)]
    added = [(e["output_index"], e["item"]["type"]) for e in events if e["type"] == "response.output_item.added"]
    assert added == [(0, "reasoning"), (1, "message"), (2, "function_call")]


def test_the_done_event_of_a_call_names_its_function(plain):
    body = {"model": plain.model, "input": "Weather?", "tools": [{"type": "function", **WEATHER}]}
    body.update(tool_choice="required", max_output_tokens=120, parallel_tool_calls=False)
    events = [json.loads(data) for _, data in stream(plain, "/v1/responses", body)]
    (done,) = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    (item,) = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done["name"] == item["name"] == "get_weather" and done["arguments"] == item["arguments"]


def test_usage_counts_the_prompt_tokens_the_prefix_cache_served(plain):
    body = {"model": plain.model, "input": "A prompt long enough to fill a block or two of the cache. " * 2}
    body.update(max_output_tokens=2)
    first, second = (post(plain, "/v1/responses", body)[1]["usage"] for _ in range(2))
    assert first["input_tokens"] == second["input_tokens"] >= 32
    assert second["input_tokens_details"]["cached_tokens"] >= 16  # (whole blocks: 16 tokens each)
    assert second["input_tokens_details"]["cache_write_tokens"] == 0


# ---- models and errors -------------------------------------------------------------------------------------------


def test_models(plain):
    listed = httpx.get(plain.url + "/v1/models", headers=headers()).json()
    assert_valid("ListModelsResponse", listed)
    card = httpx.get(plain.url + "/v1/models/" + plain.model, headers=headers()).json()
    assert_valid("Model", card)


CHAT, COMPLETE, RESPOND = "/v1/chat/completions", "/v1/completions", "/v1/responses"
ERRORS = {
    "a body that is not JSON": ("POST", CHAT, b"{not json", {}, 400),
    "messages of the wrong kind": ("POST", CHAT, {"messages": "hi"}, {}, 400),
    "a context overflow": ("POST", CHAT, {"messages": ASK, "max_tokens": 10_000}, {}, 400),
    "a bad tool": ("POST", CHAT, {"messages": ASK, "tools": [{"type": "function"}]}, {}, 400),
    "a bad response_format": ("POST", CHAT, {"messages": ASK, "response_format": {"type": "xml"}}, {}, 400),
    "a bad prompt": ("POST", COMPLETE, {"prompt": {"a": 1}}, {}, 400),
    "a bad input": ("POST", RESPOND, {"input": 3}, {}, 400),
    "store: true": ("POST", RESPOND, {"input": "hi", "store": True}, {}, 400),
    "a tool the Responses API lacks": ("POST", RESPOND, {"input": "hi", "tools": [{"type": "web_search"}]}, {}, 400),
    "no API key": ("POST", CHAT, {"messages": ASK}, {"Authorization": ""}, 401),
    "a wrong API key": ("POST", CHAT, {"messages": ASK}, {"Authorization": "Bearer sk-wrong"}, 401),
    "an unknown model": ("POST", CHAT, {"model": "nope", "messages": ASK}, {}, 404),
    "an unknown model card": ("GET", "/v1/models/nope", None, {}, 404),
    "an unknown path": ("GET", "/v1/nothing", None, {}, 404),
    "the wrong method": ("GET", CHAT, None, {}, 405),
    "a body too large": ("POST", COMPLETE, b'{"prompt": "' + b"x" * (17 << 20) + b'"}', {}, 413),
    "an unknown encoding": ("POST", CHAT, b"{}", {"Content-Encoding": "br"}, 415),
    "a header too long": ("GET", "/v1/models", None, {"X-Long": "x" * 20_000}, 400),
}


@pytest.mark.parametrize("case", ERRORS)
def test_error_bodies(plain, case):
    method, path, body, extra_headers, expected = ERRORS[case]
    if isinstance(body, dict):
        body = json.dumps({"model": plain.model, **body}).encode()
    sent = {"Content-Type": "application/json", **headers(), **extra_headers}
    reply = httpx.request(method, plain.url + path, content=body, headers=sent, timeout=60)
    assert reply.status_code == expected, reply.text[:300]
    assert reply.headers["content-type"].startswith("application/json")
    assert_valid("ErrorResponse", reply.json())


def test_a_rate_limit_error(plain):
    body = {"model": plain.model, "prompt": "hi", "max_tokens": 1}
    assert post(plain, COMPLETE, body, key=LIMITED)[0] == 200
    status, error = post(plain, COMPLETE, body, key=LIMITED)
    assert status == 429
    assert_valid("ErrorResponse", error)


def test_a_failure_midway_through_a_stream(plain):
    """A request the engine fails (a test hook) once its stream has begun: a chat stream ends with an error object,
    then [DONE]; a Responses stream with its error event."""
    messages = [{"role": "user", "content": FAULT}]
    chunks = data_stream(plain, CHAT, {"model": plain.model, "messages": messages, "max_tokens": 4})
    assert len(chunks) >= 2 and "error" in chunks[-1]
    assert_valid("ErrorResponse", chunks[-1])
    for chunk in chunks[:-1]:
        assert_valid("CreateChatCompletionStreamResponse", chunk)
    events = [json.loads(data) for _, data in stream(plain, RESPOND, {"model": plain.model, "input": FAULT})]
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "error"
    for event in events:
        assert_valid(EVENTS[event["type"]], event)
