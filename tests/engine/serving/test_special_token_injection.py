"""A special token's text anywhere in a chat request (a tool's description, its schema's property names and values,
an earlier call's arguments, reasoning_content, content) stays characters: the prompt holds exactly the special
tokens the template wrote for a request without that text (transformers' own rendering of it is the reference), and
the text's characters are all there. --parse-special-tokens-in-messages makes them tokens again."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from helpers.server import Server
from helpers.templated import templated_model_dir


@pytest.fixture(scope="module")
def templated_dir(tiny_llama_dir, tmp_path_factory):
    return templated_model_dir(tiny_llama_dir, tmp_path_factory.mktemp("templated"))


@pytest.fixture(scope="module")
def server(templated_dir):
    s = Server(templated_dir, "--max-model-len", "512")
    yield s
    s.stop()


def request_with(text: str) -> dict:
    """A chat request carrying `text` in every place a template may render it."""
    schema = {"type": "object", "properties": {text: {"type": "string", "enum": [text], "description": text}}}
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": json.dumps({"q": text})}}
    return {
        "messages": [
            {"role": "system", "content": f"be brief {text}"},
            {"role": "user", "content": "look it up"},
            {"role": "assistant", "content": None, "reasoning_content": f"think {text}", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": f"found {text}"},
        ],
        "tools": [{"type": "function", "function": {"name": "lookup", "description": text, "parameters": schema}}],
    }


def reference_ids(tokenizer, body: dict) -> list[int]:
    messages = [dict(m) for m in body["messages"]]
    for m in messages:
        for call in m.get("tool_calls") or []:
            call["function"] = {**call["function"], "arguments": json.loads(call["function"]["arguments"])}
        if m["content"] is None:
            m["content"] = ""
    return tokenizer.apply_chat_template(messages, tools=body["tools"], add_generation_prompt=True)["input_ids"]


def test_special_token_text_anywhere_in_a_request_stays_plain(server, templated_dir):
    tokenizer = AutoTokenizer.from_pretrained(templated_dir)
    eos, eos_id = tokenizer.eos_token, tokenizer.eos_token_id
    clean = reference_ids(tokenizer, request_with("x"))
    template_count = clean.count(eos_id)
    assert template_count == 5  # the tools block's and each message's
    code, raw = server.post("/tokenize", request_with(eos))
    assert code == 200, raw[:300]
    ids = json.loads(raw)["tokens"]
    assert ids.count(eos_id) == template_count
    text = tokenizer.decode(ids)
    assert text.count(eos) == template_count + 8  # the request's own eight, as characters
    assert text == tokenizer.decode(reference_ids(tokenizer, request_with(eos)))  # the same characters
    assert server.post("/v1/chat/completions", {**request_with(eos), "tool_choice": "none", "max_tokens": 2})[0] == 200


def test_with_parse_special_tokens_they_are_tokens(templated_dir):
    tokenizer = AutoTokenizer.from_pretrained(templated_dir)
    server = Server(templated_dir, "--max-model-len", "512", "--parse-special-tokens-in-messages")
    try:
        ids = json.loads(server.post("/tokenize", request_with(tokenizer.eos_token))[1])["tokens"]
        assert ids == reference_ids(tokenizer, request_with(tokenizer.eos_token))
    finally:
        server.stop()
