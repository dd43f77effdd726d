"""The Messages API's pieces without a server: a request as the chat request it stands for (hand-written chat bodies
are the reference), errors in Anthropic's shape and statuses, and a reply's content blocks streamed (at every split of
its text, the events folded as the official client folds them) equal to the whole reply's blocks."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jiter import from_json

from kiln.engine.serving.anthropic_api import BlockStream, anthropic_error, content_blocks
from kiln.engine.serving.anthropic_requests import chat_body, in_anthropic_terms, parse_messages
from kiln.engine.serving.api_errors import APIError
from kiln.engine.serving.reasoning import REASONING_PARSERS, ChatReply
from kiln.engine.serving.tool_calls import ToolCallStream
from kiln.engine.serving.tool_parsers import PARSERS

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}


# ---- requests ----------------------------------------------------------------------------------------------


def test_a_request_is_the_chat_request_it_stands_for():
    body = {
        "model": "m",
        "max_tokens": 30,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=1.0; cch=ab12;"},
            {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Use tools."},
        ],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Look it up.", "signature": "sig"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": "Looking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "rain"}]},
                    {"type": "text", "text": "And"},
                    {"type": "text", "text": "tomorrow?"},
                ],
            },
        ],
        "tools": [{"name": "get_weather", "description": "The weather", "input_schema": SCHEMA}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "stop_sequences": ["END"],
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "metadata": {"user_id": "u-1"},
        "thinking": {"type": "enabled", "budget_tokens": 2048},
        "stream": True,
        "service_tier": "auto",  # (what Kiln has no use for is passed over)
    }
    call_1 = {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    call_2 = {"id": "toolu_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}
    assert chat_body(body) == {
        "messages": [
            {"role": "system", "content": "Be brief.\nUse tools."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "Looking.",
                "tool_calls": [call_1, call_2],
                "reasoning_content": "Look it up.",
            },
            {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "toolu_2", "content": "rain"},
            {"role": "user", "content": "And\ntomorrow?"},
        ],
        "tools": [
            {
                "type": "function",
                "function": {"name": "get_weather", "description": "The weather", "parameters": SCHEMA},
            }
        ],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "stop": ["END"],
        "max_tokens": 30,
        "stream": True,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
    }
    parsed = parse_messages(body, {})
    assert parsed.params.max_tokens == 30 and parsed.params.stop == ["END"] and parsed.params.top_k == 40
    assert parsed.tool_choice == "required" and not parsed.parallel_tool_calls and parsed.stream


@pytest.mark.parametrize(
    "choice,chat",
    [
        ({"type": "auto"}, {"tool_choice": "auto", "parallel_tool_calls": True}),
        ({"type": "any"}, {"tool_choice": "required", "parallel_tool_calls": True}),
        ({"type": "none"}, {"tool_choice": "none", "parallel_tool_calls": True}),
        (
            {"type": "tool", "name": "f", "disable_parallel_tool_use": True},
            {"tool_choice": {"type": "function", "function": {"name": "f"}}, "parallel_tool_calls": False},
        ),
    ],
)
def test_tool_choice_in_chats_terms(choice, chat):
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    body |= {"tools": [{"name": "f", "input_schema": SCHEMA}], "tool_choice": choice}
    converted = chat_body(body)
    assert {k: converted[k] for k in chat} == chat


HI = [{"role": "user", "content": "hi"}]
BAD = [  # (a change to a good body, words of the error)
    ({"max_tokens": None}, "'max_tokens' is required"),
    ({"model": None}, "'model' is required"),
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"role": "system", "content": "hi"}]}, "the top-level 'system'"),
    ({"messages": [{"role": "user"}]}, "'content'"),
    ({"messages": [{"role": "user", "content": []}]}, "'content'"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "'image' blocks"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "a malformed text block"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "'tool_use_id'"),
    (
        {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": 5}]}]},
        "content",
    ),
    ({"messages": [*HI, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f"}]}]}, "'input'"),
    ({"messages": [*HI, {"role": "assistant", "content": "Sure"}]}, "prefill"),
    ({"system": 5}, "'system'"),
    ({"system": [{"type": "image"}]}, "'system'"),
    ({"tools": {"name": "f"}}, "'tools' must be a list"),
    ({"tools": [{"name": "f"}]}, "'input_schema'"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "custom tools"),
    ({"tools": [{"name": "f f", "input_schema": SCHEMA}]}, "tools[0].name must be"),
    ({"tools": [{"name": "f", "input_schema": SCHEMA, "description": 5}]}, "tools[0].description must be"),
    ({"tool_choice": "auto"}, "'tool_choice' is"),
    ({"tool_choice": {"type": "required"}}, "'tool_choice' is"),
    ({"tool_choice": {"type": "tool"}}, "needs 'name'"),
    ({"tool_choice": {"type": "any"}}, "needs 'tools'"),
    ({"tools": [{"name": "f", "input_schema": SCHEMA}], "tool_choice": {"type": "tool", "name": "g"}}, "'g'"),
    ({"tool_choice": {"type": "auto", "disable_parallel_tool_use": "yes"}}, "disable_parallel_tool_use"),
    ({"stop_sequences": "END"}, "'stop_sequences' must be a list"),
    ({"stop_sequences": [5]}, "stop_sequences"),
    ({"metadata": {"user_id": "u", "email": "a@b"}}, "'metadata'"),
    ({"metadata": {"user_id": "u" * 300}}, "user_id"),
    ({"thinking": {"type": "on"}}, "'thinking.type'"),
    ({"thinking": {"type": "enabled"}}, "budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "budget_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"stream": "yes"}, "stream"),
]


@pytest.mark.parametrize("change,words", BAD, ids=range(len(BAD)))
def test_what_a_request_gets_wrong_is_a_400_saying_what(change, words):
    body = {"model": "m", "max_tokens": 5, "messages": HI, **change}
    with pytest.raises(APIError) as caught:
        try:
            parse_messages({k: v for k, v in body.items() if v is not None}, {})
        except APIError as e:
            raise in_anthropic_terms(e) from None
    assert caught.value.status == 400 and words in caught.value.message, caught.value.message


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12,
)
FIELDS = ["model", "max_tokens", "messages", "system", "tools", "tool_choice", "stop_sequences", "temperature"]
FIELDS += ["top_p", "top_k", "metadata", "thinking", "stream"]
BLOCK_TYPES = ["text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image", None]
BLOCK_FIELDS = ["text", "id", "name", "input", "tool_use_id", "content", "thinking"]
blocks = st.fixed_dictionaries({"type": st.sampled_from(BLOCK_TYPES)}, optional={k: json_values for k in BLOCK_FIELDS})
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", 5])},
        optional={"content": st.text(max_size=5) | st.lists(blocks, max_size=3) | json_values},
    ),
    max_size=3,
)


@settings(max_examples=500, deadline=None)
@given(base=st.fixed_dictionaries({"messages": messages}), extra=st.dictionaries(st.sampled_from(FIELDS), json_values))
def test_any_body_parses_or_is_a_4xx(base, extra):
    """Nothing a client sends raises anything but a 4xx APIError."""
    try:
        parse_messages({"model": "m", "max_tokens": 5, **base, **extra}, {})
    except APIError as e:
        assert 400 <= e.status < 500


@pytest.mark.parametrize(
    "status,anthropic_status,kind",
    [
        (400, 400, "invalid_request_error"),
        (401, 401, "authentication_error"),
        (403, 403, "permission_error"),
        (404, 404, "not_found_error"),
        (405, 405, "invalid_request_error"),
        (413, 413, "request_too_large"),
        (429, 429, "rate_limit_error"),
        (500, 500, "api_error"),
        (503, 529, "overloaded_error"),
    ],
)
def test_errors_in_anthropics_shape(status, anthropic_status, kind):
    assert anthropic_error(APIError(status, "why")) == (
        anthropic_status,
        {"type": "error", "error": {"type": kind, "message": "why"}},
    )


# ---- replies: streamed and whole -----------------------------------------------------------------------------

WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
REPLIES = [  # (reasoning parser, tool parser, the model's text)
    (None, None, "Hello there."),
    (None, None, " \n"),  # whitespace alone is a text block
    ("qwen3", None, "<think>\nhmm, rain\n</think>\n\nyes"),
    ("qwen3", None, "<think>\ncut short"),
    ("qwen3", "hermes", "<think>\nlook it up\n</think>\n\n" + WEATHER_CALL),
    (None, "hermes", "\n\n" + WEATHER_CALL + "\n"),  # whitespace beside a call is no text block
    (None, "hermes", "Let me look.\n" + WEATHER_CALL),
    (None, "hermes", WEATHER_CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'),
    (None, "hermes", "<tool_call>\n{not json</tool_call>"),  # markup that does not parse is text
    (
        None,
        "hermes",
        WEATHER_CALL[: WEATHER_CALL.index("2}")],
    ),  # a call cut short (max_tokens): its input as far as it is complete
]


def folded(events: list[dict]) -> list[dict]:
    """Stream events as the official client folds them into content blocks, checking their order on the way."""
    content, arguments, open_index = [], {}, None
    for event in events:
        if event["type"] == "content_block_start":
            assert open_index is None and event["index"] == len(content)
            content.append(dict(event["content_block"]))
            open_index = event["index"]
        elif event["type"] == "content_block_delta":
            assert event["index"] == open_index
            block, delta = content[open_index], event["delta"]
            if delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            elif delta["type"] == "input_json_delta":
                arguments[open_index] = arguments.get(open_index, "") + delta["partial_json"]
            else:
                field = {"text_delta": "text", "thinking_delta": "thinking"}[delta["type"]]
                block[field] += delta[field]
        else:
            assert event == {"type": "content_block_stop", "index": open_index}
            if content[open_index]["type"] == "tool_use" and arguments.get(open_index):
                content[open_index]["input"] = from_json(arguments[open_index].encode(), partial_mode=True)
            open_index = None
    assert open_index is None
    return content


def streamed_and_whole(reasoning: str | None, tools: str | None, pieces: list[str]) -> tuple[list, list]:
    reply = ChatReply(
        REASONING_PARSERS[reasoning]() if reasoning else None, ToolCallStream(PARSERS[tools]()) if tools else None
    )
    blocks, events, text = BlockStream(), [], ""
    for k, piece in enumerate(pieces):
        text += piece
        final = k == len(pieces) - 1
        events += blocks.step(reply.update(text, final), final, reply.called_tools)
    return folded(events), content_blocks(reply.message(text))  # (the same reply: the calls keep their ids)


def splits(text: str):
    yield [text]
    yield list(text)
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]


@pytest.mark.parametrize("reasoning,tools,text", REPLIES, ids=range(len(REPLIES)))
def test_a_streamed_reply_has_the_whole_replys_blocks(reasoning, tools, text):
    for pieces in splits(text):
        streamed, whole = streamed_and_whole(reasoning, tools, pieces)
        assert streamed == whole, pieces


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(REPLIES), cuts=st.lists(st.integers(0, 200), max_size=8))
def test_random_splits_stream_the_whole_replys_blocks(case, cuts):
    reasoning, tools, text = case
    bounds = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [text]
    streamed, whole = streamed_and_whole(reasoning, tools, pieces)
    assert streamed == whole


def test_the_whole_blocks_of_replies():
    """What the reference replies hold, block by block (ids aside)."""

    def shown(blocks):
        return [{k: v for k, v in b.items() if k != "id"} for b in blocks]

    whole = [shown(streamed_and_whole(r, t, [text])[1]) for r, t, text in REPLIES]
    weather = {"type": "tool_use", "name": "get_weather", "input": {"city": "Paris", "days": 2}}
    assert whole == [
        [{"type": "text", "text": "Hello there."}],
        [{"type": "text", "text": " \n"}],
        [{"type": "thinking", "thinking": "hmm, rain\n", "signature": ""}, {"type": "text", "text": "yes"}],
        [{"type": "thinking", "thinking": "cut short", "signature": ""}],
        [{"type": "thinking", "thinking": "look it up\n", "signature": ""}, weather],
        [weather],
        [{"type": "text", "text": "Let me look.\n"}, weather],
        [weather, {"type": "tool_use", "name": "get_time", "input": {}}],
        [{"type": "text", "text": "<tool_call>\n{not json</tool_call>"}],
        [{**weather, "input": {"city": "Paris"}}],
    ]
    assert REPLIES[-1][2].endswith('"days": ')
    ids = [b["id"] for b in streamed_and_whole(None, "hermes", [REPLIES[7][2]])[1]]
    assert all(i.startswith("toolu_") for i in ids) and len(set(ids)) == 2


finite_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(value=st.dictionaries(st.text(max_size=6), finite_json, max_size=4))
def test_cut_arguments_are_read_as_anthropics_clients_read_them(value):
    """A call's arguments cut anywhere give the input jiter's partial mode (the client's reading of a stream) gives."""
    text = json.dumps(value)
    for end in range(len(text) + 1):
        call = {"id": "call_1", "function": {"name": "f", "arguments": text[:end]}}
        (block,) = content_blocks({"tool_calls": [call]})
        expected = from_json(text[:end].encode(), partial_mode=True) if end else {}
        assert block["input"] == expected, text[:end]
