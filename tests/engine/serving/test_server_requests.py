"""Against a real server process: the chat messages and fields it takes and refuses, the model's
generation_config.json defaults, and settings refused at start-up."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from helpers.server import GREEDY, Server, free_port


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    s = Server(tiny_llama_dir)
    yield s
    s.stop()


CHAT_BAD = [
    {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},  # without logprobs: true
    {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 0},  # (any value, as vLLM)
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
    {"messages": [{"role": "user", "content": None}]},
    {"messages": [{"role": "user", "content": "hi", "tool_calls": []}]},  # tool calls are an assistant's
    {
        "messages": [
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}
        ]
    },  # arguments not JSON
    # tools without tool_choice are "auto", which needs the server's tool-call flags (test_tool_calling.py)
    {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
    {"messages": [{"role": "user", "content": "hi"}], "tools": ["f"], "tool_choice": "none"},
    {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"},  # no tools
]


@pytest.mark.parametrize("payload", CHAT_BAD, ids=range(len(CHAT_BAD)))
def test_bad_chat_input_gets_openai_error(server, payload):
    code, raw = server.post("/v1/chat/completions", {**payload, "max_tokens": 2})
    assert code == 400, raw
    assert json.loads(raw)["error"]["message"]


def test_chat_takes_text_parts_and_tool_turns(server):
    """Content as a list of text parts is the same prompt as the parts joined by newlines; an assistant turn with
    tool calls and no content, the tool's answer, and tools shown with tool_choice "none" are taken."""
    client = server.client()
    parts = [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "more"}]
    by_parts = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": parts}], **GREEDY
    )
    joined = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Tell me\nmore"}], **GREEDY
    )
    assert by_parts.choices[0].message.content == joined.choices[0].message.content
    assert by_parts.usage.prompt_tokens == joined.usage.prompt_tokens
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "cold"},
    ]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    out = client.chat.completions.create(
        model=server.model, messages=messages, tools=tools, tool_choice="none", **GREEDY
    )
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == GREEDY["max_tokens"]


def test_generation_config_sets_the_request_defaults(tiny_llama_dir, tmp_path):
    """The model's generation_config.json temperature 0: a request that names none is greedy (its n choices
    alike, and as an explicit temperature 0); with --generation-config vllm it samples at 1."""
    d = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 511, "temperature": 0.0}))
    body = {"prompt": "The quick", "max_tokens": 8, "n": 3, "ignore_eos": True}
    for flag in ("auto", "vllm"):
        s = Server(d, "--generation-config", flag)
        try:
            texts = {c["text"] for c in json.loads(s.post("/v1/completions", body)[1])["choices"]}
            greedy = json.loads(s.post("/v1/completions", {**body, "n": 1, "temperature": 0})[1])["choices"][0]
        finally:
            s.stop()
        assert texts == {greedy["text"]} if flag == "auto" else len(texts) > 1, (flag, texts)


def test_a_setting_the_engine_refuses_ends_serve_with_one_line(tiny_llama_dir, tmp_path):
    """As `kiln generate`: a bad model or setting found while the engine core starts is one error line and exit
    code 2, not two tracebacks."""
    cmd = [
        sys.executable,
        "-m",
        "kiln.engine.cli",
        "serve",
        str(tiny_llama_dir),
        "--enforce-eager",
        "--max-model-len",
        "100000",
        "--port",
        str(free_port()),
    ]
    ipc_parent = tmp_path / "ipc"  # (the server's TMPDIR: its IPC directory is made there)
    ipc_parent.mkdir()
    env = {**os.environ, "TMPDIR": str(ipc_parent)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "kiln: error: max_model_len 100000 exceeds the model's 512 positions" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not list(ipc_parent.iterdir())  # the IPC directory went with the engine core
    # a generation_config.json whose defaults are out of range: refused before the engine starts
    bad = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, bad)
    (bad / "generation_config.json").write_text(json.dumps({"temperature": -1.0}))
    cmd[cmd.index(str(tiny_llama_dir))], cmd[cmd.index("100000")] = str(bad), "64"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "kiln: error:" in proc.stderr and "temperature" in proc.stderr, proc.stderr[-2000:]
