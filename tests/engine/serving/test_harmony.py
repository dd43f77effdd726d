"""gpt-oss's harmony format read by channel (`--reasoning-parser openai_gptoss`, `--tool-call-parser openai`): replies
written as the model writes them (the detokenizer keeping special tokens; the stop token, `<|return|>` or `<|call|>`,
left out), whole and streamed at every split, with either parser alone and both; then end to end through `kiln serve`
on a tiny gpt-oss with gpt-oss's chat template, the official `openai` client, chat and Responses API, streamed and not.
"""

from __future__ import annotations

import json

import pytest

from kiln.engine.config import REASONING_PARSERS as OFFERED_REASONING
from kiln.engine.config import TOOL_CALL_PARSERS
from kiln.engine.serving.harmony import read_messages
from kiln.engine.serving.reasoning import REASONING_PARSERS, ChatReply
from kiln.engine.serving.tool_calls import ToolCallStream
from kiln.engine.serving.tool_parsers import PARSERS

ANALYSIS = "<|channel|>analysis<|message|>The user asks about Paris. Simple.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris, 21 °C."
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'
# the recipient in the role's part, as the chat template renders earlier calls (and the model may write them)
CALL_IN_ROLE = '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"zone": "CET"}'
PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Checking both.<|end|>"
TOOLS = {"get_weather": {"name": "get_weather"}, "get_time": {"name": "get_time"}}


def call(name: str, arguments: str) -> tuple[str, str]:
    return name, arguments


# (reply, reasoning expected, content expected, calls expected)
CASES = {
    "analysis then final": (ANALYSIS + FINAL, "The user asks about Paris. Simple.", "It is sunny in Paris, 21 °C.", []),
    "analysis then a call": (
        ANALYSIS + CALL,
        "The user asks about Paris. Simple.",
        None,
        [call("get_weather", '{"city":"Paris"}')],
    ),
    "several calls": (
        ANALYSIS + PREAMBLE + CALL + "<|call|>" + CALL_IN_ROLE,
        "The user asks about Paris. Simple.",
        "Checking both.",
        [call("get_weather", '{"city":"Paris"}'), call("get_time", '{"zone": "CET"}')],
    ),
    "a call cut by max_tokens": (
        ANALYSIS + CALL[: CALL.index('"Paris"') + 4],
        "The user asks about Paris. Simple.",
        None,
        [call("get_weather", '{"city":"Par')],
    ),
    "reasoning cut by max_tokens": ("<|channel|>analysis<|message|>Hmm, the user", "Hmm, the user", "", []),
    "two analysis messages": (
        ANALYSIS + "<|start|>assistant<|channel|>analysis<|message|>Still simple.<|end|>" + FINAL,
        "The user asks about Paris. Simple.\nStill simple.",
        "It is sunny in Paris, 21 °C.",
        [],
    ),
    "a constrained reply: no channels": ('{"city": "Paris"}', "", '{"city": "Paris"}', []),
}


def splits(text: str):
    yield list(text)
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]


def streamed(reply: ChatReply, pieces) -> dict:
    fields, text = {}, ""
    for k, piece in enumerate(pieces):
        text += piece
        for key, value in reply.update(text, final=k == len(pieces) - 1).items():
            fields[key] = fields.get(key, [] if key == "tool_calls" else "") + value
    return fields


def both() -> ChatReply:
    tools = PARSERS["openai"]()
    tools.offer(TOOLS)
    return ChatReply(REASONING_PARSERS["openai_gptoss"](), ToolCallStream(tools))


def calls_of(message_calls) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message_calls]


def streamed_calls(deltas) -> list[tuple[str, str]]:
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        entry = calls.setdefault(delta["index"], ["", ""])
        entry[0] += delta["function"].get("name") or ""
        entry[1] += delta["function"].get("arguments") or ""
    return [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("name", CASES)
def test_both_parsers_whole_and_streamed(name):
    text, reasoning, content, calls = CASES[name]
    message = both().message(text)
    assert message.get("reasoning_content") in (reasoning or None, reasoning)
    assert message["content"] in ((content, None) if not content else (content,))
    assert calls_of(message.get("tool_calls", [])) == calls
    for pieces in splits(text):
        fields = streamed(both(), pieces)
        assert fields.get("reasoning_content", "") == reasoning, pieces
        assert fields.get("content", "") == (content or ""), pieces
        assert streamed_calls(fields.get("tool_calls", [])) == calls, pieces


@pytest.mark.parametrize("name", ["analysis then final", "reasoning cut by max_tokens", "two analysis messages"])
def test_the_reasoning_parser_alone(name):
    """Without a tool parser the final channel is the content, as with it."""
    text, reasoning, content, _ = CASES[name]
    parser = REASONING_PARSERS["openai_gptoss"]()
    assert ChatReply(parser, None).message(text)["reasoning_content"] in (reasoning, reasoning or None)
    for pieces in splits(text):
        fields = streamed(ChatReply(REASONING_PARSERS["openai_gptoss"](), None), pieces)
        assert (fields.get("reasoning_content", ""), fields.get("content", "")) == (reasoning, content), pieces


@pytest.mark.parametrize("name", ["analysis then final", "analysis then a call", "several calls"])
def test_the_tool_parser_alone_reads_the_raw_reply(name):
    """Without the reasoning parser the tool parser reads the reply's own markup: the analysis is neither content nor
    a call."""
    text, _, content, calls = CASES[name]

    def reply() -> ChatReply:
        tools = PARSERS["openai"]()
        tools.offer(TOOLS)
        return ChatReply(None, ToolCallStream(tools))

    message = reply().message(text)
    assert message["content"] == content and calls_of(message.get("tool_calls", [])) == calls
    for pieces in splits(text):
        fields = streamed(reply(), pieces)
        assert fields.get("content", "") == (content or "") and streamed_calls(fields.get("tool_calls", [])) == calls


def test_a_call_of_a_tool_not_offered_is_content():
    tools = PARSERS["openai"]()
    tools.offer({"get_time": {"name": "get_time"}})
    message = ChatReply(REASONING_PARSERS["openai_gptoss"](), ToolCallStream(tools)).message(ANALYSIS + CALL)
    assert "tool_calls" not in message and "functions.get_weather" in message["content"]


def test_messages_as_read():
    plain, messages = read_messages(ANALYSIS + PREAMBLE + CALL + "<|call|>" + CALL_IN_ROLE, final=True)
    assert plain == ""
    assert [(m.channel, m.recipient, m.done) for m in messages] == [
        ("analysis", None, True),
        ("commentary", None, True),
        ("commentary", "functions.get_weather", True),
        ("commentary", "functions.get_time", True),
    ]
    _, partial = read_messages(ANALYSIS + "<|start|>assistant<|channel|>fin", final=False)
    assert len(partial) == 1  # (a header not yet complete is held back)
    _, held = read_messages("<|channel|>analysis<|message|>ok<|e", final=False)
    assert held[0].body == "ok" and not held[0].done


def test_the_parsers_are_the_ones_the_server_offers():
    assert "openai_gptoss" in OFFERED_REASONING and "openai" in TOOL_CALL_PARSERS
    assert REASONING_PARSERS["openai_gptoss"].needs_special_tokens and PARSERS["openai"].needs_special_tokens


# ---- through the server ------------------------------------------------------------------------------------------

# the random model held to harmony transcripts by a regex (spelled in plain tokens: the text is the same)
FINAL_RE = (
    r"<\|channel\|>analysis<\|message\|>The user asks about (Paris|Oslo)\.<\|end\|>"
    r"<\|start\|>assistant<\|channel\|>final<\|message\|>It is (sunny|raining)\."
)
CALL_RE = (
    r"<\|channel\|>analysis<\|message\|>Need the weather\.<\|end\|><\|start\|>assistant<\|channel\|>commentary "
    r'to=functions\.get_weather <\|constrain\|>json<\|message\|>\{"city": "(Paris|Oslo)"\}'
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    from helpers.gpt_oss import make_tiny_gpt_oss_dir
    from helpers.server import Server

    path = make_tiny_gpt_oss_dir(tmp_path_factory.mktemp("gpt_oss_server"), mxfp4_experts=True)
    flags = ["--max-model-len", "2048", "--enable-auto-tool-choice", "--tool-call-parser", "openai"]
    server = Server(path, *flags, "--reasoning-parser", "openai_gptoss")
    yield server, path
    server.stop()


def test_the_prompt_is_gpt_oss_chat_template(gpt_oss):
    """The system message with the request's reasoning_effort, the developer message with the instructions and the
    tools as the template renders them (a TypeScript namespace), an earlier call (its reasoning_content as the
    template's `thinking`) and its result rendered back, the prompt ending `<|start|>assistant`; the template's markup
    as special tokens."""
    from transformers import AutoTokenizer

    server, path = gpt_oss
    messages = [
        {"role": "system", "content": "Be brief."},
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Need the weather.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "user", "content": "And in Oslo?"},
    ]
    body = {"model": server.model, "messages": messages, "tools": [WEATHER]}
    body["chat_template_kwargs"] = {"reasoning_effort": "high"}
    status, reply = server.post("/tokenize", body)
    assert status == 200, reply
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = json.loads(reply)["tokens"]
    prompt = tokenizer.decode(ids, skip_special_tokens=False)
    assert prompt.startswith("<|start|>system<|message|>You are ChatGPT") and "Reasoning: high\n" in prompt
    assert "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\n" in prompt
    assert "// The weather in a city\ntype get_weather = (_: {\ncity: string,\n}) => any;" in prompt
    assert (
        "<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
        "<|start|>user<|message|>And in Oslo?<|end|><|start|>assistant"
    ) in prompt and prompt.endswith("<|start|>assistant")
    assert ids.count(tokenizer.convert_tokens_to_ids("<|start|>")) == prompt.count("<|start|>")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_reasoning_and_content(gpt_oss, stream):
    server, _ = gpt_oss
    client = server.client()
    kw = dict(model=server.model, messages=ASK, seed=3, max_tokens=400, extra_body={"guided_regex": FINAL_RE})
    message = client.chat.completions.create(**kw).choices[0].message
    reasoning = (message.model_extra or {}).get("reasoning_content")
    assert reasoning.startswith("The user asks about ") and message.content in ("It is sunny.", "It is raining.")
    if stream:
        thought, answer, finish = "", "", None
        for chunk in client.chat.completions.create(stream=True, **kw):
            delta = chunk.choices[0].delta
            thought += (delta.model_extra or {}).get("reasoning_content") or ""
            answer += delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        assert (thought, answer, finish) == (reasoning, message.content, "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_tool_call(gpt_oss, stream):
    server, _ = gpt_oss
    client = server.client()
    kw = dict(model=server.model, messages=ASK, tools=[WEATHER], seed=4, max_tokens=400)
    kw["extra_body"] = {"guided_regex": CALL_RE}
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert (choice.message.model_extra or {}).get("reasoning_content") == "Need the weather."
    (called,) = choice.message.tool_calls
    assert called.function.name == "get_weather" and json.loads(called.function.arguments)["city"] in ("Paris", "Oslo")
    if stream:
        deltas, thought, finish = [], "", None
        for chunk in client.chat.completions.create(stream=True, **kw):
            delta = chunk.choices[0].delta
            thought += (delta.model_extra or {}).get("reasoning_content") or ""
            deltas += [d.model_dump() for d in delta.tool_calls or []]
            finish = chunk.choices[0].finish_reason or finish
        assert thought == "Need the weather." and finish == "tool_calls"
        assert streamed_calls(deltas) == [("get_weather", called.function.arguments)]


def test_a_call_cut_by_max_tokens(gpt_oss):
    """The same reply two tokens short: the call with its arguments as far as they came, finish_reason length,
    whole and streamed alike."""
    server, _ = gpt_oss
    client = server.client()
    kw = dict(model=server.model, messages=ASK, tools=[WEATHER], seed=4, extra_body={"guided_regex": CALL_RE})
    full = client.chat.completions.create(max_tokens=400, **kw)
    whole = full.choices[0].message.tool_calls[0].function.arguments
    cut = client.chat.completions.create(max_tokens=full.usage.completion_tokens - 2, **kw).choices[0]
    assert cut.finish_reason == "length"
    (called,) = cut.message.tool_calls
    assert called.function.name == "get_weather"
    assert whole.startswith(called.function.arguments) and called.function.arguments != whole
    deltas = []
    for chunk in client.chat.completions.create(stream=True, max_tokens=full.usage.completion_tokens - 2, **kw):
        deltas += [d.model_dump() for d in chunk.choices[0].delta.tool_calls or []]
    assert streamed_calls(deltas) == [("get_weather", called.function.arguments)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_api(gpt_oss, stream):
    """The analysis as a reasoning item, the call as a function_call item; a final answer as the message."""
    server, _ = gpt_oss
    client = server.client()
    tool = {"type": "function", **WEATHER["function"]}
    kw = dict(model=server.model, input="What is the weather in Paris?", tools=[tool], max_output_tokens=400)
    if stream:
        with client.responses.stream(**kw, extra_body={"guided_regex": CALL_RE, "seed": 4}) as events:
            response = events.get_final_response()
    else:
        response = client.responses.create(**kw, extra_body={"guided_regex": CALL_RE, "seed": 4})
    reasoning, called = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Need the weather."
    assert called.type == "function_call" and called.name == "get_weather"
    assert json.loads(called.arguments)["city"] in ("Paris", "Oslo")
    answered = client.responses.create(**kw, extra_body={"guided_regex": FINAL_RE, "seed": 3})
    thought, message = answered.output
    assert thought.type == "reasoning" and message.type == "message"
    assert answered.output_text in ("It is sunny.", "It is raining.")
