"""The Gated DeltaNet hybrids on the GPU: the Triton kernels (chunked delta rule, recurrent step, causal conv, gated
norm) eager, and compiled with the linear-attention op inside the full decode CUDA graphs; float32 against
transformers token for token, bf16 as close to transformers' float32 as its own bf16 run is; a next turn from a
snapshot; speculative decoding's drafts verified in full graphs (every request k drafts) and piecewise ones, and a
hybrid's drafts made on the device folded into its recurrent states with async scheduling on."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kiln.engine import LLM, SamplingParams

from helpers.models import assert_bf16_as_close_as_hf, assert_greedy_matches_hf

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 33, 2, 101, 45, 9], [7, 7, 7], list(range(20, 100)), [300, 12], list(range(1, 200, 2))]
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cudagraphs"])
def test_float32_matches_hf(tiny_hybrid_dir, eager, tmp_path):
    hf = AutoModelForCausalLM.from_pretrained(tiny_hybrid_dir, dtype=torch.float32).eval()
    kwargs = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=48, compile_cache_dir=str(tmp_path))
    with LLM(str(tiny_hybrid_dir), enforce_eager=eager, **kwargs) as llm:
        if not eager:
            assert llm.engine.startup_stats["cudagraphs_captured"] > 0
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_greedy_matches_hf(hf, PROMPTS, outputs, MAX_TOKENS, 2e-3, near_tie=True)


def test_bf16_in_cuda_graphs_as_close_as_hf(tiny_hybrid_dir, tmp_path):
    hf = AutoModelForCausalLM.from_pretrained(tiny_hybrid_dir, dtype=torch.float32).eval()
    hf16 = AutoModelForCausalLM.from_pretrained(tiny_hybrid_dir, dtype=torch.bfloat16).cuda().eval()
    with LLM(str(tiny_hybrid_dir), dtype="bfloat16", max_model_len=256, compile_cache_dir=str(tmp_path)) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_bf16_as_close_as_hf(hf, hf16, PROMPTS, outputs)


def test_next_turn_from_a_snapshot_on_the_gpu(tiny_qwen3_5_dir, tmp_path):
    first = list(range(30, 100))
    kwargs = dict(dtype="float32", max_model_len=512, compile_cache_dir=str(tmp_path))
    with LLM(str(tiny_qwen3_5_dir), **kwargs) as llm:
        answer = llm.generate([first], GREEDY, use_tqdm=False)[0]
        second = first + answer.outputs[0].token_ids + [9, 8, 7]
        hit = llm.generate([second], GREEDY, use_tqdm=False)[0]
    assert hit.num_cached_tokens == 64
    with LLM(str(tiny_qwen3_5_dir), enable_prefix_caching=False, **kwargs) as cold:
        want = cold.generate([second], GREEDY, use_tqdm=False)[0]
    assert hit.outputs[0].token_ids == want.outputs[0].token_ids


class ContinuationDrafter:
    """Drafts k tokens every step from the run without drafts (its last one wrong every other call): steps whose
    every request verifies k drafts, which replay the full verification graphs, and kept and rejected drafts."""

    def __init__(self, k: int, continuations: dict[tuple[int, ...], list[int]]) -> None:
        self.k, self.continuations, self.calls = k, continuations, 0

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        for prompt, continuation in self.continuations.items():
            if tuple(token_ids[: len(prompt)]) == prompt:
                draft = continuation[len(token_ids) - len(prompt) :][: min(self.k, limit)]
                self.calls += 1
                if draft and self.calls % 2:
                    draft[-1] = (draft[-1] + 1) % 512
                return draft
        return []


def test_drafts_verified_in_full_graphs_equal_no_drafts(tiny_llama_dir, tmp_path):
    from bench_spec import install  # noqa: PLC0415

    prompts = [[5, 17, 33, 2, 101, 45, 9] * 4, list(range(20, 60)) * 2]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=1)
    kwargs = dict(dtype="float32", max_model_len=256, compile_cache_dir=str(tmp_path))
    with LLM(str(tiny_llama_dir), **kwargs) as llm:
        want = llm.generate(prompts, params, use_tqdm=False)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    with LLM(str(tiny_llama_dir), speculative_config=spec, **kwargs) as llm:
        continuations = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, want)}
        install(llm, ContinuationDrafter(3, continuations))  # (on the host: `ngram` itself looks up on the device)
        got = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.scheduler.num_accepted_tokens > 0
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_device_drafts_fold_into_the_hybrids_state(tiny_qwen3_5_dir, tmp_path):
    """Drafts made on the device (bench_spec's oracle: the run without drafts' tokens, about 40% of draft tokens
    corrupted) on the hybrid, compiled with CUDA graphs: each step scheduled before the verdict on the one in flight,
    the Triton kernels folding the kept tokens into the states; float32 tokens those of the run without drafts."""
    from bench_spec import DeviceDrafter, install  # noqa: PLC0415

    prompts = [[5, 17, 33, 2, 101, 45, 9, 5, 17], [7] * 9, list(range(20, 29)), [300, 12] * 4 + [1]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kwargs = dict(dtype="float32", max_model_len=128, block_size=4, compile_cache_dir=str(tmp_path))
    with LLM(str(tiny_qwen3_5_dir), **kwargs) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    with LLM(str(tiny_qwen3_5_dir), speculative_config=spec, **kwargs) as llm:
        continuations = {tuple(p): list(w) for p, w in zip(prompts, want)}
        install(llm, DeviceDrafter(3, llm.engine.model_config.vocab_size, continuations, keep=0.6))
        assert llm.engine.scheduler.optimistic
        for _ in range(2):  # (the second time from the first's snapshots)
            assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
        # three requests (the decode graphs' padding)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts[:3], params, use_tqdm=False)] == want[:3]
        scheduler = llm.engine.scheduler
        assert 0 < scheduler.num_accepted_tokens < scheduler.num_draft_tokens
        assert llm.engine.runner.full_verifications > 0
