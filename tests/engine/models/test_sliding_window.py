"""Sliding-window attention against Hugging Face (fp32, CPU; the torch backend, and the Triton one under the
interpreter; on a GPU, bf16 against the CPU run): a tiny Mistral with a window of 8 tokens and prompts of 50 and
more, so that every decode and most of the prefill sees only the window; eager and compiled, with chunked prefill,
and with a prefix hit that straddles the window's edge."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from kiln.engine import LLM, SamplingParams

from helpers.models import assert_bf16_as_close_as_hf, assert_greedy_matches_hf, skip_uninterpreted_triton

WINDOW = 8
PROMPTS = [list(range(3, 60)), [(7 * i) % 500 + 1 for i in range(70)], list(range(100, 151))]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def windowed_dir(tiny_mistral_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("windowed") / "m"
    shutil.copytree(tiny_mistral_dir, d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "sliding_window": WINDOW}))
    return d


@pytest.fixture(scope="module")
def hf(windowed_dir):
    model = AutoModelForCausalLM.from_pretrained(windowed_dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def assert_matches_hf(hf, prompts, outputs) -> None:
    assert_greedy_matches_hf(hf, prompts, outputs, MAX_TOKENS, 1e-4)


def test_the_window_matters_here(windowed_dir, tiny_mistral_dir, hf):
    """(the check has teeth: without its window the same model gives other logits on these prompts)"""
    full = AutoModelForCausalLM.from_pretrained(tiny_mistral_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        prompt = torch.tensor([PROMPTS[0]])
        assert (hf(prompt).logits[0, -1] - full(prompt).logits[0, -1]).abs().max() > 1e-2


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("budget", [None, 13], ids=["whole-prefill", "chunked-13"])
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "compiled"])
def test_a_sliding_window_matches_hf(windowed_dir, hf, tmp_path, backend, budget, enforce_eager):
    skip_uninterpreted_triton(backend)
    engine = dict(max_model_len=256, max_num_batched_tokens=budget, attention_backend=backend, device="cpu")
    with LLM(str(windowed_dir), enforce_eager=enforce_eager, compile_cache_dir=str(tmp_path), **engine) as llm:
        assert llm.engine.max_model_len == 256  # past the window
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_matches_hf(hf, PROMPTS, outputs)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_prefix_hit_across_the_window_edge(windowed_dir, hf, backend):
    """A second prompt shares the first's 48 tokens (3 blocks of 16): its prefill starts past the window's edge,
    reading cached blocks of which only the last 8 tokens are in any of its queries' windows."""
    first = list(range(3, 60))
    second = first[:48] + [400, 401, 402, 403, 404, 405]
    skip_uninterpreted_triton(backend)
    engine = dict(enforce_eager=True, max_model_len=256, attention_backend=backend, device="cpu")
    with LLM(str(windowed_dir), **engine) as llm:
        llm.generate([first], GREEDY, use_tqdm=False)
        (output,) = llm.generate([second], GREEDY, use_tqdm=False)
        assert llm.engine.scheduler.kv.prefix_cache_hits >= 48
    assert_matches_hf(hf, [second], [output])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_a_sliding_window_on_the_gpu_matches_hf(windowed_dir, hf, tmp_path, backend, enforce_eager):
    """On the GPU (the windowed Triton kernels, split-KV decode, CUDA graphs): float32 greedy tokens and
    log-probabilities Hugging Face's (within TF32's rounding of the attention's dots), and bf16 log-probabilities as
    close to them as Hugging Face's own bf16 run."""
    engine = dict(max_model_len=256, attention_backend=backend, compile_cache_dir=str(tmp_path), device="cuda")
    with LLM(str(windowed_dir), enforce_eager=enforce_eager, dtype="float32", **engine) as llm:
        assert_greedy_matches_hf(hf, PROMPTS, llm.generate(PROMPTS, GREEDY, use_tqdm=False), MAX_TOKENS, 5e-3, True)
    with LLM(str(windowed_dir), enforce_eager=enforce_eager, dtype="bfloat16", **engine) as llm:
        bf16 = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    hf16 = AutoModelForCausalLM.from_pretrained(windowed_dir, dtype=torch.bfloat16, attn_implementation="eager")
    assert_bf16_as_close_as_hf(hf, hf16.cuda().eval(), PROMPTS, bf16)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_blocks_behind_the_window_go_back_to_the_pool(windowed_dir, hf, backend):
    """Every layer slides (window 8), so a request holds only its window's blocks (of 4 tokens): the three prompts
    and their 12 tokens each (up to 82 tokens, 21 blocks) run in 15 usable blocks, chunked 8 tokens a step, without a
    preemption, equal to HF's; every block comes back."""
    skip_uninterpreted_triton(backend)
    engine = dict(enforce_eager=True, attention_backend=backend, device="cpu", block_size=4, num_kv_blocks=16)
    with LLM(str(windowed_dir), max_model_len=128, max_num_batched_tokens=8, **engine) as llm:
        assert llm.engine.kv_cache_manager.sliding_window == WINDOW
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions == 0
        assert llm.engine.kv_cache_manager.num_free_blocks == 15
    assert_matches_hf(hf, PROMPTS, outputs)


def test_a_window_preempted_request_is_recomputed(windowed_dir, hf):
    """9 usable blocks for three requests that each want 3 to 5: some are preempted, recomputed from their tokens
    (their freed blocks are not theirs to reuse), and still equal HF; no block leaks."""
    engine = dict(enforce_eager=True, attention_backend="torch", device="cpu", block_size=4, num_kv_blocks=10)
    with LLM(str(windowed_dir), max_model_len=128, max_num_batched_tokens=16, **engine) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.kv_cache_manager.num_free_blocks == 9
    assert_matches_hf(hf, PROMPTS, outputs)
