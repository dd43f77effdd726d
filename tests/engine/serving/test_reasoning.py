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


def whole_content(reasoning: str | None, content: str) -> str | None:
    """A whole message's content: null for a reply that only thought (as vLLM's and OpenAI's schema have it)."""
    return None if reasoning and not content else content


@pytest.mark.parametrize("name,text,reasoning,content", CASES, ids=range(len(CASES)))
def test_reasoning_whole_and_streamed(name, text, reasoning, content):
    parser = REASONING_PARSERS[name]()
    message = ChatReply(parser, None).message(text)
    assert message == {"content": whole_content(reasoning, content), "reasoning_content": reasoning}
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


# (reasoning parser, the prompt's last characters, constrained, reply, reasoning expected, content expected)
REQUEST_CASES = [
    # Qwen3.5/3.6, Qwen3-Thinking-2507, QwQ: the template opened <think>, the reply only closes it
    (
        "qwen3",
        "<|im_start|>assistant\n<think>\n",
        False,
        "Paris is in France.\n</think>\n\nSunny.",
        "Paris is in France.\n",
        "Sunny.",
    ),
    ("qwen3", "<|im_start|>assistant\n<think>\n", False, "still thinking", "still thinking", ""),  # cut off
    # Qwen3 with chat_template_kwargs {"enable_thinking": false}: the template closed an empty <think> itself
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", False, "Sunny, 3 < 4.", None, "Sunny, 3 < 4."),
    # Qwen3 with thinking on (its first template): the reply opens <think>
    ("qwen3", "<|im_start|>assistant\n", False, "<think>\nok\n</think>\n\nyes", "ok\n", "yes"),
    # a constrained reply (json_schema, a forced tool call) never thinks: its grammar holds it from the first token
    ("deepseek_r1", "<|Assistant|>", True, '{"city": "Paris"}', None, '{"city": "Paris"}'),
    (
        "qwen3",
        "<|im_start|>assistant\n<think>\n",
        True,
        '[{"name": "f", "parameters": {}}]',
        None,
        '[{"name": "f", "parameters": {}}]',
    ),
    ("deepseek_r1", "<|Assistant|>", True, "<think>\nhmm</think>yes", "hmm", "yes"),  # (one that writes <think>)
]


@pytest.mark.parametrize("name,tail,constrained,text,reasoning,content", REQUEST_CASES, ids=range(len(REQUEST_CASES)))
def test_how_the_prompt_and_a_constraint_start_the_reply(name, tail, constrained, text, reasoning, content):
    def reply():
        parser = REASONING_PARSERS[name]()
        parser.read_request(tail, constrained)
        return ChatReply(parser, None)

    assert reply().message(text) == {"content": whole_content(reasoning, content), "reasoning_content": reasoning}
    for pieces in splits(text):
        fields = streamed(reply(), pieces)
        assert fields.get("reasoning_content") == reasoning and fields.get("content", "") == content, pieces


def test_a_qwen3_coder_call_written_while_thinking_ends_the_thinking():
    """Qwen3.5 may call a tool before closing </think> (vLLM's qwen3 parser reads the call as the thinking's end); a
    <tool_call> mentioned in the thinking without a function after it stays thinking."""
    call = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    text = "I need the weather; a <tool_call> tag, then.\n" + call

    def reply():
        parser = REASONING_PARSERS["qwen3"]()
        parser.read_request("<|im_start|>assistant\n<think>\n", False)
        tools = PARSERS["qwen3_coder"]()
        tools.offer({"get_weather": {"name": "get_weather"}})
        return ChatReply(parser, ToolCallStream(tools))

    message = reply().message(text)
    assert (
        message["reasoning_content"] == "I need the weather; a <tool_call> tag, then.\n" and message["content"] is None
    )
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("get_weather", '{"city": "Paris"}')
    ]
    for pieces in splits(text):
        fields = streamed(reply(), pieces)
        assert fields["reasoning_content"] == message["reasoning_content"] and "content" not in fields, pieces
        assert "".join(d["function"]["arguments"] for d in fields["tool_calls"]) == '{"city": "Paris"}'


QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% else %}<think>\n"
    "{% endif %}{% endif %}"
)


@pytest.mark.parametrize("thinking", [True, False, None])
def test_enable_thinking_reaches_the_template_and_the_parser(tiny_llama_dir, thinking):
    """chat_template_kwargs as the template's variables (the API's own arguments dropped), and the rendered prompt's
    end telling the qwen3 parser whether the reply thinks from its start, as Qwen3.5's template does."""
    from transformers import AutoTokenizer

    from kiln.engine.serving.completion import template_variables

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    kwargs = {"tokenize": True, "chat_template": "{{ 1/0 }}"} | (
        {} if thinking is None else {"enable_thinking": thinking}
    )
    variables = template_variables(tokenizer, kwargs)
    assert "tokenize" not in variables and "chat_template" not in variables
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Rain?"}],
        chat_template=QWEN_TEMPLATE,
        tokenize=False,
        add_generation_prompt=True,
        **variables,
    )
    parser = REASONING_PARSERS["qwen3"]()
    parser.read_request(prompt[-20:], constrained=False)
    if thinking is False:
        assert ChatReply(parser, None).message("No rain.") == {"content": "No rain.", "reasoning_content": None}
    else:  # (thinking is on unless turned off)
        message = ChatReply(parser, None).message("Clouds?\n</think>\n\nNo rain.")
        assert message == {"content": "No rain.", "reasoning_content": "Clouds?\n"}


def test_a_constrained_reply_reaches_content_and_tool_calls_with_deepseek_r1(tiny_llama_dir):
    """--reasoning-parser deepseek_r1 reads a reply as thinking until </think>; a constrained one (a forced tool call,
    json_schema, json_object) never thinks, so it is content or tool calls, streamed and not."""
    server = Server(tiny_llama_dir, "--max-model-len", "512", "--reasoning-parser", "deepseek_r1")
    try:
        client = server.client()
        tool = {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                    "required": ["city"],
                },
            },
        }
        kw = dict(model=server.model, messages=[{"role": "user", "content": "Rain?"}], seed=1, max_tokens=200)
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            message = client.chat.completions.create(tools=[tool], tool_choice=choice, **kw).choices[0].message
            assert (message.model_extra or {}).get("reasoning_content") is None and message.content is None
            assert json.loads(message.tool_calls[0].function.arguments)["city"] in ("Paris", "Oslo")
        schema = {"type": "object", "properties": {"rain": {"type": "boolean"}}, "required": ["rain"]}
        for format_ in (
            {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
            {"type": "json_object"},
        ):
            message = client.chat.completions.create(response_format=format_, **kw).choices[0].message
            assert (message.model_extra or {}).get("reasoning_content") is None
            assert message.content.startswith("{")  # (json_object's may be cut by max_tokens: a random model's keys)
            streamed_content, thought = "", ""
            for chunk in client.chat.completions.create(response_format=format_, stream=True, **kw):
                delta = chunk.choices[0].delta
                streamed_content += delta.content or ""
                thought += (delta.model_extra or {}).get("reasoning_content") or ""
            assert thought == "" and streamed_content == message.content
    finally:
        server.stop()


def test_chat_template_kwargs_through_the_server(tiny_llama_dir, tmp_path):
    """`chat_template_kwargs: {"enable_thinking": false}` reaches the template the server renders (/tokenize and a
    chat), and the qwen3 parser then reads the whole reply as content."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    (model / "chat_template.jinja").write_text(QWEN_TEMPLATE)
    server = Server(model, "--max-model-len", "256", "--reasoning-parser", "qwen3")
    try:
        messages = [{"role": "user", "content": "Rain?"}]
        counts = {}
        for thinking in (True, False):
            body = {"messages": messages, "chat_template_kwargs": {"enable_thinking": thinking}}
            status, reply = server.post("/tokenize", body)
            assert status == 200
            counts[thinking] = json.loads(reply)["count"]
        assert counts[False] > counts[True]  # (the closed, empty <think></think> the template wrote)
        reply = server.client().chat.completions.create(
            model=server.model,
            messages=messages,
            max_tokens=8,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}, "guided_choice": ["No rain."]},
        )
        message = reply.choices[0].message
        assert message.content == "No rain." and getattr(message, "reasoning_content", None) is None
    finally:
        server.stop()
