"""Shared fixtures: tiny random-weight Hugging Face models, saved locally with a locally trained tokenizer."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

# Compile caches of the tests live in a throwaway folder, never in the user's ~/.cache.
os.environ.setdefault("KILN_CACHE_DIR", tempfile.mkdtemp(prefix="kiln-test-cache-"))

if not torch.cuda.is_available():
    # Triton kernels run in Triton's interpreter on the CPU; it must be chosen before any kernel is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.2,
    eos_token_id=511, bos_token_id=0, pad_token_id=0,
)  # fmt: skip


def tiny_hf_config(kind: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if kind == "llama":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64, "rope_theta": 500000.0}  # fmt: skip
        return LlamaConfig(**TINY, rope_parameters=rope, tie_word_embeddings=False)
    if kind == "mistral":
        return MistralConfig(**TINY, rope_parameters={"rope_type": "default", "rope_theta": 1e6}, sliding_window=None)
    if kind == "qwen2":
        rope = {"rope_type": "default", "rope_theta": 1e6}
        return Qwen2Config(**TINY, rope_parameters=rope, tie_word_embeddings=True)
    if kind == "qwen3":
        rope = {"rope_type": "default", "rope_theta": 1e6}
        shape = {**TINY, "num_attention_heads": 4, "num_key_value_heads": 1}  # GQA 4:1, head_dim 32 != 64 / 4
        return Qwen3Config(**shape, head_dim=32, rope_parameters=rope, tie_word_embeddings=False)
    raise ValueError(kind)


def make_tiny_model_dir(path: Path, kind: str, seed: int = 0, vocab_size: int | None = None) -> Path:
    from transformers import AutoModelForCausalLM

    from kiln.engine.text.tokenizer import builtin_tokenizer

    torch.manual_seed(seed)
    config = tiny_hf_config(kind)
    if vocab_size is not None:
        config.vocab_size, config.eos_token_id = vocab_size, vocab_size - 1
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if kind == "qwen2":  # HF initialises biases to zero; make them matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    builtin_tokenizer(config.vocab_size).save_pretrained(path)
    return path


@pytest.fixture(scope="session", params=["llama", "qwen2", "qwen3"])
def tiny_model_dir(request, tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("mistral"), "mistral")


@pytest.fixture(scope="session")
def tiny_model_dir_qwen3(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("llama"), "llama")
