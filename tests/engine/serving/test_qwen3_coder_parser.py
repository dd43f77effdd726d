"""The `qwen3_coder` tool-call parser (Qwen3-Coder, Qwen3.5, Qwen3.6) on replies written as those models write them:
the calls and content a whole reply holds (written out by hand, values typed by the tool's schema as vLLM types
them), the same again streamed at several chunkings, and end to end through the official `openai` client."""

from __future__ import annotations

import json

import pytest

from kiln.engine.serving.schema_values import schema_value
from kiln.engine.serving.tool_calls import ToolCallStream
from kiln.engine.serving.tool_parsers import PARSERS

from helpers.server import Server

WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"enum": ["C", "F"]}},
        "required": ["city"],
    },
}
EVERY_TYPE = {
    "name": "typed",
    "parameters": {
        "type": "object",
        "properties": {
            "text": {"type": "string"},
            "count": {"type": "integer"},
            "ratio": {"type": "number"},
            "flag": {"type": "boolean"},
            "options": {"type": "object"},
            "items": {"type": "array", "items": {"type": "integer"}},
            "nothing": {"type": "null"},
            "maybe": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            "either": {"type": ["number", "string"]},
        },
    },
}
WRITE = {
    "name": "write_file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}},
}
TOOLS = {f["name"]: f for f in (WEATHER, EVERY_TYPE, WRITE)}


def call(name: str, **parameters: str) -> str:
    """A call as the models write it: every tag on a line of its own, a value between newlines."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


# (reply, content expected, calls expected as (name, arguments))
CASES = [
    (call("get_weather", city="Paris", days="3"), None, [("get_weather", {"city": "Paris", "days": 3})]),
    (  # prose before, two calls
        "Let me look both up.\n\n" + call("get_weather", city="Paris") + "\n" + call("get_weather", city="Oslo"),
        "Let me look both up.\n\n",
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})],
    ),
    (  # a multi-line value keeps its inner newlines and indentation, loses one newline at each end
        call("write_file", path="a.py", content="def f():\n    return 1\n"),
        None,
        [("write_file", {"path": "a.py", "content": "def f():\n    return 1\n"})],
    ),
    (  # every schema type, and values that do not fit theirs (kept as text)
        call(
            "typed",
            text="42",
            count="7",
            ratio="0.25",
            flag="False",
            options='{"deep": [1, 2]}',
            items="[1, 2, 3]",
            nothing="null",
            maybe="None",
            either="twelve",
        )
        + call("typed", count="seven", ratio="inf", flag="yes", options="[1]", items="{'a': 1}", maybe="5"),
        None,
        [
            (
                "typed",
                {
                    "text": "42",
                    "count": 7,
                    "ratio": 0.25,
                    "flag": False,
                    "options": {"deep": [1, 2]},
                    "items": [1, 2, 3],
                    "nothing": None,
                    "maybe": None,
                    "either": "twelve",
                },
            ),
            (
                "typed",
                {"count": "seven", "ratio": "inf", "flag": "yes", "options": "[1]", "items": "{'a': 1}", "maybe": 5},
            ),
        ],
    ),
    (  # a parameter the tool does not have: its value as text
        call("get_weather", city="Rome", country="IT", zip="00100"),
        None,
        [("get_weather", {"city": "Rome", "country": "IT", "zip": "00100"})],
    ),
    (  # values on the tags' lines, no newlines at all
        "<tool_call><function=get_weather><parameter=city>Lima</parameter><parameter=days>2</parameter></function>"
        "</tool_call>",
        None,
        [("get_weather", {"city": "Lima", "days": 2})],
    ),
    (  # code that writes these very tags, inside a value
        call("write_file", path="t.txt", content="<parameter=x>\n1\n</parameter>\nthen </parameter> alone"),
        None,
        [("write_file", {"path": "t.txt", "content": "<parameter=x>\n1\n</parameter>\nthen </parameter> alone"})],
    ),
    (  # a close tag left out: the value ends where the tool's next parameter opens
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nDallas\n<parameter=days>\n2\n</parameter>\n"
        "</function>\n</tool_call>",
        None,
        [("get_weather", {"city": "Dallas", "days": 2})],
    ),
    (  # <function=...> without <tool_call>, and prose after the calls (passed over, as vLLM does)
        "Checking.\n<function=get_weather>\n<parameter=city>\nKyiv\n</parameter>\n</function>\nDone, wait for it.",
        "Checking.\n",
        [("get_weather", {"city": "Kyiv"})],
    ),
    (  # cut short by max_tokens inside a value: the call as far as it went, the value cut too
        "Sure.\n<tool_call>\n<function=write_file>\n<parameter=path>\nb.md\n</parameter>\n<parameter=content>\n# Ti",
        "Sure.\n",
        [("write_file", '{"path": "b.md", "content": "# Ti"')],
    ),
    (  # cut short before the name was whole: content
        "Sure.\n<tool_call>\n<function=get_wea",
        "Sure.\n<tool_call>\n<function=get_wea",
        [],
    ),
    ("No tools needed: 3 < 4 and <b>bold</b>.", "No tools needed: 3 < 4 and <b>bold</b>.", []),
    (  # a tool not offered: content
        call("delete_everything", now="yes"),
        call("delete_everything", now="yes"),
        [],
    ),
]


def parser():
    p = PARSERS["qwen3_coder"]()
    p.offer(TOOLS)
    return p


def arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text  # (a call cut short: its arguments as far as they went)


def streamed(pieces: list[str]):
    stream = ToolCallStream(parser())
    content, calls, text = "", {}, ""
    for k, piece in enumerate(pieces):
        text += piece
        delta, deltas = stream.update(text, final=k == len(pieces) - 1)
        content += delta
        for d in deltas:
            entry = calls.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in d:
                assert entry["id"] is None, "a call's id and name come once"
                entry["id"], entry["name"] = d["id"], d["function"]["name"]
            entry["arguments"] += d["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)], stream


def chunkings(text: str):
    for size in (1, 2, 3, 5, 8, 13, 64):
        yield [text[i : i + size] for i in range(0, len(text), size)]
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]


@pytest.mark.parametrize("reply,content,expected", CASES, ids=range(len(CASES)))
def test_a_reply_whole_and_streamed(reply, content, expected):
    whole_content, whole_calls = ToolCallStream(parser()).message(reply)
    assert whole_content == content
    assert [(c["function"]["name"], arguments(c["function"]["arguments"])) for c in whole_calls] == expected
    for pieces in chunkings(reply):
        got_content, got_calls, stream = streamed(pieces)
        assert got_content == (content or ""), pieces
        assert [(c["name"], c["arguments"]) for c in got_calls] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in whole_calls
        ], pieces
        final_content, final_calls = stream.message(reply)  # the ids the stream sent
        assert [c["id"] for c in final_calls] == [c["id"] for c in got_calls]


def test_a_call_streams_a_parameter_at_a_time():
    reply = call("get_weather", city="Paris", days="3")
    sent = []
    stream = ToolCallStream(parser())
    for end in range(1, len(reply) + 1):
        _, deltas = stream.update(reply[:end], end == len(reply))
        sent += [d["function"]["arguments"] for d in deltas if d["function"]["arguments"]]
    # (a value's end is sure once the tag after its </parameter> shows: the last one's comes with </function>)
    assert sent == ["{", '"city": "Paris"', ', "days": 3}']


def test_values_by_schema_as_vllm_types_them():
    assert schema_value("3.0", {"type": "number"}) == 3 and schema_value("1e3", {"type": "float"}) == 1000
    assert schema_value("12", {"type": "string"}) == "12" and schema_value("null", {"type": "string"}) == "null"
    assert schema_value("null", {"type": ["string", "null"]}) is None
    assert schema_value("TRUE", {"type": "boolean"}) is True
    assert schema_value("[1, NaN]", {"type": "array"}) == "[1, NaN]"  # (not JSON)
    assert schema_value("{'k': {1, 2}}", {"type": "object"}) == "{'k': {1, 2}}"  # (a set: not JSON)
    assert schema_value(" 7 ", {"description": "no type"}) == " 7 "


# ---- through the server -----------------------------------------------------------------------------------

CITY = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
}
# the random model made to write a qwen3_coder call (a regex constrains it), with a multi-line value
CALL_REGEX = (
    r"Checking\.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n(Paris|New\nYork)\n</parameter>\n"
    r"<parameter=days>\n[1-3]\n</parameter>\n</function>\n</tool_call>"
)


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    s = Server(
        tiny_llama_dir, "--max-model-len", "512", "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder"
    )
    yield s
    s.stop()


def test_a_qwen3_coder_call_through_the_openai_client(server):
    client = server.client()
    kw = dict(
        model=server.model,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[CITY],
        seed=4,
        max_tokens=400,
        extra_body={"guided_regex": CALL_REGEX},
    )
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking.\n"
    (whole,) = choice.message.tool_calls
    assert whole.function.name == "get_weather" and whole.id.startswith("call_")
    args = json.loads(whole.function.arguments)
    assert args["city"] in ("Paris", "New\nYork") and args["days"] in (1, 2, 3)  # (an integer, by the schema)
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"name": d.function.name, "arguments": ""})
            entry["arguments"] += d.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    assert content == "Checking.\n" and reason == "tool_calls"
    assert list(calls.values()) == [{"name": "get_weather", "arguments": whole.function.arguments}]


def test_the_cli_takes_qwen3_coder_and_names_it_for_an_unknown_parser(tiny_llama_dir):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "kiln.engine.cli", "serve", str(tiny_llama_dir), "--tool-call-parser", "qwen4"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "qwen3_coder" in done.stderr
