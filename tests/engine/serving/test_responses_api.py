"""POST /v1/responses through the official client's `responses.create` and `responses.stream`, against the same
server's chat endpoint as the reference: the same conversation gives the same greedy text, tool calls come back as
valid function_call items, whole and streamed; what it cannot take is a 400 naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from helpers.server import Server

TIME = {
    "type": "function",
    "name": "get_time",
    "description": "The time in a zone",
    "parameters": {
        "type": "object",
        "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["tz"],
        "additionalProperties": False,
    },
}
GREEDY = dict(temperature=0, max_output_tokens=12, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    s = Server(tiny_llama_dir, "--max-model-len", "512")
    yield s
    s.stop()


def chat_text(server, messages, **kw):
    reply = server.client().chat.completions.create(
        model=server.model, messages=messages, temperature=0, max_tokens=12, extra_body={"ignore_eos": True}, **kw
    )
    return reply.choices[0].message.content, reply.usage


def test_create_is_the_chat_reply_of_the_same_conversation(server):
    client = server.client()
    response = client.responses.create(model=server.model, instructions="Be brief.", input="Hello there", **GREEDY)
    text, usage = chat_text(
        server, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    )
    assert response.output_text == text and response.object == "response" and response.id.startswith("resp_")
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (usage.prompt_tokens, 12)
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"


def test_stream_events_add_up_to_the_response(server):
    client = server.client()
    whole = client.responses.create(model=server.model, input="Hello there", **GREEDY)
    with client.responses.stream(model=server.model, input="Hello there", **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    opening = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert types[:4] == opening
    assert types[-1] == "response.completed" and "response.output_text.done" in types
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_time"}])
def test_function_calls_whole_and_streamed(server, tool_choice):
    client = server.client()
    kw = dict(model=server.model, input="What time is it?", tools=[TIME], tool_choice=tool_choice)
    kw.update(max_output_tokens=100, temperature=1.0, parallel_tool_calls=False)
    for seed in range(5):
        response = client.responses.create(**kw, extra_body={"seed": seed})
        (call,) = response.output
        assert call.type == "function_call" and call.name == "get_time" and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), TIME["parameters"])
        with client.responses.stream(**kw, extra_body={"seed": seed}) as stream:
            deltas = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
            final = stream.get_final_response()
        (streamed,) = final.output
        assert (streamed.name, streamed.arguments, deltas) == (call.name, call.arguments, call.arguments)


def test_function_call_items_in_the_input_are_the_chat_turns(server):
    """A function_call and its function_call_output reach the template as the assistant's tool call and the tool's
    answer: the same greedy text as the chat request written that way."""
    client = server.client()
    items = [
        {"role": "user", "content": "What time is it?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": '{"tz": "UTC"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "12:00"},
    ]
    response = client.responses.create(model=server.model, input=items, tools=[TIME], tool_choice="none", **GREEDY)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}
    messages = [
        {"role": "user", "content": "What time is it?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    chat_tools = [{"type": "function", "function": {k: TIME[k] for k in ("name", "description", "parameters")}}]
    text, _ = chat_text(server, messages, tools=chat_tools, tool_choice="none")
    assert response.output_text == text


def test_text_format_json_schema(server):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    response = server.client().responses.create(
        model=server.model,
        input="Answer in JSON",
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}},
        max_output_tokens=40,
    )
    jsonschema.validate(json.loads(response.output_text), schema)


BAD = [
    ({"input": "hi", "store": True}, "store"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": []}, "input"),
    ({"input": [{"type": "image", "url": "x"}]}, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input"),
    ({"input": "hi", "max_output_tokens": 5000}, "max_output_tokens"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text"),
    ({"input": "hi", "tools": [TIME], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "hi", "tools": [TIME], "tool_choice": "auto"}, "tool_choice"),  # no tool-call parser
]


@pytest.mark.parametrize("fields,param", BAD, ids=range(len(BAD)))
def test_what_it_cannot_take_names_the_field(server, fields, param):
    code, raw = server.post("/v1/responses", {"model": server.model, **fields})
    assert code == 400, raw
    assert json.loads(raw)["error"]["param"] == param


def test_an_unknown_model_is_404(server):
    with pytest.raises(openai.NotFoundError):
        server.client().responses.create(model="nope", input="hi")
