"""gpt-oss on the GPU: the Triton kernels (attention with sinks, prefill and split-KV decode; the experts' grouped
matmuls, MXFP4 dequantized in registers) eager and compiled inside the CUDA graphs; float32 against transformers token
for token, bf16 as close to transformers' float32 as its own bf16 run is; bf16 and MXFP4 checkpoints."""

from __future__ import annotations

import pytest
import torch

from kiln.engine import LLM, SamplingParams

from helpers.gpt_oss import hf_gpt_oss, make_tiny_gpt_oss_dir
from helpers.models import assert_bf16_as_close_as_hf, assert_greedy_matches_hf

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 33, 2, 101, 45, 9], list(range(20, 180)), [300, 12], [(7 * i) % 480 + 3 for i in range(200)]]
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module", params=["bf16", "mxfp4"])
def gpt_oss_dir(request, tmp_path_factory):
    return make_tiny_gpt_oss_dir(tmp_path_factory.mktemp(f"gpt_oss_{request.param}"), request.param == "mxfp4")


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cudagraphs"])
def test_float32_matches_hf(gpt_oss_dir, eager, tmp_path):
    hf = hf_gpt_oss(gpt_oss_dir)
    kwargs = dict(dtype="float32", max_model_len=512, max_num_batched_tokens=48, compile_cache_dir=str(tmp_path))
    with LLM(str(gpt_oss_dir), enforce_eager=eager, **kwargs) as llm:
        if not eager:
            assert llm.engine.startup_stats["cudagraphs_captured"] > 0
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_greedy_matches_hf(hf, PROMPTS, outputs, MAX_TOKENS, 2e-3, near_tie=True)


def test_bf16_in_cuda_graphs_as_close_as_hf(gpt_oss_dir, tmp_path):
    hf = hf_gpt_oss(gpt_oss_dir)
    hf16 = hf_gpt_oss(gpt_oss_dir, torch.bfloat16).cuda()
    with LLM(str(gpt_oss_dir), dtype="bfloat16", max_model_len=512, compile_cache_dir=str(tmp_path)) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_bf16_as_close_as_hf(hf, hf16, PROMPTS, outputs)
