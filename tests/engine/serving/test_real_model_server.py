"""`kiln serve` on the real model (SmolLM2-135M-Instruct's GGUF file), through the official `openai` client: a chat
question answered in real words, and a completion's echoed prompt log-probabilities equal to transformers'
log-softmax over the same file (float32; the tolerance is test_smollm2's)."""

from __future__ import annotations

import math

import pytest
import torch

from helpers.real_model import smollm2_gguf, smollm2_hf
from helpers.server import Server

TOL = 2e-3


@pytest.fixture(scope="module")
def server():
    server = Server(smollm2_gguf())
    yield server
    server.stop()


def test_chat_answers_in_real_words(server):
    reply = server.client().chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0,
    )
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"  # it ends its turn by itself (<|im_end|> is an EOS)


def test_echoed_prompt_logprobs_equal_transformers(server):
    model, tokenizer = smollm2_hf()
    prompt = "The capital of France is Paris, and the capital of Germany is Berlin."
    reply = server.client().completions.create(
        model=server.model, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
    logprobs = reply.choices[0].logprobs
    assert logprobs.tokens == [tokenizer.decode([i]) for i in ids]
    assert logprobs.token_logprobs[0] is None
    for p in range(1, len(ids)):
        assert math.isclose(logprobs.token_logprobs[p], reference[p - 1, ids[p]].item(), abs_tol=TOL), p
