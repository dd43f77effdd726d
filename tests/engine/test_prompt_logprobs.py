"""Prompt log-probabilities offline (`SamplingParams(prompt_logprobs=k)`) against Hugging Face's forward pass of the
same tiny model (log_softmax at each position, fp32): whole prompts, prompts split over several steps (chunked
prefill), prompts whose prefix the cache already holds, n > 1, eager and compiled."""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from kiln.engine import LLM, SamplingParams

K = 3


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)

    def logprobs(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].double(), dim=-1)

    return logprobs


def prompts(n: int, lengths: tuple[int, int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def check(output, prompt, reference):
    """Entry p scores prompt token p given tokens < p: its logprob and rank, and the top K at that position."""
    ref = reference(prompt)
    entries = output.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    for p in range(1, len(prompt)):
        row, token, entry = ref[p - 1], prompt[p], entries[p]
        assert math.isclose(entry[token].logprob, row[token].item(), abs_tol=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(K).indices.tolist()
        assert set(entry) == set(top) | {token}
        for t in top:
            assert math.isclose(entry[t].logprob, row[t].item(), abs_tol=1e-4)


@pytest.mark.parametrize("chunk", [None, 16], ids=["whole", "chunked"])
def test_prompt_logprobs_equal_the_reference(tiny_llama_dir, reference, chunk):
    kw = {} if chunk is None else {"max_num_batched_tokens": chunk, "max_num_seqs": 4}
    llm = LLM(str(tiny_llama_dir), enforce_eager=True, max_model_len=128, **kw)
    batch = prompts(5, (2, 60))
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=K)
    for prompt, output in zip(batch, llm.generate(batch, params, use_tqdm=False)):
        check(output, prompt, reference)


def test_a_cached_prefix_still_gets_its_logprobs(tiny_llama_dir, reference):
    """The prefix cache holds the prompt's first blocks: a request asking for prompt logprobs computes them anyway;
    one that does not ask still takes the hit."""
    llm = LLM(str(tiny_llama_dir), enforce_eager=True, max_model_len=128)
    prompt = prompts(1, (70, 70), seed=1)[0]
    llm.generate([prompt[:64]], SamplingParams(max_tokens=1), use_tqdm=False)
    (output,) = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=K), use_tqdm=False)
    assert output.num_cached_tokens == 0
    check(output, prompt, reference)
    (plain,) = llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    assert plain.num_cached_tokens >= 64 and plain.prompt_logprobs is None


def test_n_choices_share_the_prompt_logprobs(tiny_llama_dir, reference):
    llm = LLM(str(tiny_llama_dir), enforce_eager=True, max_model_len=128)
    prompt = prompts(1, (20, 20), seed=2)[0]
    (output,) = llm.generate([prompt], SamplingParams(n=3, seed=0, max_tokens=3, prompt_logprobs=0), use_tqdm=False)
    assert len(output.outputs) == 3
    entries = output.prompt_logprobs
    ref = reference(prompt)
    for p in range(1, len(prompt)):
        assert list(entries[p]) == [prompt[p]]
        assert math.isclose(entries[p][prompt[p]].logprob, ref[p - 1, prompt[p]].item(), abs_tol=1e-4)


def test_compiled(tiny_llama_dir, reference, tmp_path):
    llm = LLM(str(tiny_llama_dir), max_model_len=128, max_num_batched_tokens=32, compile_cache_dir=str(tmp_path))
    batch = prompts(3, (10, 50), seed=3)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=K)
    for prompt, output in zip(batch, llm.generate(batch, params, use_tqdm=False)):
        check(output, prompt, reference)


def test_prompt_logprobs_out_of_range_is_refused():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


def test_tensor_parallel(tiny_llama_dir, reference):
    """TP=2 over gloo: rank 0 runs the LM head on the prompt rows, and the other rank joins each of its gathers."""
    llm = LLM(
        str(tiny_llama_dir), enforce_eager=True, tensor_parallel_size=2, max_model_len=128, max_num_batched_tokens=16
    )
    try:
        batch = prompts(2, (20, 40), seed=4)
        params = [SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=K), SamplingParams(max_tokens=2)]
        first, second = llm.generate(batch, params, use_tqdm=False)
        check(first, batch[0], reference)
        assert second.prompt_logprobs is None
    finally:
        llm.close()


def test_a_preempted_request_recomputes_the_same_entries(tiny_llama_dir, reference):
    """Too few KV blocks for the batch: requests are preempted and recompute from the start, prompt logprobs too."""
    llm = LLM(str(tiny_llama_dir), enforce_eager=True, max_model_len=128, num_kv_blocks=14, max_num_batched_tokens=32)
    batch = prompts(4, (40, 60), seed=5)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=K)
    outputs = llm.generate(batch, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, output in zip(batch, outputs):
        check(output, prompt, reference)
