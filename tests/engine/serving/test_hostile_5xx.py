"""What once answered a 5xx: a number past a float's range, a tool schema past the constraint limit, a lone surrogate
escaped inside a string of JSON, model output a tool parser cannot take, and a bug of the server's own midway through
a stream. Each is a 4xx OpenAI error object naming the parameter, or a 200; a stream that fails ends with an error
event and [DONE], in the one HTTP response it began; and the server goes on serving."""

from __future__ import annotations

import json
import socket

import pytest

from helpers.server import API_KEY, Server
from helpers.templated import templated_model_dir

HI = [{"role": "user", "content": "hi"}]
HUGE = "1" + "0" * 400  # JSON's integer of 401 digits: an int in Python, past any float
FAULT_TOKEN = 300  # the second server's API process fails on a request handed this token id (a test hook)


@pytest.fixture(scope="module")
def templated_dir(tiny_llama_dir, tmp_path_factory):
    return templated_model_dir(tiny_llama_dir, tmp_path_factory.mktemp("templated"))


@pytest.fixture(scope="module")
def server(templated_dir):
    s = Server(templated_dir, "--max-model-len", "512", "--enable-auto-tool-choice", "--tool-call-parser", "pythonic")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def hermes(templated_dir):
    """Every request to it is held to a regex or its first token forced: none meets the fault token by chance."""
    s = Server(
        templated_dir,
        "--max-model-len",
        "512",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        server_fault_token=FAULT_TOKEN,
    )
    yield s
    s.stop()


def assert_4xx(code: int, raw: bytes, param: str | None) -> dict:
    assert 400 <= code < 500, (code, raw[:300])
    error = json.loads(raw)["error"]
    assert error["param"] == param and error["message"], error
    return error


BASES = {
    "/v1/completions": '{"prompt": "hi", "max_tokens": 2, %s}',
    "/v1/chat/completions": '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, %s}',
    "/v1/responses": '{"input": "hi", "max_output_tokens": 2, %s}',
}
FLOATS = [
    (path, field, sign)
    for path in BASES
    for field in ("temperature", "top_p", "min_p", "repetition_penalty")
    + (("presence_penalty", "frequency_penalty", "logit_bias") if path != "/v1/responses" else ())
    for sign in ("", "-")
]


@pytest.mark.parametrize("path,field,sign", FLOATS, ids=[f"{p[4:]}-{f}{s}" for p, f, s in FLOATS])
def test_a_number_past_a_floats_range_is_a_400(server, path, field, sign):
    value = f'{{"5": {sign}{HUGE}}}' if field == "logit_bias" else sign + HUGE
    code, raw = server.post(path, (BASES[path] % f'"{field}": {value}').encode())
    assert_4xx(code, raw, field)


def big_tool(name: str, kilobytes: int) -> dict:
    properties = {f"p{i}": {"type": "string", "description": "x" * 1000} for i in range(kilobytes)}
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": properties}}}


@pytest.mark.parametrize("choice", ["none", "auto", "required", "named", "responses"])
def test_a_tool_schema_past_the_constraint_limit_is_a_400(server, choice):
    """One tool's schema of 300 KB, or (tool_choice "required") a union of three of 100 KB: past the 256 KiB a
    constraint may hold."""
    tools = [big_tool("f", 300)] if choice != "required" else [big_tool(n, 100) for n in "fgh"]
    if choice == "responses":
        flat = [{"type": "function", **tools[0]["function"]}]
        code, raw = server.post("/v1/responses", {"input": "hi", "tools": flat, "max_output_tokens": 2})
    else:
        tool_choice = {"type": "function", "function": {"name": "f"}} if choice == "named" else choice
        body = {"messages": HI, "tools": tools, "tool_choice": tool_choice, "max_tokens": 2}
        code, raw = server.post("/v1/chat/completions", body)
    assert "262144 characters" in assert_4xx(code, raw, "tools")["message"]
    assert server.post("/v1/chat/completions", {"messages": HI, "max_tokens": 2})[0] == 200


SURROGATE_ARGUMENTS = '{"city": "\\ud800"}'  # JSON text whose string escapes a lone surrogate
SURROGATES = [
    (
        "/v1/chat/completions",
        {
            "messages": [
                *HI,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": SURROGATE_ARGUMENTS}}],
                },
                {"role": "tool", "tool_call_id": "c", "content": "ok"},
            ],
            "max_tokens": 2,
        },
        "messages",
    ),
    (
        "/v1/responses",
        {
            "input": [
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": SURROGATE_ARGUMENTS},
                {"type": "function_call_output", "call_id": "c", "output": "ok"},
            ],
            "max_output_tokens": 2,
        },
        "input",
    ),
    ("/v1/chat/completions", {"messages": HI, "guided_json": '{"enum": ["\\udc00"]}', "max_tokens": 2}, "guided_json"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800"}], "max_tokens": 2}', None),
    ("/tokenize", b'{"prompt": "a\\udfff b"}', None),
]


@pytest.mark.parametrize("path,body,param", SURROGATES, ids=["arguments", "responses", "guided_json", "chat", "tok"])
def test_a_lone_surrogate_escaped_anywhere_is_a_400(server, path, body, param):
    """An escape the body's own check sees (content), or one inside JSON text in a string (an earlier call's
    arguments, guided_json), which only the second parse reveals: the tokenizer and xgrammar take neither."""
    assert_4xx(*server.post(path, body), param)
    assert server.post(path, {"messages": HI, "prompt": "hi", "input": "hi", "max_tokens": 2})[0] == 200


def sse(raw: bytes) -> list:
    return [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]" for line in raw.decode().split("\n\n") if line]


UNPARSABLE = [r"\[f\(a=\{1\}\)\]", r"\[f\(x=b'z'\)\]", r"\[f\(x=1e999\)\]"]


@pytest.mark.parametrize("regex", UNPARSABLE, ids=["set", "bytes", "infinity"])
@pytest.mark.parametrize("stream", [False, True])
def test_calls_a_tool_parser_cannot_take_are_content(server, regex, stream):
    """Pythonic calls with a set, bytes or an infinity for an argument (none of them JSON): the reply is content,
    whole; a stream ends with its finish reason and [DONE]."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"messages": HI, "tools": [tool], "guided_regex": regex, "max_tokens": 40, "stream": stream}
    code, raw = server.post("/v1/chat/completions", body)
    assert code == 200, raw[:300]
    if stream:
        events = sse(raw)
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "stop", events[-3:]
        content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    else:
        message = json.loads(raw)["choices"][0]["message"]
        assert not message.get("tool_calls")
        content = message["content"]
    assert content.startswith("[f(") and content.endswith(")]")


@pytest.mark.parametrize("stream", [False, True])
def test_a_hermes_call_to_a_tool_not_offered_is_content(hermes, stream):
    """A call named with an escaped lone surrogate (once a 5xx as the reply was written), or any name no offered tool
    has: not a call, so the reply is content."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for name in (r"\\ud800", "g"):
        regex = r'<tool_call>\n\{"name": "' + name + r'", "arguments": \{\}\}\n</tool_call>'
        body = {"messages": HI, "tools": [tool], "guided_regex": regex, "max_tokens": 60, "stream": stream}
        code, raw = hermes.post("/v1/chat/completions", body)
        assert code == 200, raw[:300]
        if stream:
            events = sse(raw)
            assert events[-1] == "[DONE]" and not any(e["choices"][0]["delta"].get("tool_calls") for e in events[:-1])
        else:
            assert json.loads(raw)["choices"][0]["message"]["content"].startswith("<tool_call>")


def raw_post(server, path: str, body: dict) -> bytes:
    """The whole HTTP exchange's bytes as the server sent them (HTTP/1.0: no chunks), until it closes."""
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(head + payload)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    return reply


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_bug_midway_through_a_stream_ends_it_with_an_error_event(hermes, path):
    """The API server raises (a test hook) on the first token, forced by logit_bias, after the stream has begun: one
    HTTP response, ending with an error event and [DONE], and the server serves on."""
    body = {"messages": HI, "prompt": "hi", "stream": True, "max_tokens": 4, "logit_bias": {str(FAULT_TOKEN): 100}}
    reply = raw_post(hermes, path, body)
    assert reply.count(b"HTTP/1.") == 1 and reply.startswith(b"HTTP/1.0 200"), reply[:300]
    events = sse(reply.partition(b"\r\n\r\n")[2])
    assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "internal_error", events[-3:]
    assert hermes.post("/v1/completions", {"prompt": "hi", "max_tokens": 1, "logit_bias": {"5": 100}})[0] == 200
