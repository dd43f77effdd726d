"""The `gemma4` tool-call parser on replies written as Gemma 4's chat template writes calls (bare keys, strings
between `<|"|>` tokens, nested objects and lists): the calls and content a whole reply holds, written out by hand, and
the same again streamed at every chunking (a stream's arguments only grow, and end as the whole reply's)."""

from __future__ import annotations

import json

import pytest

from kiln.engine.config import TOOL_CALL_PARSERS
from kiln.engine.serving.tool_calls import ToolCallStream
from kiln.engine.serving.tool_parsers import PARSERS

Q = '<|"|>'
TOOLS = {name: {"name": name, "parameters": {"type": "object"}} for name in ("get_weather", "search", "noop")}


def call(name: str, arguments: str) -> str:
    return f"<|tool_call>call:{name}{{{arguments}}}<tool_call|>"


# (reply, content expected, calls expected as (name, arguments))
CASES = [
    (call("get_weather", f"city:{Q}Paris{Q},days:3"), None, [("get_weather", {"city": "Paris", "days": 3})]),
    (  # prose before, two calls one after the other
        "Both, then.\n" + call("get_weather", f"city:{Q}Paris{Q}") + call("get_weather", f"city:{Q}Oslo{Q}"),
        "Both, then.\n",
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})],
    ),
    (  # every kind of value; a string holding the notation's own punctuation
        call(
            "search",
            f"query:{Q}a, b: {{c}} [d]{Q},limit:10,ratio:-0.5e2,exact:true,fuzzy:false,none:null,"
            f"filters:{{lang:{Q}fr{Q},year:{{from:1990,to:2000}}}},tags:[{Q}x{Q},{Q}y{Q},[1,2],{{k:{Q}v{Q}}}],"
            f"mode:fast",
        ),
        None,
        [
            (
                "search",
                {
                    "query": "a, b: {c} [d]",
                    "limit": 10,
                    "ratio": -50.0,
                    "exact": True,
                    "fuzzy": False,
                    "none": None,
                    "filters": {"lang": "fr", "year": {"from": 1990, "to": 2000}},
                    "tags": ["x", "y", [1, 2], {"k": "v"}],
                    "mode": "fast",
                },
            )
        ],
    ),
    (call("noop", ""), None, [("noop", {})]),  # no arguments: {}
    (  # spaces and newlines about the punctuation
        call("get_weather", f" city : {Q}New\nYork{Q} ,\n days : 2 "),
        None,
        [("get_weather", {"city": "New\nYork", "days": 2})],
    ),
    ("No tools: 3 < 4 and {braces}.", "No tools: 3 < 4 and {braces}.", []),
    (call("delete_everything", f"now:{Q}yes{Q}"), call("delete_everything", f"now:{Q}yes{Q}"), []),  # not offered
    ("<|tool_call>not a call<tool_call|>", "<|tool_call>not a call<tool_call|>", []),  # markup that is no call
    (  # cut short by max_tokens inside a string: the call as far as it went
        "<|tool_call>call:get_weather{city:" + Q + "Par",
        None,
        [("get_weather", '{"city":"Par')],
    ),
]


def parser():
    p = PARSERS["gemma4"]()
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
            entry = calls.setdefault(d["index"], {"name": None, "arguments": ""})
            if "id" in d:
                assert entry["name"] is None, "a call's name comes once"
                entry["name"] = d["function"]["name"]
            entry["arguments"] += d["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


def chunkings(text: str):
    for size in (1, 2, 3, 5, 8, 13):
        yield [text[i : i + size] for i in range(0, len(text), size)]
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]


@pytest.mark.parametrize("reply,content,expected", CASES, ids=range(len(CASES)))
def test_a_reply_whole_and_streamed(reply, content, expected):
    whole_content, whole_calls = ToolCallStream(parser()).message(reply)
    assert whole_content == content
    assert [(c["function"]["name"], arguments(c["function"]["arguments"])) for c in whole_calls] == expected
    for pieces in chunkings(reply):
        got_content, got_calls = streamed(pieces)
        assert got_content == (content or ""), pieces
        assert [(c["name"], c["arguments"]) for c in got_calls] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in whole_calls
        ], pieces


def test_a_bare_value_streams_once_it_has_ended():
    """`tru` may become `true` or `trunk`: nothing of a bare value is sent before the punctuation after it."""
    p = parser()
    assert p.scan("<|tool_call>call:search{exact:tru", False).calls[0].arguments == '{"exact":'
    assert p.scan("<|tool_call>call:search{exact:true,", False).calls[0].arguments == '{"exact":true'
    assert p.scan(f"<|tool_call>call:search{{q:{Q}ab<|", False).calls[0].arguments == '{"q":"ab'


def test_the_parser_is_registered_under_vllms_name():
    assert "gemma4" in TOOL_CALL_PARSERS and PARSERS["gemma4"].needs_special_tokens
