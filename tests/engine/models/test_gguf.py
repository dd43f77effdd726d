"""GGUF files of several tensor types and layouts, written with the `gguf` package's writer (tests/helpers/gguf_files),
load equal to transformers' own load of the same file: greedy tokens and log-probabilities in float32.

A float32 Llama file is also compared with the Hugging Face model it was written from, which checks the names and the
undoing of llama.cpp's q/k row order against the original rather than against another reader of the file."""

from __future__ import annotations

import tracemalloc

import pytest
import torch
from transformers import AutoModelForCausalLM

from kiln.engine import LLM, SamplingParams

from helpers.gguf_files import T, make_hf_model, write_gguf
from helpers.models import assert_greedy_matches_hf

MAX_TOKENS = 8
TOL = 1e-3
PROMPTS = [[1, 17, 250, 33, 9, 101, 77, 5, 300, 2, 41, 42, 43], [500, 3, 3, 3, 64, 128, 256, 9]]

CASES = {
    "llama-F32": ("llama", {}, T.F32),
    "llama-F16": ("llama", {}, T.F16),
    "llama-Q8_0": ("llama", {}, T.Q8_0),
    "llama-Q4_K-Q6_K": ("llama", {"ffn_down": T.Q6_K, "output": T.Q6_K, "token_embd": T.Q8_0}, T.Q4_K),
    "qwen3-Q8_0-Q4_K": ("qwen3", {"ffn": T.Q4_K}, T.Q8_0),
    "gemma3-Q6_K-F16": ("gemma3", {"attn": T.F16}, T.Q6_K),
    "gemma2-Q8_0": ("gemma2", {}, T.Q8_0),
    "qwen2-Q8_0": ("qwen2", {}, T.Q8_0),
    "qwen3moe-Q8_0-Q4_K": ("qwen3moe", {"exps": T.Q4_K}, T.Q8_0),
    "qwen2moe-F16-Q6_K": ("qwen2moe", {"shexp": T.Q6_K}, T.F16),
}
ARCHITECTURES = sorted({arch for arch, _, _ in CASES.values()})


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    return {arch: make_hf_model(tmp_path_factory.mktemp(arch), arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, hf_dirs, tmp_path_factory):
    arch, types, default = CASES[request.param]
    out = tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf"
    return arch, hf_dirs[arch], write_gguf(hf_dirs[arch], out, arch, types, default)


def generate(path, **kwargs):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1, ignore_eos=True)
    with LLM(str(path), max_model_len=128, num_kv_blocks=32, **kwargs) as llm:
        return llm.generate(PROMPTS, params, use_tqdm=False), llm


def test_loads_equal_to_transformers_load_of_the_file(case):
    arch, _, path = case
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    outputs, llm = generate(path, enforce_eager=True)
    assert_greedy_matches_hf(hf, PROMPTS, outputs, MAX_TOKENS, TOL)
    assert llm.engine.startup_stats["model_source"] == f"gguf {path.name}"


def test_float32_llama_file_equals_the_model_it_was_written_from(hf_dirs, tmp_path):
    path = write_gguf(hf_dirs["llama"], tmp_path / "tiny.gguf", "llama", {}, T.F32)
    original = AutoModelForCausalLM.from_pretrained(hf_dirs["llama"], dtype=torch.float32).eval()
    outputs, _ = generate(path, enforce_eager=True)
    assert_greedy_matches_hf(original, PROMPTS, outputs, MAX_TOKENS, TOL)


def test_compiled_and_fp8(hf_dirs, tmp_path):
    """The compiled path reads the same weights; `--quantization fp8` quantizes the dequantized tensors at load."""
    arch, types, default = CASES["llama-Q4_K-Q6_K"]
    path = write_gguf(hf_dirs[arch], tmp_path / "tiny.gguf", arch, types, default)
    eager, _ = generate(tmp_path, enforce_eager=True)  # (a directory holding one GGUF file is that file)
    compiled, _ = generate(path)
    assert [o.outputs[0].token_ids for o in compiled] == [o.outputs[0].token_ids for o in eager]
    fp8, llm = generate(path, enforce_eager=True, quantization="fp8")
    assert llm.engine.startup_stats["quantization"] is not None
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in fp8)


def test_an_architecture_kiln_does_not_serve_is_named(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "bloom.gguf"), "bloom")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="GGUF architecture 'bloom' is not one Kiln serves"):
        LLM(str(tmp_path / "bloom.gguf"))


def test_tensors_are_read_one_at_a_time(tmp_path):
    """Host memory while the tensors stream holds the reader's metadata and about one dequantized tensor (a layer's
    stacked experts here), not the file's worth (tracemalloc sees numpy's allocations)."""
    import gguf

    from kiln.engine.models.gguf_weights import gguf_tensors
    from kiln.engine.models.source import resolve_model

    model_dir = make_hf_model(tmp_path / "hf", "qwen3moe", num_layers=6)
    path = write_gguf(model_dir, tmp_path / "tiny.gguf", "qwen3moe", {}, T.Q8_0)
    config = resolve_model(str(path)).model_config
    tracemalloc.start()
    try:
        gguf.GGUFReader(str(path))
        reader_bytes = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        total = sum(tensor.numel() * 4 for _, tensor in gguf_tensors(path, config))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < reader_bytes + total / 3, (peak, reader_bytes, total)
