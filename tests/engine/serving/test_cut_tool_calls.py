"""A forced tool call cut short by max_tokens, as vLLM returns it: the call with its partial arguments and
finish_reason "length" — on chat whole and streamed (the same deltas, no text as content), on the Responses API
(an incomplete function_call item in an incomplete response), and LangChain's bind_tools(tool_choice=NAME) gets
the call."""

from __future__ import annotations

import pytest

from helpers.server import API_KEY, Server

# a note of at least 300 characters: no reply of a few dozen tokens can finish the call
NOTE = {
    "type": "function",
    "function": {
        "name": "save_note",
        "parameters": {
            "type": "object",
            "properties": {"note": {"type": "string", "minLength": 300}},
            "required": ["note"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "Save a note."}]
CHOICES = ["required", {"type": "function", "function": {"name": "save_note"}}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    s = Server(tiny_llama_dir, "--max-model-len", "512")
    yield s
    s.stop()


@pytest.mark.parametrize("tool_choice", CHOICES, ids=["required", "named"])
def test_a_cut_forced_call_is_the_call_with_its_partial_arguments(server, tool_choice):
    client = server.client()
    kw = dict(model=server.model, messages=ASK, tools=[NOTE], tool_choice=tool_choice, seed=3, max_tokens=80)
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "save_note" and call.id.startswith("call_")
    assert call.function.arguments.startswith('{"note": "') or call.function.arguments.startswith('{"note":"')
    calls, content, reason = {}, "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"name": d.function.name, "arguments": ""})
            entry["arguments"] += d.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    assert content == "" and reason == "length"
    assert list(calls.values()) == [{"name": "save_note", "arguments": call.function.arguments}]


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "name": "save_note"}], ids=["required", "named"]
)
def test_the_responses_api_gives_the_cut_call_as_an_incomplete_item(server, tool_choice):
    client = server.client()
    tool = {"type": "function", **NOTE["function"]}
    kw = dict(model=server.model, input="Save a note.", tools=[tool], tool_choice=tool_choice, max_output_tokens=80)
    response = client.responses.create(**kw, extra_body={"seed": 3})
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    (item,) = response.output
    assert item.type == "function_call" and item.name == "save_note" and item.status == "incomplete"
    assert item.arguments.startswith('{"note":')
    with client.responses.stream(**kw, extra_body={"seed": 3}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert not any(e.type == "response.output_text.delta" for e in events)
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (streamed,) = final.output
    assert deltas == streamed.arguments == item.arguments and streamed.status == "incomplete"


def test_langchain_bind_tools_with_a_named_choice_gets_the_cut_call(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=server.model, base_url=server.url + "/v1", api_key=API_KEY, max_tokens=80, seed=3)
    message = llm.bind_tools([NOTE], tool_choice="save_note").invoke("Save a note.")
    assert message.response_metadata["finish_reason"] == "length"
    # (its arguments are not JSON yet: LangChain lists the call among the invalid ones, with its name and text)
    (call,) = message.tool_calls or message.invalid_tool_calls
    assert call["name"] == "save_note"
