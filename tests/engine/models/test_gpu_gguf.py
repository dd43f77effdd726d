"""A GGUF file on the GPU: a tiny Llama of k-quant and Q8_0 tensors (tests/helpers/gguf_files), dequantized at load
into bf16, compiled with CUDA graphs, as close to transformers' float32 load of the file as transformers' own bf16
run is."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kiln.engine import LLM, SamplingParams

from helpers.gguf_files import T, make_hf_model, write_gguf
from helpers.models import assert_bf16_as_close_as_hf

PROMPTS = [[1, 17, 250, 33, 9, 101, 77, 5, 300, 2, 41, 42, 43], [500, 3, 3, 3, 64, 128, 256, 9]]


@pytest.mark.gpu
def test_gguf_on_the_gpu_in_cuda_graphs(tmp_path):
    types = {"ffn_down": T.Q6_K, "output": T.Q6_K, "token_embd": T.Q8_0}
    path = write_gguf(make_hf_model(tmp_path / "hf", "llama"), tmp_path / "tiny.gguf", "llama", types, T.Q4_K)
    load = dict(gguf_file=path.name, dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), **load).eval()
    hf16 = AutoModelForCausalLM.from_pretrained(str(path.parent), **load).to("cuda", torch.bfloat16).eval()
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, ignore_eos=True)
    with LLM(str(path), dtype="bfloat16", max_model_len=128, num_kv_blocks=64) as llm:
        assert llm.engine.startup_stats["cudagraphs_captured"] > 0
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert_bf16_as_close_as_hf(hf, hf16, PROMPTS, outputs)
