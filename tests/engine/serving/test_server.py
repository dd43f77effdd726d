"""The server as real processes on real sockets: the official `openai` client, raw HTTP for bad input,
disconnects, a dying engine, and SIGTERM."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request

import openai
import pytest

from helpers.server import API_KEY, GREEDY, Server


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    s = Server(tiny_llama_dir)
    yield s
    s.stop()


def test_completions_with_openai_client(server):
    client = server.client()
    out = client.completions.create(model=server.model, prompt="Hello there", **GREEDY)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 24
    assert out.usage.prompt_tokens + 24 == out.usage.total_tokens
    many = client.completions.create(model=server.model, prompt=["Hello there", [5, 6, 7]], n=2, **GREEDY)
    assert sorted(c.index for c in many.choices) == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text == out.choices[0].text  # greedy n=2: the same text
    lp = client.completions.create(model=server.model, prompt="Hello there", logprobs=2, **GREEDY)
    assert len(lp.choices[0].logprobs.tokens) == 24 and len(lp.choices[0].logprobs.top_logprobs[0]) == 2
    assert all(v <= 0 for v in lp.choices[0].logprobs.token_logprobs)
    echo = client.completions.create(model=server.model, prompt="Hello there", echo=True, **GREEDY)
    assert echo.choices[0].text == "Hello there" + out.choices[0].text
    assert client.models.list().data[0].id == server.model


def test_streamed_text_equals_non_streamed(server):
    client = server.client()
    for chat in (False, True):
        if chat:
            kwargs = dict(model=server.model, messages=[{"role": "user", "content": "Tell me"}], **GREEDY)
            full = client.chat.completions.create(**kwargs).choices[0].message.content
            chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
            pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        else:
            kwargs = dict(model=server.model, prompt="Numbers: 1 2 3", **{**GREEDY, "max_tokens": 60})
            full = client.completions.create(**kwargs).choices[0].text
            chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
            pieces = [c.choices[0].text for c in chunks if c.choices]
        assert "".join(pieces) == full
        # No event carries half a UTF-8 character: replacement characters appear only where the whole
        # text has them (random byte-level tokens can form invalid sequences that never complete).
        assert sum(p.count("\ufffd") for p in pieces) == full.count("\ufffd")
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_streamed_n_logprobs_echo_equal_non_streamed(server):
    """Every field a stream's chunks carry, against the non-streamed response of the same greedy request."""
    client = server.client()
    for extra in (dict(echo=True), dict(logprobs=2)):
        kwargs = dict(model=server.model, prompt="Hello there", n=2, **extra, **GREEDY)
        full = client.completions.create(**kwargs)
        texts, tokens, offsets, reasons = {}, {}, {}, {}
        for chunk in client.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
                tokens[c.index] = tokens.get(c.index, []) + (c.logprobs.tokens if c.logprobs else [])
                offsets[c.index] = offsets.get(c.index, []) + (c.logprobs.text_offset if c.logprobs else [])
                reasons[c.index] = c.finish_reason or reasons.get(c.index)
        assert sorted(texts) == [0, 1]
        for c in full.choices:
            assert texts[c.index] == c.text and reasons[c.index] == c.finish_reason == "length"
            if c.logprobs is not None:
                # each token's text starts where the ones before it end, counted across the stream's chunks
                ends = list(itertools.accumulate(len(t) for t in c.logprobs.tokens))
                assert c.logprobs.text_offset == [0] + ends[:-1] and "".join(c.logprobs.tokens) == c.text
                assert tokens[c.index] == c.logprobs.tokens and offsets[c.index] == c.logprobs.text_offset
    chat = dict(model=server.model, messages=[{"role": "user", "content": 'Tell me "more"'}], n=2, **GREEDY)
    full_chat = client.chat.completions.create(**chat)
    content, roles = {}, {}
    for chunk in client.chat.completions.create(stream=True, **chat):
        assert chunk.object == "chat.completion.chunk" and chunk.model == server.model
        for c in chunk.choices:
            content[c.index] = content.get(c.index, "") + (c.delta.content or "")
            roles[c.index] = roles.get(c.index) or c.delta.role
    assert roles == {0: "assistant", 1: "assistant"}
    assert all(content[c.index] == c.message.content for c in full_chat.choices)


def test_stop_strings_cut_exactly(server):
    client = server.client()
    full = client.completions.create(model=server.model, prompt="The quick", **GREEDY).choices[0].text
    stop = full[6:9]
    assert stop and len(full) > 9
    expected = full[: full.index(stop)]
    cut = client.completions.create(model=server.model, prompt="The quick", stop=[stop], **GREEDY).choices[0]
    assert cut.text == expected and cut.finish_reason == "stop"
    streamed = client.completions.create(model=server.model, prompt="The quick", stop=stop, stream=True, **GREEDY)
    chunks = [c.choices[0] for c in streamed if c.choices]
    assert "".join(c.text for c in chunks) == expected
    assert cut.model_extra["stop_reason"] == chunks[-1].model_extra["stop_reason"] == stop  # vLLM's field


def test_stop_token_ids_leave_their_text_out_and_report_the_id(server):
    client = server.client()
    ids = json.loads(
        server.post(
            "/v1/completions",
            {"prompt": "The quick", "max_tokens": 10, "temperature": 0, "ignore_eos": True, "logprobs": 0},
        )[1]
    )
    tokens = ids["choices"][0]["logprobs"]["tokens"]
    # logprobs 0: each token's entry holds the sampled token alone (OpenAI's completions shape)
    assert [list(top) for top in ids["choices"][0]["logprobs"]["top_logprobs"]] == [[t] for t in tokens]
    stop_id = json.loads(server.post("/tokenize", {"prompt": tokens[4]})[1])["tokens"]
    assert len(stop_id) == 1, "a token's text tokenizes back to itself"
    first = tokens.index(tokens[4])
    for stream in (False, True):
        out = client.completions.create(
            model=server.model,
            prompt="The quick",
            max_tokens=10,
            temperature=0,
            stream=stream,
            extra_body={"ignore_eos": True, "stop_token_ids": stop_id},
        )
        choices = [c.choices[0] for c in out if c.choices] if stream else [out.choices[0]]
        assert "".join(c.text for c in choices) == "".join(tokens[:first])
        assert choices[-1].finish_reason == "stop" and choices[-1].model_extra["stop_reason"] == stop_id[0]


BAD = [
    (b"{not json", 400),
    ({"prompt": 5}, 400),
    ({"prompt": "hi", "max_tokens": "ten"}, 400),
    ({"prompt": "hi", "temperature": -1}, 400),
    ({"prompt": "hi", "top_p": 1.5}, 400),
    ({"prompt": "hi", "n": 0}, 400),
    ({"prompt": "hi", "logit_bias": {"999999": 5}}, 400),
    ({"prompt": ""}, 400),
    ({"prompt": [[]]}, 400),
    ({"prompt": "word " * 200}, 400),  # longer than the context
    ({"prompt": "hi", "max_tokens": 500}, 400),  # more than fits
    ({"prompt": [10**9]}, 400),
    ({"prompt": "hi", "model": "no-such-model"}, 404),
    ({"prompt": "hi", "stream": "yes"}, 400),
    ({"prompt": "hi", "temperature": float("nan")}, 400),
    ({"prompt": "hi", "suffix": "end"}, 400),
    ({"prompt": "hi", "best_of": 3}, 400),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400),  # only with stream
    ({"prompt": "hi", "guided_choice": []}, 400),
    ({"prompt": "hi", "guided_json": "{not a schema"}, 400),
]


@pytest.mark.parametrize("payload,status", BAD)
def test_bad_input_gets_openai_error(server, payload, status):
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    code, raw = server.post("/v1/completions", body)
    assert code == status, raw
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert "Traceback" not in error["message"] and "/work" not in error["message"]


def test_auth_size_and_chat_errors(server):
    for path in ("/v1/models", "//v1/models", "/v1/../v1/models"):
        assert server.get(path, key=None)[0] == 401
        assert server.get(path, key="wrong")[0] == 401
    assert server.get("/health", key=None)[0] == 200 and server.get("/metrics", key=None)[0] == 200
    code, raw = server.post("/v1/completions", b'{"prompt": "' + b"a" * (17 << 20) + b'"}')
    assert code == 413 and json.loads(raw)["error"]["message"]
    assert server.post("/v1/chat/completions", {"messages": []})[0] == 400
    assert server.post("/v1/chat/completions", {"messages": [{"role": "user"}]})[0] == 400
    assert server.post("/tokenize", {"prompt": "hello"})[0] == 200
    tokens = json.loads(server.post("/tokenize", {"prompt": "hello world"})[1])["tokens"]
    assert json.loads(server.post("/detokenize", {"tokens": tokens})[1])["prompt"] == "hello world"
    # still serving
    assert server.client().completions.create(model=server.model, prompt="ok", max_tokens=2).choices


def test_disconnect_mid_stream_frees_blocks(server):
    baseline = server.metric("kiln_kv_cache_free_blocks")
    req = urllib.request.Request(
        server.url + "/v1/completions",
        method="POST",
        data=json.dumps({"prompt": "x " * 40, "max_tokens": 80, "stream": True, "ignore_eos": True}).encode(),
    )
    req.add_header("Authorization", f"Bearer {API_KEY}")
    resp = urllib.request.urlopen(req, timeout=60)
    resp.readline()
    resp.readline()
    resp.close()  # the client goes away mid-decode
    deadline = time.time() + 60  # generous: CI machines are small and may be busy
    while time.time() < deadline:
        if server.metric("kiln_num_requests_running") == 0 and server.metric("kiln_kv_cache_free_blocks") == baseline:
            break
        time.sleep(0.2)
    assert server.metric("kiln_num_requests_running") == 0
    assert server.metric("kiln_kv_cache_free_blocks") == baseline


def test_engine_death_turns_health_503(tiny_llama_dir):
    s = Server(tiny_llama_dir, "--max-model-len", "512")
    try:
        stream = s.client().completions.create(
            model=s.model, prompt="x", max_tokens=500, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(stream))
        os.kill(s.engine_pid(), signal.SIGKILL)
        start = time.time()
        with pytest.raises(openai.APIError):
            for _ in stream:
                pass
        assert time.time() - start < 5
        assert s.get("/health")[0] == 503
        assert s.post("/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 503
    finally:
        s.stop()
    assert s.proc.returncode == 0


def test_sigterm_drains_then_exits_zero(tiny_llama_dir):
    import threading

    s = Server(tiny_llama_dir, "--max-model-len", "512")
    result = {}

    def long_request():
        result["out"] = s.client().completions.create(
            model=s.model, prompt="x", max_tokens=450, extra_body={"ignore_eos": True}
        )

    t = threading.Thread(target=long_request)
    t.start()
    while s.metric("kiln_num_requests_running") == 0:  # the request is in the engine
        time.sleep(0.05)
    s.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    assert s.post("/v1/completions", {"prompt": "x", "max_tokens": 2})[0] in (503,)
    t.join(60)
    assert result["out"].usage.completion_tokens == 450
    assert s.proc.wait(30) == 0
    assert subprocess.run(["pgrep", "-P", str(s.proc.pid)], capture_output=True).stdout == b""


def test_largest_seed_with_n_choices(server):
    """The n choices draw seeds seed, seed+1, ...: at the top of the range they wrap, not overflow."""
    code, raw = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 3, "n": 2, "seed": 2**64 - 1})
    assert code == 200 and len(json.loads(raw)["choices"]) == 2
    deadline = time.time() + 30
    while server.metric("kiln_num_requests_running") and time.time() < deadline:
        time.sleep(0.2)
    assert server.metric("kiln_num_requests_running") == 0
