"""Each tool-call format on replies written as models write them: the calls and content a whole reply holds
(written out by hand), and the same again when the reply streams in, character by character and cut in two at
every place, with nothing of the markup in the content."""

from __future__ import annotations

import json

import pytest

from kiln.engine.serving.tool_calls import ToolCallStream
from kiln.engine.serving.tool_parsers import PARSERS, NamedParser, RequiredParser

WEATHER = ("get_weather", {"city": "Paris", "unit": "celsius"})
TIME = ("get_time", {"tz": "Europe/Paris"})

# (parser, reply, content expected, calls expected as (name, arguments: a dict, or the raw text when it is not JSON))
CASES = [
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
        None,
        [WEATHER],
    ),
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
        "Let me check.\n",
        [WEATHER, TIME],
    ),
    ("hermes", "The weather is <b>nice</b> today, 3 < 4.", "The weather is <b>nice</b> today, 3 < 4.", []),
    (
        "hermes",
        '<tool_call>\n{"name": "run", "arguments": {"code": "print(\\"}{\\")", "n": [1, {"a": 2}]}}\n</tool_call>',
        None,
        [("run", {"code": 'print("}{")', "n": [1, {"a": 2}]})],
    ),
    ("hermes", '<tool_call>\n{"name": "now", "arguments": {}}', None, [("now", {})]),  # stopped before closing
    (  # broken after the name (a stream has begun the call): the call as far as it went, never taken back
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
        None,
        [("get_weather", '{"city": }')],
    ),
    (  # one broken block among good ones: the others are calls still, the broken one as far as it went
        "hermes",
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"]}\n</tool_call>\n'
        '<tool_call>\n{"oops"}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
        None,
        [TIME, ("get_weather", '{"city": "Paris"]'), WEATHER],
    ),
    (  # broken before any name: content, whole
        "hermes",
        'Sure.<tool_call>\n{"name" get_weather}\n</tool_call>',
        'Sure.<tool_call>\n{"name" get_weather}\n</tool_call>',
        [],
    ),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None, [WEATHER]),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
        '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}',
        None,
        [WEATHER, TIME],
    ),
    (  # calls on lines of their own, each after its own tag
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}\n'
        '<|python_tag|>{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}',
        None,
        [WEATHER, TIME],
    ),
    (  # prose before (content) and after (passed over); a brace of prose and an object that is no call before
        "llama3_json",
        'In {short}, see {"a": 1}: {"name": "get_time", "parameters": {"tz": "Europe/Paris"}} I used {get_time}.',
        'In {short}, see {"a": 1}: ',
        [TIME],
    ),
    ("llama3_json", "Paris is sunny {mostly}.", "Paris is sunny {mostly}.", []),
    ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', []),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
        '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]',
        None,
        [WEATHER, TIME],
    ),
    (
        "mistral",
        'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time[ARGS]'
        '{"tz": "Europe/Paris"}',
        "Sure. ",
        [WEATHER, TIME],
    ),
    (  # v11 on, read with special tokens skipped: [ARGS] gone
        "mistral",
        '[TOOL_CALLS]get_weather{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time{"tz": "Europe/Paris"}',
        None,
        [WEATHER, TIME],
    ),
    ("mistral", "A list [1, 2] of [TOOLS] things.", "A list [1, 2] of [TOOLS] things.", []),
    ("pythonic", "[get_weather(city='Paris', unit=\"celsius\"), get_time(tz='Europe/Paris')]", None, [WEATHER, TIME]),
    ("pythonic", '<|python_start|>[get_weather(city="Paris", unit="celsius")]<|python_end|>', None, [WEATHER]),
    (
        "pythonic",
        '[search(query="a)b", filters={"x": [1, 2]}, limit=3)]',
        None,
        [("search", {"query": "a)b", "filters": {"x": [1, 2]}, "limit": 3})],
    ),
    ("pythonic", "[1, 2, 3] is a list.", "[1, 2, 3] is a list.", []),
    ("pythonic", "Hello (world)!", "Hello (world)!", []),
]


def arguments(text: str):
    """A call's arguments as a dict, or as the raw text when that is not JSON (a call whose markup broke)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def streamed(parser, pieces: list[str]):
    """Feed the reply piece by piece; the content and calls as a client would put them together."""
    stream = ToolCallStream(parser)
    content, calls, names_sent = "", {}, []
    text = ""
    for k, piece in enumerate(pieces):
        text += piece
        delta, deltas = stream.update(text, final=k == len(pieces) - 1)
        content += delta
        for d in deltas:
            call = calls.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in d:
                assert call["id"] is None, "a call's id and name come once"
                call["id"], call["name"] = d["id"], d["function"]["name"]
                names_sent.append(call["name"])
            call["arguments"] += d["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[i] for i in range(len(calls))], stream


def splits(text: str):
    yield list(text)
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]
    yield [text]


@pytest.mark.parametrize("name,reply,content,expected", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_a_reply_whole_and_streamed_in_every_split(name, reply, content, expected):
    parser = PARSERS[name]()
    whole_content, whole_calls = ToolCallStream(parser).message(reply)
    assert whole_content == content
    assert [(c["function"]["name"], arguments(c["function"]["arguments"])) for c in whole_calls] == expected
    for pieces in splits(reply):
        got_content, got_calls, stream = streamed(parser, pieces)
        assert got_content == (content or ""), pieces
        assert [(c["name"], arguments(c["arguments"])) for c in got_calls] == expected, pieces
        # the message at the end: the same ids the stream sent, the same argument text
        final_content, final_calls = stream.message(reply)
        assert [c["id"] for c in final_calls] == [c["id"] for c in got_calls]
        assert [c["function"]["arguments"] for c in final_calls] == [c["arguments"] for c in got_calls]


def test_constrained_replies_read_as_calls():
    """What `tool_choice` required and named constrain the reply to."""
    reply = '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, {"name": "get_time", '
    reply += '"parameters": {"tz": "Europe/Paris"}}]'
    for pieces in splits(reply):
        _, calls, _ = streamed(RequiredParser(), pieces)
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [WEATHER, TIME]
    reply = '{"city": "Paris", "unit": "celsius"}'
    for pieces in splits(reply):
        content, calls, _ = streamed(NamedParser("get_weather"), pieces)
        assert content == "" and [(c["name"], json.loads(c["arguments"])) for c in calls] == [WEATHER]


def test_one_call_only_when_parallel_calls_are_off():
    reply = CASES[1][1]
    content, calls = ToolCallStream(PARSERS["hermes"](), parallel=False).message(reply)
    assert [c["function"]["name"] for c in calls] == ["get_weather"]


def test_the_parsers_are_the_ones_the_server_offers():
    from kiln.engine.config import TOOL_CALL_PARSERS

    assert set(PARSERS) == set(TOOL_CALL_PARSERS)


def test_a_long_streamed_call_is_scanned_a_bounded_number_of_times():
    """A call of 8,000 tokens' arguments streamed token by token: its deltas join to what the whole reply's parse
    says, and the text is scanned a few hundred times, not once a token (each scan reads it all)."""
    parser = PARSERS["hermes"]()
    scans = 0
    scan = parser.scan

    def counted(text, final):
        nonlocal scans
        scans += 1
        return scan(text, final)

    parser.scan = counted
    stream = ToolCallStream(parser)
    reply = '<tool_call>\n{"name": "write", "arguments": {"text": "' + "ab " * 8000 + '"}}\n</tool_call>'
    streamed, step = "", 3
    for end in range(step, len(reply) + step, step):
        _, deltas = stream.update(reply[:end], end >= len(reply))
        streamed += "".join(d["function"]["arguments"] for d in deltas)
    whole = PARSERS["hermes"]().scan(reply, True).calls[0]
    assert json.loads(streamed) == json.loads(whole.arguments) == {"text": "ab " * 8000}
    assert scans < 400, scans
