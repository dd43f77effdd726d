"""Prompt log-probabilities over HTTP, against Hugging Face's forward pass of the served tiny model (fp32): the
completions `echo` + `logprobs` that evaluation harnesses send (lm-eval's loglikelihood requests), `max_tokens: 0`
with `echo`, vLLM's `prompt_logprobs` on completions and chat, and streamed echo."""

from __future__ import annotations

import json
import math

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.server import Server

PROMPT = [12, 40, 7, 99, 3, 250, 18, 61, 5, 77, 140, 9]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    s = Server(tiny_llama_dir)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0].double(), dim=-1)


def test_echo_with_logprobs_scores_the_prompt(server, reference):
    """lm-eval's loglikelihood request: the prompt's tokens with their logprobs (the first null), then the one
    generated token's."""
    body = {"model": server.model, "prompt": [PROMPT, PROMPT[:5]], "max_tokens": 1, "logprobs": 2, "echo": True}
    code, raw = server.post("/v1/completions", {**body, "temperature": 0})
    assert code == 200, raw
    choice = json.loads(raw)["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(PROMPT) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for p in range(1, len(PROMPT)):
        assert math.isclose(lp["token_logprobs"][p], reference[p - 1, PROMPT[p]].item(), abs_tol=1e-4)
        # the top 2, and the prompt token when it is not among them (keyed by text: two ids may read the same)
        allowed = reference[p - 1].topk(2).values.tolist() + [reference[p - 1, PROMPT[p]].item()]
        assert 1 <= len(lp["top_logprobs"][p]) <= 3
        assert all(any(math.isclose(v, a, abs_tol=1e-4) for a in allowed) for v in lp["top_logprobs"][p].values())
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    assert choice["text"].startswith("".join(lp["tokens"][: len(PROMPT)]))


def test_max_tokens_zero_with_echo_is_the_prompt_alone(server, reference):
    client = server.client()
    reply = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    choice = reply.choices[0]
    assert len(choice.logprobs.tokens) == len(PROMPT) and choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 0 and reply.usage.prompt_tokens == len(PROMPT)
    total = sum(choice.logprobs.token_logprobs[1:])
    assert math.isclose(total, sum(reference[p - 1, PROMPT[p]].item() for p in range(1, len(PROMPT))), abs_tol=1e-3)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt=PROMPT, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"


@pytest.mark.parametrize("chat", [False, True])
def test_vllm_prompt_logprobs(server, reference, chat):
    if chat:
        body = {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1, "max_tokens": 2}
        code, raw = server.post("/v1/chat/completions", {"model": server.model, **body})
        assert code == 200, raw
        entries = json.loads(raw)["prompt_logprobs"]  # (on the response: the choices share the prompt)
        assert entries[0] is None and all(len(e) in (1, 2) for e in entries[1:])
        return
    body = {"model": server.model, "prompt": PROMPT, "prompt_logprobs": 1, "max_tokens": 2}
    code, raw = server.post("/v1/completions", body)
    assert code == 200, raw
    entries = json.loads(raw)["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(PROMPT) and entries[0] is None
    for p in range(1, len(PROMPT)):
        own = entries[p][str(PROMPT[p])]
        assert math.isclose(own["logprob"], reference[p - 1, PROMPT[p]].item(), abs_tol=1e-4)
        assert own["rank"] == int((reference[p - 1] > reference[p - 1, PROMPT[p]]).sum()) + 1
        assert isinstance(own["decoded_token"], str)


def test_streamed_echo_with_logprobs_is_the_whole_reply(server):
    client = server.client()
    kw = dict(model=server.model, prompt=PROMPT, max_tokens=4, echo=True, logprobs=1, temperature=0)
    whole = client.completions.create(**kw).choices[0]
    text, tokens, token_logprobs = "", [], []
    for chunk in client.completions.create(stream=True, **kw):
        choice = chunk.choices[0]
        text += choice.text
        if choice.logprobs is not None:
            tokens += choice.logprobs.tokens
            token_logprobs += choice.logprobs.token_logprobs
    assert text == whole.text and tokens == whole.logprobs.tokens
    assert token_logprobs == whole.logprobs.token_logprobs


BAD = [
    ({"prompt": PROMPT, "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": PROMPT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": PROMPT, "prompt_logprobs": "1"}, "prompt_logprobs"),
]


@pytest.mark.parametrize("fields,param", BAD, ids=range(len(BAD)))
def test_bad_prompt_logprobs_name_the_field(server, fields, param):
    code, raw = server.post("/v1/completions", {"model": server.model, "max_tokens": 1, **fields})
    assert code == 400, raw
    assert json.loads(raw)["error"]["param"] == param
