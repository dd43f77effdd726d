"""The real model, SmolLM2-135M-Instruct from its GGUF file (Q4_1, Q8_0 and F32 tensors), against transformers' own
load of the same file (float32): the same tokenizer and chat template, the same greedy tokens and log-probabilities
for plain and chat prompts, eager and compiled, with chunked prefill and a prefix-cache hit; prompt log-probabilities
and a multiple-choice set scored by summed log-probability.

Tolerance: both sides dequantize the file with the `gguf` package into the same float32 weights, so what differs is
the order of float32 sums over 30 layers (a few 1e-5 in a log-probability); 2e-3 leaves room for that and for the
compiled path's fused kernels, and stays far below the gaps that decide a greedy token or a choice here.
"""

from __future__ import annotations

import math

import pytest
import torch

from kiln.engine import LLM, SamplingParams

from helpers.models import assert_greedy_matches_hf
from helpers.real_model import smollm2_gguf, smollm2_hf

TOL = 2e-3
MAX_TOKENS = 12
PLAIN = ["The capital of France is", "def fibonacci(n):"]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "What color is the sky?"}],
]
# question, choices, and the choice a reader would pick (the models' choices are compared with each other, not this)
CHOICES = [
    ("The capital of France is", [" Paris", " Berlin", " Madrid"]),
    ("Water freezes at a temperature of zero degrees", [" Celsius", " Kelvin", " Rankine"]),
    ("The largest planet in the solar system is", [" Jupiter", " Mercury", " Mars"]),
    ("Two plus two equals", [" four", " seven", " twelve"]),
    ("The opposite of hot is", [" cold", " loud", " green"]),
    ("A baby cat is called a", [" kitten", " puppy", " calf"]),
]


@pytest.fixture(scope="module")
def hf():
    return smollm2_hf()


@pytest.fixture(scope="module", params=["eager", "compiled"])
def llm(request):
    # a token budget of 16 splits every chat prompt's prefill over several steps
    with LLM(
        str(smollm2_gguf()),
        enforce_eager=request.param == "eager",
        max_num_batched_tokens=16,
        max_num_seqs=4,
        max_model_len=256,
        num_kv_blocks=96,
    ) as llm:
        yield llm


def chat_ids(tokenizer, messages) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]


def test_tokenizer_and_chat_template_are_transformers(llm, hf):
    _, hf_tokenizer = hf
    for text in [*PLAIN, "Ünïcödé, emoji 🔥 and\ttabs  ", "<|im_start|>user"]:
        assert llm.tokenizer.encode(text) == hf_tokenizer.encode(text)
    for messages in CHATS:
        assert chat_ids(llm.tokenizer, messages) == chat_ids(hf_tokenizer, messages)
    assert llm.engine.model_config.eos_token_ids == (hf_tokenizer.eos_token_id,)


def test_greedy_tokens_equal_transformers(llm, hf):
    model, tokenizer = hf
    prompts = [tokenizer.encode(p) for p in PLAIN] + [chat_ids(tokenizer, m) for m in CHATS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1, ignore_eos=True)
    outputs = llm.generate([list(p) for p in prompts], params, use_tqdm=False)
    assert_greedy_matches_hf(model, prompts, outputs, MAX_TOKENS, TOL)
    assert "Paris" in outputs[2].outputs[0].text  # real words, not noise
    # the same prompts again: their full blocks come from the prefix cache, and the tokens stay the same
    again = llm.generate([list(p) for p in prompts], params, use_tqdm=False)
    assert all(o.num_cached_tokens >= 16 for o in again[2:])
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outputs]


def test_prompt_logprobs_equal_transformers_log_softmax(llm, hf):
    model, tokenizer = hf
    prompt = chat_ids(tokenizer, CHATS[0])
    (output,) = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), dim=-1)
    assert output.prompt_logprobs[0] is None
    for p in range(1, len(prompt)):
        got = output.prompt_logprobs[p][prompt[p]].logprob
        assert math.isclose(got, reference[p - 1, prompt[p]].item(), abs_tol=TOL), p


def summed_logprob(prompt_logprobs, ids, start: int) -> float:
    return sum(prompt_logprobs[p][ids[p]].logprob for p in range(start, len(ids)))


def test_multiple_choice_picks_what_transformers_picks(llm, hf):
    model, tokenizer = hf
    for question, choices in CHOICES:
        stem = tokenizer.encode(question)
        prompts = [tokenizer.encode(question + choice) for choice in choices]
        assert all(p[: len(stem)] == stem for p in prompts)  # (each choice's tokens follow the question's)
        outputs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        ours = [summed_logprob(o.prompt_logprobs, p, len(stem)) for o, p in zip(outputs, prompts)]
        with torch.no_grad():
            theirs = []
            for p in prompts:
                logprobs = torch.log_softmax(model(torch.tensor([p])).logits[0].double(), dim=-1)
                theirs.append(sum(logprobs[i - 1, p[i]].item() for i in range(len(stem), len(p))))
        assert ours == pytest.approx(theirs, abs=TOL * len(prompts[0]))
        assert max(range(len(choices)), key=ours.__getitem__) == max(range(len(choices)), key=theirs.__getitem__)


def test_kiln_generate_chat_answers_a_question(capsys):
    from kiln.engine.cli import main

    question = "What is the capital of France?"
    argv = ["generate", str(smollm2_gguf()), "--chat", "--enforce-eager", "--max-tokens", "16", "--prompt", question]
    assert main([*argv, "--max-model-len", "256"]) == 0
    printed = capsys.readouterr().out
    assert f">>> {question!r}" in printed and "Paris" in printed.split(question)[1]
