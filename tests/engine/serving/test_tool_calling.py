"""Tool calling end to end, through the official `openai` client against a real server on a tiny random-weight
model: "required" and a named tool_choice always give a valid call to an offered tool, whatever the model (checked
with jsonschema, 100 seeded requests each); "auto" reads the calls the model writes (here a regex makes it write
hermes markup) streamed and whole; what a request can get wrong is a 400 naming the field."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from helpers.server import Server

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                "days": {"type": "integer", "enum": [1, 2, 3]},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_CALL = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [123]\}\}\n</tool_call>'
)


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    s = Server(tiny_llama_dir, "--max-model-len", "512", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def plain_server(tiny_llama_dir):
    s = Server(tiny_llama_dir, "--max-model-len", "512")
    yield s
    s.stop()


def assert_valid_call(call, names=SCHEMAS):
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), names[call.function.name])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_forced_choice_always_gives_a_valid_call(plain_server, tool_choice):
    """No parser needed: the reply is constrained to calls of the offered tools with schema-valid arguments."""
    client = plain_server.client()

    def ask(seed: int):
        return client.chat.completions.create(
            model=plain_server.model,
            messages=ASK,
            tools=TOOLS,
            tool_choice=tool_choice,
            parallel_tool_calls=False,
            temperature=1.0,
            seed=seed,
            max_tokens=200,
        )

    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(ask, range(100)))
    names = SCHEMAS if tool_choice == "required" else {"get_time": SCHEMAS["get_time"]}
    for reply in replies:
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        assert_valid_call(choice.message.tool_calls[0], names)
    assert len({r.choices[0].message.tool_calls[0].function.arguments for r in replies}) > 1  # the seeds differ


def test_required_with_parallel_calls_streams_the_same_calls(plain_server):
    client = plain_server.client()
    kw = dict(model=plain_server.model, messages=ASK, tools=TOOLS, tool_choice="required", seed=3, max_tokens=400)
    whole = client.chat.completions.create(**kw).choices[0]
    if whole.finish_reason == "tool_calls":
        for call in whole.message.tool_calls:
            assert_valid_call(call)
    calls, reason = {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        assert not delta.content
        for d in delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
            entry["arguments"] += d.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    assert reason == whole.finish_reason
    assert [(c["id"].startswith("call_"), c["name"], c["arguments"]) for c in calls.values()] == [
        (True, c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]


def test_auto_reads_the_calls_the_model_writes(server):
    client = server.client()
    kw = dict(model=server.model, messages=ASK, tools=TOOLS, seed=1, extra_body={"guided_regex": HERMES_CALL})
    choice = client.chat.completions.create(**kw).choices[0]  # no tool_choice with tools: "auto"
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert_valid_call(call)
    streamed, content, reason = {}, "", None
    for chunk in client.chat.completions.create(stream=True, tool_choice="auto", **kw):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            entry = streamed.setdefault(d.index, {"name": d.function.name, "arguments": ""})
            entry["arguments"] += d.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    assert content == "" and reason == "tool_calls"  # none of the markup in the content
    assert list(streamed.values()) == [{"name": call.function.name, "arguments": call.function.arguments}]


def test_auto_without_a_call_is_content(server):
    client = server.client()
    reply = client.chat.completions.create(
        model=server.model, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=8, seed=0
    )
    choice = reply.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")


def test_auto_needs_the_server_flags(plain_server):
    client = plain_server.client()
    for kw in ({}, {"tool_choice": "auto"}):  # tools without a tool_choice are "auto"
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=plain_server.model, messages=ASK, tools=TOOLS, **kw)
        assert e.value.body["param"] == "tool_choice" and "--enable-auto-tool-choice" in e.value.body["message"]
    reply = client.chat.completions.create(
        model=plain_server.model, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=4
    )
    assert reply.choices[0].message.tool_calls is None


BAD = [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": 5}}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "none", "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
]


@pytest.mark.parametrize("fields,param", BAD, ids=range(len(BAD)))
def test_bad_tools_name_the_field(server, fields, param):
    code, raw = server.post("/v1/chat/completions", {"messages": ASK, "max_tokens": 2, **fields})
    assert code == 400, raw
    error = json.loads(raw)["error"]
    assert error["param"] == param and error["message"]


@pytest.mark.parametrize("tool_choice", ["required", "get_weather"])
def test_langchain_bind_tools_gets_valid_calls(plain_server, tool_choice):
    """LangChain's ChatOpenAI(...).bind_tools(...), as agents use it: its parsed tool calls are valid calls."""
    from langchain_openai import ChatOpenAI

    from helpers.server import API_KEY

    llm = ChatOpenAI(
        model=plain_server.model, base_url=plain_server.url + "/v1", api_key=API_KEY, temperature=1.0, max_tokens=200
    )
    bound = llm.bind_tools(TOOLS, tool_choice=tool_choice, parallel_tool_calls=False)
    for seed in range(5):
        message = bound.invoke("What is the weather in Paris?", seed=seed)
        (call,) = message.tool_calls
        assert call["name"] in SCHEMAS and (tool_choice == "required" or call["name"] == tool_choice)
        jsonschema.validate(call["args"], SCHEMAS[call["name"]])


def test_auto_tool_choice_without_a_parser_is_one_line_at_start(tiny_llama_dir):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "kiln.engine.cli", "serve", str(tiny_llama_dir), "--enable-auto-tool-choice"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == "kiln: error: --enable-auto-tool-choice needs --tool-call-parser"
