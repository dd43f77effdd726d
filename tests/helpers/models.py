"""Tiny random-weight Hugging Face models, saved locally with a locally trained tokenizer: the reference models of
the CPU tests (nothing is fetched from a hub)."""

from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
    eos_token_id=511,
    bos_token_id=0,
    pad_token_id=0,
)


def tiny_hf_config(kind: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if kind == "llama":
        rope = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
        }
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
