"""Reasoning output: a thinking model's reply split into reasoning_content and content (and tool calls), whole and
streamed in every split, on replies as the models write them; end to end through the `openai` client."""

from __future__ import annotations

import json

import pytest

from kiln.engine.config import REASONING_PARSERS as OFFERED
from kiln.engine.serving.reasoning import REASONING_PARSERS, ChatReply
from kiln.engine.serving.tool_calls import ToolCallStream
from kiln.engine.serving.tool_parsers import PARSERS

from helpers.server import Server

# (reasoning parser, reply, reasoning expected, content expected)
CASES = [
    ("qwen3", "<think>\nParis is in France.\n</think>\n\nIt is sunny.", "Paris is in France.\n", "It is sunny."),
    ("qwen3", "It is sunny, 3 < 4.", None, "It is sunny, 3 < 4."),  # thinking off: no <think>
    ("qwen3", "<think>\nstill thinking", "still thinking", ""),  # cut off by max_tokens
    ("deepseek_r1", "Paris is in France.\n</think>\n\nIt is sunny.", "Paris is in France.\n", "It is sunny."),
    ("deepseek_r1", "<think>\nok</think>Yes", "ok", "Yes"),
    ("deepseek_r1", "thinking <b>forever", "thinking <b>forever", ""),
]


def splits(text):
    yield list(text)
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]


def streamed(reply: ChatReply, pieces):
    fields, text = {}, ""
    for k, piece in enumerate(pieces):
        text += piece
        for key, value in reply.update(text, final=k == len(pieces) - 1).items():
            fields[key] = fields.get(key, [] if key == "tool_calls" else "") + value
    return fields


@pytest.mark.parametrize("name,text,reasoning,content", CASES, ids=range(len(CASES)))
def test_reasoning_whole_and_streamed(name, text, reasoning, content):
    parser = REASONING_PARSERS[name]()
    message = ChatReply(parser, None).message(text)
    assert message == {"content": content, "reasoning_content": reasoning}
    for pieces in splits(text):
        fields = streamed(ChatReply(parser, None), pieces)
        assert fields.get("reasoning_content") == reasoning and fields.get("content", "") == content, pieces


def test_reasoning_then_a_tool_call():
    text = "<think>\nI should look it up.\n</think>\n\n"
    text += '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

    def reply():
        return ChatReply(REASONING_PARSERS["qwen3"](), ToolCallStream(PARSERS["hermes"]()))

    message = reply().message(text)
    assert message["reasoning_content"] == "I should look it up.\n" and message["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Paris"})
    ]
    for pieces in splits(text):
        fields = streamed(reply(), pieces)
        assert fields["reasoning_content"] == "I should look it up.\n" and "content" not in fields
        assert "".join(d["function"]["arguments"] for d in fields["tool_calls"]) == '{"city": "Paris"}'


def test_the_parsers_are_the_ones_the_server_offers():
    assert set(REASONING_PARSERS) == set(OFFERED)


THOUGHT = r"<think>\nhmm, (rain|sun)\n</think>\n\n(yes|no)"


@pytest.mark.parametrize("flag", [True, False])
def test_reasoning_content_through_the_openai_client(tiny_llama_dir, flag):
    """A regex makes the random model write a thought and an answer; with --reasoning-parser they come apart."""
    server = Server(tiny_llama_dir, *(["--reasoning-parser", "qwen3"] if flag else []))
    try:
        client = server.client()
        kw = dict(model=server.model, messages=[{"role": "user", "content": "Rain?"}], seed=2)
        kw["extra_body"] = {"guided_regex": THOUGHT}
        message = client.chat.completions.create(**kw).choices[0].message
        reasoning = (message.model_extra or {}).get("reasoning_content")
        if not flag:
            assert message.content.startswith("<think>") and reasoning is None  # unchanged without the flag
            return
        assert reasoning.startswith("hmm, ") and message.content in ("yes", "no")
        thought, answer = "", ""
        for chunk in client.chat.completions.create(stream=True, **kw):
            delta = chunk.choices[0].delta
            thought += (delta.model_extra or {}).get("reasoning_content") or ""
            answer += delta.content or ""
        assert (thought, answer) == (reasoning, message.content)
    finally:
        server.stop()
