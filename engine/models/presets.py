"""Built-in presets: the shapes of real models, served with random ("dummy") weights.

They let benchmarks and the README's first command run with no download. Their output is noise, and
every place that uses one says so.
"""

from __future__ import annotations

from typing import Any

DEFAULT_MODEL = "qwen3-0.6b"

_LLAMA3_ROPE_1B = {
    "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}  # fmt: skip
_LLAMA3_ROPE_8B = {**_LLAMA3_ROPE_1B, "factor": 8.0}

PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(
        architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        rms_norm_eps=1e-5, max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE_1B,
        tie_word_embeddings=True, bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
        torch_dtype="bfloat16",
    ),
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE_8B,
        tie_word_embeddings=False, bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
        torch_dtype="bfloat16",
    ),
    "mistral-7b": dict(
        architectures=["MistralForCausalLM"], vocab_size=32768, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, max_position_embeddings=32768, rope_theta=1000000.0, sliding_window=None,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
    ),
    "qwen2.5-0.5b": dict(
        architectures=["Qwen2ForCausalLM"], vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        rms_norm_eps=1e-6, max_position_embeddings=32768, rope_theta=1000000.0,
        tie_word_embeddings=True, bos_token_id=151643, eos_token_id=[151645, 151643], torch_dtype="bfloat16",
    ),
    "qwen2.5-7b": dict(
        architectures=["Qwen2ForCausalLM"], vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        rms_norm_eps=1e-6, max_position_embeddings=32768, rope_theta=1000000.0,
        tie_word_embeddings=False, bos_token_id=151643, eos_token_id=[151645, 151643], torch_dtype="bfloat16",
    ),
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-6, max_position_embeddings=40960, rope_theta=1000000.0,
        tie_word_embeddings=True, bos_token_id=151643, eos_token_id=[151645, 151643], torch_dtype="bfloat16",
    ),
    "qwen3-8b": dict(
        architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-6, max_position_embeddings=40960, rope_theta=1000000.0,
        tie_word_embeddings=False, bos_token_id=151643, eos_token_id=[151645, 151643], torch_dtype="bfloat16",
    ),
}  # fmt: skip
