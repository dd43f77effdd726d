"""The smaller holes of the second red team's round, on a real server: a tool schema's depth counted as the tool's own
under tool_choice "required", a gzip body with anything after its end, a required or named choice's parse held to
the tools offered, the Responses API's metadata held to OpenAI's bounds, and a port out of range in one line."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from kiln.engine.serving.openai_requests import parse_chat
from kiln.engine.serving.responses_requests import (
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE_CHARS,
)
from kiln.engine.serving.tool_calls import tool_parser
from kiln.engine.structured_output.constraints import MAX_SCHEMA_DEPTH

from helpers.server import API_KEY, LEAK, Server

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    s = Server(tiny_llama_dir)
    yield s
    s.stop()


def nested(levels: int) -> dict:
    """An object schema whose deepest schema sits `levels` below its root."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def tools_of(parameters: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_a_tool_schema_is_as_deep_as_it_is_alone(server, choice):
    for levels, status in ((MAX_SCHEMA_DEPTH, 200), (MAX_SCHEMA_DEPTH + 1, 400)):
        body = {"messages": HI, "max_tokens": 2, "tools": tools_of(nested(levels)), "tool_choice": choice}
        answer, raw = server.post("/v1/chat/completions", body)
        assert answer == status, raw
        if status == 400:
            error = json.loads(raw)["error"]
            assert error["param"] == "tools" and f"deeper than {MAX_SCHEMA_DEPTH}" in error["message"], error


def post_encoded(server: Server, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(server.url + "/v1/chat/completions", data=body, method="POST")
    for header, value in [
        ("Content-Type", "application/json"),
        ("Authorization", f"Bearer {API_KEY}"),
        ("Content-Encoding", "gzip"),
    ]:
        request.add_header(header, value)
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_gzip_body_with_anything_after_its_end_is_refused(server):
    body = json.dumps({"messages": HI, "max_tokens": 2}).encode()
    assert post_encoded(server, gzip.compress(body))[0] == 200
    other = json.dumps({"messages": HI, "max_tokens": 100}).encode()
    for tail, words in ((b"garbage", "bytes after"), (gzip.compress(other), "a second gzip member")):
        status, answer = post_encoded(server, gzip.compress(body) + tail)
        assert status == 400 and words in answer["error"]["message"], answer


def test_required_and_named_choices_parse_only_calls_to_offered_tools():
    tools = tools_of({"type": "object", "properties": {}})
    for choice, text in (
        ("required", '[{"name": "g", "parameters": {}}]'),
        ({"type": "function", "function": {"name": "f"}}, "{}"),
    ):
        parsed = parse_chat({"messages": HI, "tools": tools, "tool_choice": choice})
        parser = tool_parser(parsed, None)
        assert parser.offered == {"f"}
        calls = parser.scan(text, final=True).calls
        assert [call.name for call in calls] == ([] if choice == "required" else ["f"])


def test_responses_metadata_is_held_to_openais_bounds(server):
    def respond(metadata, stream: bool = False) -> tuple[int, bytes]:
        body = {"input": "hi", "max_output_tokens": 2, "metadata": metadata, "stream": stream}
        return server.post("/v1/responses", body)

    fullest = {f"k{i}".ljust(MAX_METADATA_KEY_CHARS, "x"): "v" * MAX_METADATA_VALUE_CHARS for i in range(16)}
    assert len(fullest) == MAX_METADATA_PAIRS
    status, raw = respond(fullest)
    assert status == 200 and json.loads(raw)["metadata"] == fullest
    status, raw = respond(fullest, stream=True)
    assert status == 200 and raw.decode().count('"metadata"') <= 3  # created, in_progress, completed: bounded
    too_many = {**fullest, "one more": "v"}
    key_too_long = {"k" * (MAX_METADATA_KEY_CHARS + 1): "v"}
    value_too_long = {"k": "v" * (MAX_METADATA_VALUE_CHARS + 1)}
    for metadata in (too_many, key_too_long, value_too_long, {"k": 1}, {"k": None}, ["k", "v"], "kv"):
        status, raw = respond(metadata)
        error = json.loads(raw)["error"]
        assert status == 400 and error["param"] == "metadata", (metadata, error)


def test_a_port_out_of_range_is_one_line(tiny_llama_dir):
    for port in ("70000", "-1"):
        done = subprocess.run(
            [sys.executable, "-m", "kiln.engine.cli", "serve", str(tiny_llama_dir), "--port", port],
            capture_output=True,
            text=True,
            timeout=120,
        )
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and "--port" in lines[0], done.stderr
        assert not LEAK.search(lines[0])
