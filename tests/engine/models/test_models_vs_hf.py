"""Kiln's greedy tokens equal Hugging Face `generate()` on tiny random-weight models (fp32, CPU).

The only allowed difference: where the reference's top two logits lie within 1e-5, either token is a
correct argmax, so the two may part ways there (and we stop comparing).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kiln.engine import LLM, SamplingParams

PROMPTS = [
    [5, 17, 33, 2, 101, 45, 9],
    [7, 7, 7],
    list(range(20, 61)),  # 41 tokens: several blocks
    [300, 12],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
]
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_reference(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    cache: dict[tuple[int, ...], list[int]] = {}

    def generate(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in cache:
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([prompt]),
                    max_new_tokens=MAX_TOKENS,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )
            cache[key] = out[0, len(prompt) :].tolist()
        return cache[key]

    def assert_matches(prompt: list[int], tokens: list[int]) -> None:
        """`tokens` equal the reference's first len(tokens) greedy tokens, up to a near-tie."""
        expected = generate(prompt)
        assert 0 < len(tokens) <= len(expected)
        for i, (got, want) in enumerate(zip(tokens, expected)):
            if got == want:
                continue
            with torch.no_grad():
                logits = model(torch.tensor([prompt + expected[:i]])).logits[0, -1]
            top2 = logits.topk(2).values
            assert top2[0] - top2[1] <= 1e-5, f"token {i} differs ({got} vs {want}) without a near-tie"
            return

    return assert_matches


def test_batch_of_prompts(tiny_model_dir, hf_reference):
    llm = LLM(str(tiny_model_dir), enforce_eager=True, max_model_len=256)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == PROMPTS
    for prompt, output in zip(PROMPTS, outputs):
        assert output.outputs[0].finish_reason == "length" and len(output.outputs[0].token_ids) == MAX_TOKENS
        hf_reference(prompt, output.outputs[0].token_ids)


def test_chunked_prefill(tiny_model_dir, hf_reference):
    """A 7-token budget splits every longer prompt into chunks, mixed with other requests' decodes."""
    llm = LLM(str(tiny_model_dir), enforce_eager=True, max_model_len=256, max_num_batched_tokens=7)
    for prompt, output in zip(PROMPTS, llm.generate(PROMPTS, GREEDY, use_tqdm=False)):
        hf_reference(prompt, output.outputs[0].token_ids)


def test_preemption(tiny_model_dir, hf_reference):
    """12 usable blocks of 4 tokens cannot hold five requests of up to 65 tokens: some are preempted."""
    llm = LLM(str(tiny_model_dir), enforce_eager=True, max_model_len=48, num_kv_blocks=13, block_size=4)
    prompts = [p[:20] for p in PROMPTS]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, output in zip(prompts, outputs):
        hf_reference(prompt, output.outputs[0].token_ids)
    assert llm.engine.kv_cache_manager.num_free_blocks == 12  # every block back in the pool


def test_prefix_cache_hits(tiny_model_dir, hf_reference):
    shared = list(range(100, 140))  # 40 tokens: two full blocks of 16
    prompts = [shared + [1, 2], shared + [3], shared + [4, 5, 6]]
    llm = LLM(str(tiny_model_dir), enforce_eager=True, max_model_len=256)
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    for prompt, output in zip(prompts, [first, *rest]):
        hf_reference(prompt, output.outputs[0].token_ids)
    assert all(o.num_cached_tokens == 32 for o in rest)  # fewer computed tokens: two blocks came from the cache
    assert llm.engine.kv_cache_manager.prefix_cache_hits >= 64


def test_triton_kernels_match_hf(tiny_model_dir, hf_reference):
    """The GPU path's kernels (Triton attention, fused norm/RoPE/SiLU), run in Triton's interpreter on CPU."""
    from kiln.engine.models.layers import use_fused_kernels

    llm = LLM(
        str(tiny_model_dir),
        enforce_eager=True,
        max_model_len=256,
        attention_backend="triton",
        max_num_batched_tokens=16,
    )
    use_fused_kernels(llm.engine.executor.model, True)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = PROMPTS[:3]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        hf_reference(prompt, output.outputs[0].token_ids)


def test_mistral_batch(tiny_mistral_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_mistral_dir, dtype=torch.float32).eval()
    llm = LLM(str(tiny_mistral_dir), enforce_eager=True, max_model_len=256, max_num_batched_tokens=16)
    for prompt, output in zip(PROMPTS, llm.generate(PROMPTS, GREEDY, use_tqdm=False)):
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(prompt) :].tolist()
        assert output.outputs[0].token_ids == ref
